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
    torch._dynamo.reset()
    # .item() (the mask value) would split the graph: captured, the whole selection is in one graph
    with torch._dynamo.config.patch(capture_scalar_outputs=True), \
            pytest.warns(nanospec_fx.NanoSpecWarning, match="no LM head found"):
        compiled = torch.compile(drafter, backend="nanospec", options={"capacity": 8, "inductor": False})
        with torch.inference_mode():
            out = compiled(ids)
    assert torch.equal(out, expected), "the centroid selection is untouched"
    assert not nanospec_fx.explain(compiled, quiet=True).heads, "no head over the 16 centroids"
