"""generate(use_mtp=True) with nanospec_fx.speculative_pair(target, mtp=True): compact MTP drafting, output equal to
plain greedy, sampling that keeps the target's distribution (chi-square), a reset set per request."""
from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.generation import LogitsProcessorList  # noqa: E402
from transformers.generation.candidate_generator import MTPCandidateGenerator  # noqa: E402
from transformers.modeling_layers import MtpModel  # noqa: E402

import nanospec_fx  # noqa: E402
from nanospec_fx.vocab import reports as pass_reports  # noqa: E402
from nanospec_fx.eval.loaders import tiny_mtp_checkpoint  # noqa: E402
from nanospec_fx.sampling import SpeculativeSampler  # noqa: E402
from nanospec_fx.testing import chi_square_test, sequence_distribution  # noqa: E402

V = 500


class MaskInactive:
    """A logits processor: -inf at every token outside ``active`` (the dense oracle of a compact head)."""

    def __init__(self, active: torch.Tensor, vocab: int):
        self.keep = torch.zeros(vocab, dtype=torch.bool)
        self.keep[active] = True

    def __call__(self, input_ids, scores):
        return scores.masked_fill(~self.keep, float("-inf"))


class GreedyDraftCheck:
    """Stands in for the generator's greedy MTP call (:class:`nanospec_fx.integrations.mtp.MtpTokens`): runs it, then the same
    layers uncompiled on a copy of the MTP cache, their logits masked to the set as the call left it (the drafted
    ids can only have joined it: each was the best of the set before), and records both drafts."""

    def __init__(self, tokens, state, vocab: int):
        self.tokens, self.state, self.vocab = tokens, state, vocab
        self.drafts = []

    def __call__(self, **kwargs):
        cache = copy.deepcopy(kwargs["mtp_cache"])
        ids, logits, loss = self.tokens(**kwargs)
        mask = MaskInactive(self.state.token_ids(), self.vocab)
        oracle = dict(kwargs, mtp_cache=cache, logits_processor=LogitsProcessorList([*(kwargs["logits_processor"] or []),
                                                                                       mask]))
        want, _, _ = self.tokens.mtp._call_impl(**oracle)
        self.drafts.append((ids.clone(), want.clone(), logits))
        return ids, logits, loss


