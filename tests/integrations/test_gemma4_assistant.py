"""Gemma-4's assistant head (``Gemma4AssistantMaskedEmbedder``): a trained centroid selection of the tied table's rows.

Its rows are chosen in the graph (top-k of centroid scores -> an int64 cluster -> token ordering -> rows of the
head weight). The pass must not take the centroid projection for a head over a "vocabulary" of clusters (the
ordering table has one row per centroid): it leaves the graph unchanged, with a warning, and exact.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.gemma4_assistant.modeling_gemma4_assistant")

import nanospec_fx  # noqa: E402

V, H = 256, 32


class CentroidHeadDrafter(nn.Module):
    """A token embedding tied to the head, a body, and Gemma-4's centroid-selected head over the tied table."""

    def __init__(self):
        super().__init__()
        config = transformers.Gemma4AssistantConfig(
            text_config=dict(model_type="gemma4_text", vocab_size=V, hidden_size=H, intermediate_size=64,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                             hidden_size_per_layer_input=0, vocab_size_per_layer_input=0),
            backbone_hidden_size=H, use_ordered_embeddings=True, num_centroids=16, centroid_intermediate_top_k=4)
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.masked_embedding = modeling.Gemma4AssistantMaskedEmbedder(config)
        self.masked_embedding.token_ordering.copy_(torch.randperm(V, generator=torch.Generator().manual_seed(0)))

    def forward(self, ids):
        return self.masked_embedding(self.body(self.embed(ids)), self.embed.weight)


def test_centroid_selected_head_is_left_exact_with_a_warning():
    torch.manual_seed(0)
    drafter = CentroidHeadDrafter().eval()
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = drafter(ids)
    # .item() (the mask value) would split the graph: captured, the whole selection is in one graph
    with torch._dynamo.config.patch(capture_scalar_outputs=True), \
            pytest.warns(nanospec_fx.NanoSpecWarning, match="no LM head found"):
        compiled = torch.compile(drafter, backend="nanospec", options={"capacity": 8, "inductor": False})
        with torch.inference_mode():
            out = compiled(ids)
    assert torch.equal(out, expected), "the centroid selection is untouched"
    assert not nanospec_fx.explain(compiled, quiet=True).heads, "no head over the 16 centroids"


def _tiny_pair(path):
    """A Gemma-4 target (hidden 64) and its assistant (hidden 32, 16 centroids of 16 tokens, top 4), random, written
    with ``save_pretrained`` and loaded back (the token ordering is a buffer of the checkpoint)."""
    torch.manual_seed(0)
    layers = dict(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=32, hidden_size_per_layer_input=0,
                  vocab_size_per_layer_input=0, vocab_size=V)
    target = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(hidden_size=64, intermediate_size=128,
                                                                          **layers))
    config = transformers.Gemma4AssistantConfig(
        text_config=dict(model_type="gemma4_text", hidden_size=H, intermediate_size=64, **layers),
        backbone_hidden_size=64, use_ordered_embeddings=True, num_centroids=16, centroid_intermediate_top_k=4)
    assistant = transformers.Gemma4AssistantForCausalLM(config)
    assistant.masked_embedding.token_ordering.copy_(torch.randperm(V, generator=torch.Generator().manual_seed(0)))
    assistant.generation_config.num_assistant_tokens = 4  # unset in a fresh config; generate needs it
    target.save_pretrained(path / "target")
    assistant.save_pretrained(path / "assistant")
    target = transformers.Gemma4ForCausalLM.from_pretrained(path / "target").eval()
    assistant = transformers.Gemma4AssistantForCausalLM.from_pretrained(path / "assistant").eval()
    assert torch.equal(assistant.masked_embedding.token_ordering.sort().values, torch.arange(V)), "ordering loaded"
    return target, assistant


@pytest.mark.parametrize("capture_scalars", [False, True], ids=["item-breaks-the-graph", "item-captured"])
def test_generate_with_the_compiled_assistant_is_the_targets_greedy_output(tmp_path, capture_scalars):
    """``target.generate(ids, assistant_model=assistant)`` (transformers' SinglePositionMultiTokenCandidateGenerator)
    with the assistant compiled in place: its centroid-selected head is left as it is, with one warning."""
    target, assistant = _tiny_pair(tmp_path)
    prompts = [torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(n)) for n in (6, 9)]
    expected = [target.generate(ids, max_new_tokens=12, do_sample=False) for ids in prompts]
    drafted = []
    generator = transformers.generation.candidate_generator.SinglePositionMultiTokenCandidateGenerator
    get_candidates = generator.get_candidates

    def recording(self, *args, **kwargs):  # outside the compiled assistant: what the drafting step returns
        candidates, logits = get_candidates(self, *args, **kwargs)
        if logits is not None:
            drafted.append(logits)
        return candidates, logits

    with torch._dynamo.config.patch(capture_scalar_outputs=capture_scalars), \
            pytest.MonkeyPatch.context() as mp, pytest.warns(nanospec_fx.NanoSpecWarning) as caught:
        mp.setattr(generator, "get_candidates", recording)
        assistant.compile(backend="nanospec", options={"capacity": 8, "inductor": False})
        outputs = [target.generate(ids, assistant_model=assistant, max_new_tokens=12, do_sample=False)
                   for ids in prompts]
    for out, want in zip(outputs, expected):
        assert torch.equal(out, want), "greedy output of the target alone"
    assert drafted, "the assistant drafted"
    # the selection's logits: finite everywhere, the masked value below every selected one; not a capacity-8 set
    assert all(bool(torch.isfinite(x).all()) and int((x > x.min()).sum(-1).max()) > 8 for x in drafted)
    said = {str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)}
    assert len(said) == 1, said  # one message (Python's default filter shows it once)
    (message,) = said
    if capture_scalars:
        assert "no LM head found" in message
    else:
        assert "graph break" in message and "modeling_gemma4_assistant.py" in message and ".item()" in message
    assert not any(h.rewritten for h in nanospec_fx.explain(assistant, quiet=True).heads)
