"""The correctness contract (docs/testing.md), as property tests over drafters and inputs.

The oracle is the eager drafter with inactive logits set to -inf after the post-ops
(``TinyDrafter(_mask=...)``); the compiled drafter must match it exactly in structure and
within dtype tolerance in value, and every token fed to it must be active.
"""
from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nanospec_fx
from drafters import HEAD_KINDS, POST_OPS, RETURNS, EagleLikeDrafter, HiddenOnlyDrafter, TinyDrafter
from helpers import active_mask, assert_close_per_dtype, compile_nanospec
from nanospec_fx.vocab import reports as pass_reports
from nanospec_fx.testing import TOLERANCES

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def drafter_cases(draw):
    vocab = draw(st.integers(33, 300))
    hidden = draw(st.sampled_from([8, 12, 16, 24]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    case = dict(
        vocab=vocab, hidden=hidden, dtype=dtype,
        head=draw(st.sampled_from(HEAD_KINDS)),
        post=draw(st.sampled_from(POST_OPS)),
        returns=draw(st.sampled_from(RETURNS)),
        capacity=draw(st.integers(8, 64)),
        batch=draw(st.integers(1, 3)),
        seq=draw(st.integers(1, 6)),
        extra=draw(st.lists(st.integers(0, vocab - 1), max_size=40)),
        seed=draw(st.integers(0, 2**16)),
    )
    return case


@SETTINGS
@given(drafter_cases())
def test_compiled_drafter_matches_masked_eager(case):
    torch.manual_seed(case["seed"])
    model = (
        TinyDrafter(case["vocab"], case["hidden"], case["head"], case["post"], case["returns"]).to(case["dtype"]).eval()
    )
    ids = torch.randint(0, case["vocab"], (case["batch"], case["seq"]))
    compiled = compile_nanospec(model, capacity=case["capacity"])
    with torch.inference_mode():
        compiled(ids)  # first call creates the state and observes ids
        state = nanospec_fx.active_vocab(model)
        state.observe(torch.tensor(case["extra"], dtype=torch.long))  # a user-chosen active set on top
        out = compiled(ids)
        mask = active_mask(model)
        expected = model(ids, _mask=mask)
    if case["returns"] == "log_softmax_topk":
        # Fewer active tokens than k: the compact top-k pads with -inf and the smallest inactive ids,
        # where eager returns -inf with arbitrary inactive ids. Compare ids only where a token was found.
        (values, indices), (ref_values, ref_indices) = out, expected
        # A log-softmax value z - logsumexp(z) carries the rounding of its logit z, at the logits' scale: two GEMMs
        # summing in another order may round a bf16 logit of 20 one ulp apart (0.125), far above the tolerance
        # of a value near -3 (the Triton kernels, which accumulate in fp32, against eager bf16).
        model.returns = "logits"
        with torch.inference_mode():
            logits = model(ids, _mask=mask)
        model.returns = "log_softmax_topk"
        finite = logits[torch.isfinite(logits)]
        scale = finite.abs().max().item() if finite.numel() else 0.0
        rtol, atol = TOLERANCES[case["dtype"]]
        torch.testing.assert_close(values, ref_values, rtol=rtol,
                                   atol=atol + 2 * torch.finfo(case["dtype"]).eps * scale)
        found = torch.isfinite(ref_values)
        assert torch.equal(indices[found], ref_indices[found]) or case["dtype"] != torch.float32
        assert not mask[indices[~found]].any()
    else:
        assert_close_per_dtype(out, expected, case["dtype"])
    assert len(state) == min(case["capacity"], len(set(ids.flatten().tolist()) | set(case["extra"])), case["vocab"]) \
        or len(state) == state.capacity
    if len(set(ids.flatten().tolist())) <= state.capacity - len(set(case["extra"])):
        assert state.contains(ids).all(), "every token fed to the drafter must be active"


@SETTINGS
@given(st.integers(40, 200), st.integers(1, 4), st.integers(0, 2**16))
def test_inactive_logits_are_exactly_minus_inf_after_softcap(vocab, rows, seed):
    torch.manual_seed(seed)
    model = TinyDrafter(vocab, 16, "linear", "softcap").eval()
    ids = torch.randint(0, vocab, (rows, 3))
    compiled = compile_nanospec(model, capacity=16)
    with torch.no_grad():
        out = compiled(ids)
    mask = active_mask(model)
    assert torch.isneginf(out[..., ~mask]).all()
    assert torch.isfinite(out[..., mask]).all()


def test_eagle_like_drafter_returns_logits_and_hidden():
    torch.manual_seed(0)
    model = EagleLikeDrafter(500, 16).eval()
    ids, hidden = torch.randint(0, 500, (2, 4)), torch.randn(2, 4, 16)
    compiled = compile_nanospec(model, capacity=32)
    with torch.no_grad():
        logits, h = compiled(ids, hidden)
        ref_logits, ref_h = model(ids, hidden, _mask=active_mask(model))
    torch.testing.assert_close(h, ref_h)
    torch.testing.assert_close(logits, ref_logits)
    assert nanospec_fx.active_vocab(model).contains(ids).all()


def test_hidden_only_drafter_grows_through_observe():
    torch.manual_seed(0)
    model = HiddenOnlyDrafter(100, 8).eval()
    compiled = compile_nanospec(model, capacity=16)
    x = torch.randn(3, 8)
    with torch.no_grad():
        out = compiled(x)
        assert torch.isneginf(out).all(), "nothing observed yet: every logit is -inf"
        state = nanospec_fx.active_vocab(model)
        state.observe(torch.tensor([5, 7, 99]))
        out = compiled(x)
    torch.testing.assert_close(out, model(x, _mask=active_mask(model)))
    assert sorted(state.token_ids().tolist()) == [5, 7, 99]


def test_topk_in_graph_runs_on_compact_logits_and_only_returns_active_tokens():
    torch.manual_seed(0)
    model = TinyDrafter(200, 16, post="softcap", returns="log_softmax_topk").eval()
    compiled = compile_nanospec(model, capacity=32)
    ids = torch.randint(0, 200, (2, 5))
    with torch.no_grad():
        values, indices = compiled(ids)
        ref_values, ref_indices = model(ids, _mask=active_mask(model))
    state = nanospec_fx.active_vocab(model)
    assert pass_reports.reports(state)[-1].consumers == ["log_softmax", "topk"]
    assert pass_reports.reports(state)[-1].exits == []  # the [..., V] logits are never built
    assert state.contains(indices).all()
    torch.testing.assert_close(values, ref_values)
    assert torch.equal(indices, ref_indices)


def test_topk_with_fewer_active_tokens_than_k_pads_with_the_smallest_inactive_ids():
    torch.manual_seed(0)
    model = TinyDrafter(50, 8, returns="log_softmax_topk").eval()
    compiled = compile_nanospec(model, capacity=8)
    with torch.no_grad():
        values, indices = compiled(torch.tensor([[7, 7]]))
    assert indices[..., 0].eq(7).all() and indices[..., 1:].eq(torch.tensor([0, 1])).all()  # valid ids, never -1
    assert values[..., 0].eq(0).all() and torch.isneginf(values[..., 1:]).all()


def test_plain_head_uses_the_fused_op():
    model = TinyDrafter(50, 8).eval()
    compiled = compile_nanospec(model, capacity=8)
    with torch.no_grad():
        out = compiled(torch.tensor([[1, 2]]))
        torch.testing.assert_close(out, model(torch.tensor([[1, 2]]), _mask=active_mask(model)))
    report = pass_reports.reports(nanospec_fx.active_vocab(model))[-1]
    assert report.exits == ["output"] and report.post_ops == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_inductor(dtype):
    """The same contract through inductor (the default), with two different active sets."""
    torch.manual_seed(0)
    model = TinyDrafter(300, 16, "linear_bias", "softcap", "tuple").to(dtype).eval()
    compiled = compile_nanospec(model, capacity=24, inductor=True)
    with torch.inference_mode():
        for step in range(2):
            ids = torch.randint(0, 300, (2, 4))
            out = compiled(ids)
            assert_close_per_dtype(out, model(ids, _mask=active_mask(model)))


class InPlaceSoftcap(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, _mask=None):
        z = self.lm_head(self.embed(ids))
        z.div_(5.0).tanh_().mul_(5.0)
        return z if _mask is None else z.masked_fill(~_mask, float("-inf"))


def test_in_place_post_ops_keep_inactive_tokens_at_minus_inf():
    torch.manual_seed(0)
    model = InPlaceSoftcap(80, 8).eval()
    compiled = compile_nanospec(model, capacity=8)
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        out = compiled(ids)
        expected = model(ids, _mask=active_mask(model))
    torch.testing.assert_close(out, expected)


@pytest.mark.slow
@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(drafter_cases())
def test_contract_with_triton_kernels(use_kernels, case):
    """The whole backend on our Triton kernels (the interpreter on CPU, real kernels on CUDA)."""
    pytest.importorskip("triton")
    use_kernels("triton")
    from nanospec_fx.kernels.dispatch import implementation_for

    assert "triton" in implementation_for("observe", torch.zeros(1)).__module__
    test_compiled_drafter_matches_masked_eager.hypothesis.inner_test(case)