def check_greedy_drafts(state, vocab: int = V):
    """``(checks, spy)``: set ``spy`` as ``MTPCandidateGenerator.get_candidates`` to put a :class:`GreedyDraftCheck`
    on every greedy MTP generator the next ``generate`` calls build (collected in ``checks``)."""
    from nanospec_fx.integrations.mtp import MtpTokens

    checks = []
    original = MTPCandidateGenerator.get_candidates

    def spy(self, *a, **k):
        if isinstance(self.mtp_model, MtpTokens):
            checks.append(GreedyDraftCheck(self.mtp_model, state, vocab))
            self.mtp_model = checks[-1]
        return original(self, *a, **k)

    return checks, spy


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_mtp_pair_drafts_compact_and_keeps_greedy_output(kind, tmp_path, monkeypatch):
    """Greedy: equal to plain greedy; the MTP layers draft the argmax over the set (the dense oracle: their logits
    over [V] with -inf outside it) in a graph that builds no [V] row (compact argmax, ids mapped back: the pass's
    report of that graph), and hand transformers no logits (greedy reads none)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = transformers.AutoModelForCausalLM.from_pretrained(tiny_mtp_checkpoint(tmp_path / kind, kind, vocab_size=V)).eval()
        ids = torch.randint(1, V, (1, 8), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            plain = target.generate(ids, max_new_tokens=10, do_sample=False)
            mtp_dense = target.generate(ids, max_new_tokens=10, do_sample=False, use_mtp=True)
        state = nanospec_fx.speculative_pair(target, mtp=True, capacity=64, inductor=False)
        checks, spy = check_greedy_drafts(state)
        monkeypatch.setattr(MTPCandidateGenerator, "get_candidates", spy)
        with torch.inference_mode():
            first = target.generate(ids, max_new_tokens=10, do_sample=False, use_mtp=True)
            size = len(state)
            second = target.generate(ids[:, :5], max_new_tokens=6, do_sample=False, use_mtp=True)
        assert torch.equal(first, plain) and torch.equal(mtp_dense, plain)
        with torch.inference_mode():
            assert torch.equal(second, target.generate(ids[:, :5], max_new_tokens=6, do_sample=False))
        drafts = [d for c in checks for d in c.drafts]
        assert len(checks) == 2 and drafts, "each greedy generate call drafted with the token-only MTP call"
        for got, want, logits in drafts:
            assert torch.equal(got, want) and logits is None
        graphs = pass_reports.reports(state)
        assert graphs and all(r.consumers and not r.exits and not r.materialised for r in graphs), \
            "the drafting graphs read the head only through a compact selection: no [V] row"
        assert 0 < len(state) <= size, "the second request started from a reset set"
        nanospec_fx.detach(target)
        assert "_get_candidate_generator" not in vars(target)
    finally:
        torch.set_num_threads(threads)


def tiny_deepseek(depth, vocab=V, seed=1):
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=2,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, num_mtp_layers=depth,
        max_position_embeddings=128, pad_token_id=0, bos_token_id=None, eos_token_id=None, initializer_range=0.2,
        dtype="float32", num_hidden_layers=2, first_k_dense_replace=2, num_key_value_heads=2, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    return transformers.DeepseekV3ForCausalLM(config).eval()


def mtp_layers(target, depth):
    """``MtpModel(target, depth)`` with every weight set: transformers 5.25 leaves the MoE experts' tensors of a
    fresh MtpModel uninitialised (torch.empty: NaN or 1e38 entries, NaN drafts)."""
    layers = MtpModel(target, depth).eval()
    with torch.no_grad():
        for name, value in layers.named_parameters():
            if ".experts." in name:
                torch.nn.init.normal_(value, std=0.2)
    assert all(torch.isfinite(p).all() for p in layers.parameters())
    return layers


@pytest.mark.parametrize("depth", [2, 3])
def test_mtp_pair_with_several_mtp_layers_handed_in_keeps_greedy_output(depth):
    """Depths 2-3: DeepSeek-V3's load pattern matches one MTP layer index, so the layers are passed as mtp=."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = tiny_deepseek(depth)
        layers = mtp_layers(target, depth)
        ids = torch.randint(1, V, (1, 8), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            plain = target.generate(ids, max_new_tokens=10, do_sample=False)
        state = nanospec_fx.speculative_pair(target, mtp=layers, capacity=64, inductor=False)
        resets = []
        original_reset = state.reset
        state.reset = lambda: (resets.append(1), original_reset())[1]
        try:
            with torch.inference_mode():
                out = target.generate(ids, max_new_tokens=10, do_sample=False, use_mtp=True)
                again = target.generate(ids, max_new_tokens=10, do_sample=False, use_mtp=True)
        finally:
            del state.reset
        assert torch.equal(out, plain) and torch.equal(again, plain)
        assert len(resets) == 2, "each generate call (one request) starts from a reset set"
        assert 0 < len(state) <= 64
        nanospec_fx.detach(target)
    finally:
        torch.set_num_threads(threads)


def test_speculative_pair_mtp_rejects_a_drafter_and_needs_one_without_mtp():
    target = tiny_deepseek(1, vocab=16)
    with pytest.raises(ValueError, match="pass no drafter"):
        nanospec_fx.speculative_pair(target, tiny_deepseek(1, vocab=16), mtp=True)
    with pytest.raises(TypeError, match="mtp=True"):
        nanospec_fx.speculative_pair(target)
    with pytest.raises(TypeError, match="MtpModel"):
        nanospec_fx.speculative_pair(target, mtp=torch.nn.Linear(2, 2))


# 67: wider than every weight of the tiny model (a weight with a vocabulary-wide axis that the MoE's grouped_mm reads
# with integer offsets would look like a hand-written lookup: dense with a warning)
SAMPLING_V, TEMPERATURE, PROMPT, N = 67, 1.5, torch.tensor([[1, 2, 3]]), 400


def test_mtp_sampling_keeps_the_target_distribution(monkeypatch):
    """do_sample=True: the MTP layers sample from the compact (pruned) q; transformers' speculative sampling keeps
    the target's distribution (chi-square against the exact distribution of the next 2 tokens)."""
    import transformers.generation.utils as generation_utils

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = tiny_deepseek(2, vocab=SAMPLING_V, seed=3)
        probs = lambda ids: SpeculativeSampler(TEMPERATURE).probs(target(ids).logits[:, -1])  # noqa: E731
        exact = sequence_distribution(probs, PROMPT, 2)
        state = nanospec_fx.speculative_pair(target, mtp=mtp_layers(target, 2), capacity=4, inductor=False)
        accepted, original = [], generation_utils._speculative_sampling

        def spy(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs):
            assert (torch.isfinite(candidate_logits).sum(-1) <= 4).all(), "q is the compact head's"
            assert state.contains(candidate_input_ids[0, -candidate_length:]).all(), "drafts come from the set"
            out = original(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs)
            accepted.append(int(out[1]))
            return out

        monkeypatch.setattr(generation_utils, "_speculative_sampling", spy)
        torch.manual_seed(0)  # transformers draws from the global generator
        samples = []
        with torch.inference_mode():
            for _ in range(N):
                ids = target.generate(PROMPT, max_new_tokens=2, do_sample=True, temperature=TEMPERATURE, top_k=0,
                                      use_mtp=True)  # top_k=0: no default top-50 (the exact probs have none)
                samples.append(ids[0, PROMPT.shape[1]:])
        result = chi_square_test(torch.stack(samples), exact)
        assert not result.rejected, str(result)
        assert len(accepted) >= N and accepted.count(0) > 20 and sum(accepted) > 10, \
            "speculative sampling ran, with both rejected and accepted drafts"
        print(result, f"; drafts accepted per round: {sum(accepted) / len(accepted):.2f}")
        nanospec_fx.detach(target)
    finally:
        torch.set_num_threads(threads)
