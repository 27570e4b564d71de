"""The active vocabulary's invariants across state, API and ops: every rewritten head is reachable, cached rows
never go stale, autocast and autograd behave as eager, top-k pads with valid ids, observe() rejects what is not ids,
one state per head weight."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

import nanospec_fx
from nanospec_fx.vocab.state import ActiveVocab, state_for
from nanospec_fx.vocab.config import VocabConfig
from helpers import compile_nanospec
from mlp_drafter import H, V, Drafter  # beside this file

def active(model, **kw) -> torch.Tensor:
    return nanospec_fx.active_vocab(model, **kw).contains(torch.arange(V))


def check_against_oracle(model, compiled, ids):
    with torch.no_grad():
        out = compiled(ids)
        want = model(ids, _mask=active(model))
    assert out.dtype == want.dtype
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    return out


# ----------------------------------------------------------------------------- 1. reachable state
@pytest.mark.parametrize("bias", [False, True])
def test_a_head_held_in_buffers_is_reachable_through_the_public_api(bias):
    model = Drafter("buffer", bias=bias).eval()
    compiled = compile_nanospec(model, capacity=16)
    ids = torch.tensor([[3, 5, 9]])
    check_against_oracle(model, compiled, ids)
    state = nanospec_fx.active_vocab(model)
    assert state.weight is model.head_w and set(state.token_ids().tolist()) == {3, 5, 9}
    assert nanospec_fx.active_vocab(model, head="head_w") is state
    (head,) = nanospec_fx.explain(compiled).heads
    assert head.name == "head_w" and head.state is state
    state.observe([30])  # observe / reset / request act on what the compiled graph reads
    assert check_against_oracle(model, compiled, ids)[0, 0, 30].isfinite()
    with state.request():
        assert len(state) == 0
    assert len(state) == 0


@pytest.mark.parametrize("name", ["lm_head.weight", "lm_head", "embed.weight", "embed"])
def test_every_name_of_a_tied_head_finds_its_state(name):
    model = Drafter("tied").eval()
    compiled = compile_nanospec(model, capacity=16)
    with torch.no_grad():
        compiled(torch.tensor([[1, 2]]))
    assert nanospec_fx.active_vocab(model, head=name) is nanospec_fx.active_vocab(model)
    assert len(nanospec_fx.explain(model).heads) == 1  # one head, not one per name
    with pytest.raises(KeyError, match="lm_head.weight"):
        nanospec_fx.active_vocab(model, head="body.0")


# ----------------------------------------------------------------------------- 2. stale weights
def test_load_state_dict_after_the_first_call_is_picked_up():
    model, other = Drafter("linear", bias=True, seed=0).eval(), Drafter("linear", bias=True, seed=1).eval()
    compiled = compile_nanospec(model, capacity=16)
    ids = torch.tensor([[3, 5, 9]])
    before = check_against_oracle(model, compiled, ids)
    model.load_state_dict(other.state_dict())  # copies in place: same tensors, new values
    after = check_against_oracle(model, compiled, ids)
    assert not torch.allclose(before[0, :, [3, 5, 9]], after[0, :, [3, 5, 9]])


@pytest.mark.parametrize("kind", ["linear", "tied"])
def test_in_place_writes_to_the_head_weight_are_picked_up(kind):
    model = Drafter(kind).eval()
    compiled = compile_nanospec(model, capacity=16)
    ids = torch.tensor([[3, 5, 9]])
    check_against_oracle(model, compiled, ids)
    weight = model.lm_head.weight if kind == "linear" else model.embed.weight
    with torch.no_grad():
        weight.mul_(-3.0)  # for the tied head this is the embedding table too
    check_against_oracle(model, compiled, ids)
    with torch.inference_mode():
        weight[5] += 1.0  # a write inside inference_mode counts too
    check_against_oracle(model, compiled, ids)


def test_an_optimizer_step_on_the_head_is_picked_up():
    model = Drafter("linear", bias=True).eval()
    compiled = compile_nanospec(model, capacity=16)
    ids = torch.tensor([[3, 5, 9]])
    check_against_oracle(model, compiled, ids)
    opt = torch.optim.SGD(model.lm_head.parameters(), lr=1.0)
    model(ids).logsumexp(-1).sum().backward()  # eager training step on the (dense) model
    opt.step()
    check_against_oracle(model, compiled, ids)


def test_refresh_needs_no_host_sync_and_ignores_free_slots():
    w = torch.randn(V, H)
    state = ActiveVocab(w, capacity=6)
    state.observe([7, 2])
    with torch.no_grad():
        w.add_(1.0)
    assert state.refresh_if_stale() and not state.refresh_if_stale()
    torch.testing.assert_close(state.cache_w[:2], w[[7, 2]])


# ----------------------------------------------------------------------------- 3. autocast
@pytest.mark.parametrize("inductor", [False, True])
def test_autocast_gives_eager_dtype_and_values(inductor):
    model = Drafter("linear", bias=True).eval()
    compiled = compile_nanospec(model, capacity=16, inductor=inductor)
    ids = torch.tensor([[3, 5, 9]])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(ids)
        want = model(ids, _mask=active(model))
    assert want.dtype == torch.bfloat16 and out.dtype == want.dtype
    torch.testing.assert_close(out, want, rtol=2e-2, atol=5e-2)


def test_head_ops_follow_the_current_autocast_dtype():
    w, b = torch.randn(V, H), torch.randn(V)
    state = ActiveVocab(w, b, capacity=8)
    state.observe([1, 4])
    ids, _, cursor, cw, cb = state.tensors()
    x = torch.randn(2, H)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            assert torch.ops.nanospec.compact_logits(x, cw, cb, cursor).dtype == dtype
            assert torch.ops.nanospec.head_logits(x, cw, cb, ids, cursor, V).dtype == dtype
            assert F.linear(x, w, b).dtype == dtype
    x64 = x.double()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as F.linear: float64 is left alone
        assert torch.ops.nanospec.compact_logits(x64, cw.double(), cb.double(), cursor).dtype == torch.float64


# ----------------------------------------------------------------------------- 4. top-k padding
class TreeDrafter(Drafter):
    """Drafts two levels in one graph: embeds its own top-k (fewer tokens may be active than k)."""

    def __init__(self, k):
        super().__init__("linear")
        self.k = k

    def forward(self, ids, _mask=None):
        z = super().forward(ids, _mask)[:, -1]
        first = z.topk(self.k, dim=-1).indices  # [B, k] token ids, fed back into the drafter
        return first, super().forward(first, _mask)


@pytest.mark.parametrize("k", [5, 20])  # 20 > capacity 8
def test_a_drafter_that_embeds_its_own_topk_with_few_active_tokens_does_not_crash(k):
    model = TreeDrafter(k).eval()
    compiled = compile_nanospec(model, capacity=8, observe_inputs=False)
    state = nanospec_fx.attach(model, head="lm_head", capacity=8, observe_inputs=False)
    state.observe([6, 2])
    with torch.no_grad():
        first, second = compiled(torch.tensor([[1, 2]]))
    assert first.shape == (1, k) and ((first >= 0) & (first < V)).all()
    assert first[0, :2].tolist() in ([6, 2], [2, 6])
    inactive = [t for t in range(V) if t not in (2, 6)]
    assert first[0, 2:].tolist() == inactive[: k - 2]  # the smallest inactive ids, ascending
    assert second.shape == (1, k, V)


def test_topk_padding_is_identical_in_reference_and_triton():
    pytest.importorskip("triton")
    from nanospec_fx.kernels import reference as R, triton_select as T

    ids = torch.tensor([5, 0, 3, -1, -1, -1, -1, -1])
    cursor = torch.tensor([3])
    compact = torch.randn(3, 8)
    for k in (0, 2, 3, 6, 11):
        for largest in (True, False):
            rv, rt = R.compact_topk(compact, ids, cursor, k, largest)
            tv, tt = T.compact_topk(compact, ids, cursor, k, largest)
            assert torch.equal(rt, tt) and torch.equal(rv, tv)
            assert rt[:, 3:].tolist() == [[1, 2, 4, 6, 7, 8, 9, 10][: max(k - 3, 0)]] * 3


# ----------------------------------------------------------------------------- 5. input validation
ACCEPTED = [
    (7, [7]),
    (np.int32(7), [7]),
    ([1, 2, 2], [1, 2]),
    ((4, (5, [6])), [4, 5, 6]),
    ([[1, 2], [3]], [1, 2, 3]),  # ragged nested lists
    (range(3), [0, 1, 2]),
    (np.array([[3, 1]], dtype=np.int16), [3, 1]),
    (np.array([9], dtype=np.uint8), [9]),
    ([torch.tensor([1, 2]), 3], [1, 2, 3]),
    ([], []),
    (torch.tensor([]), []),  # an empty list made into a tensor is float32: nothing to refuse
    (np.array([]), []),
] + [(torch.tensor([3, 4], dtype=d), [3, 4]) for d in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)]


@pytest.mark.parametrize("ids,expect", ACCEPTED, ids=lambda v: type(v).__name__)
def test_observe_accepts_what_is_clearly_token_ids(ids, expect):
    state = ActiveVocab(torch.randn(V, H), capacity=8)
    state.observe(ids)
    assert state.token_ids().tolist() == expect
    assert state.contains(ids).all()


REJECTED = [1.0, [1.0, 2.0], [True, False], True, "12", b"12", [1, "2"], [1, 2.5], None, {1: 2},
            torch.tensor([1.0]), torch.tensor([True]), np.array([1.0]), np.array([True]), [np.float32(1)], object()]


@pytest.mark.parametrize("bad", REJECTED, ids=lambda v: repr(v)[:20])
def test_observe_rejects_everything_else_and_leaves_the_state_unchanged(bad):
    state = ActiveVocab(torch.randn(V, H), capacity=8)
    state.observe([1, 2])
    before = [t.clone() for t in state.tensors()]
    with pytest.raises(TypeError, match="Python int, an integer tensor, a numpy integer array"):
        state.observe(bad)
    with pytest.raises(TypeError):
        state.observe(bad, validate=False)
    with pytest.raises(TypeError):
        state.contains(bad)
    for t, b in zip(state.tensors(), before):
        assert torch.equal(t, b)


def test_observe_of_a_huge_python_int_is_out_of_range():
    state = ActiveVocab(torch.randn(V, H), capacity=8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        state.observe([2**70])
    assert len(state) == 0


# ----------------------------------------------------------------------------- 7. one state per head weight
def test_two_wrappers_with_the_same_options_share_one_state():
    model = Drafter("linear").eval()
    a = torch.compile(model, backend="nanospec", options={"inductor": False, "capacity": 16})
    b = torch.compile(model, backend="nanospec", options={"inductor": False, "capacity": 16, "observe_inputs": False})
    with torch.no_grad():
        a(torch.tensor([[3]]))
        b(torch.tensor([[4]]))
    state = nanospec_fx.active_vocab(model)
    state.observe([11])
    with torch.no_grad():
        for wrapper in (a, b):
            out = wrapper(torch.tensor([[3]]))
            assert out[0, 0, 11].isfinite() and out[0, 0, 12] == float("-inf")


def test_two_wrappers_with_different_options_fail_clearly():
    model = Drafter("linear").eval()
    a = torch.compile(model, backend="nanospec", options={"inductor": False, "capacity": 16})
    b = torch.compile(model, backend="nanospec", options={"inductor": False, "capacity": 8})
    with torch.no_grad():
        a(torch.tensor([[3]]))
        with pytest.raises(Exception, match=r"(?s)lm_head.weight.*capacity: 16 -> 8.*same vocabulary options"):
            b(torch.tensor([[3]]))
    state = nanospec_fx.active_vocab(model)
    assert state.capacity == 16
    state.observe([11])
    with torch.no_grad():
        assert a(torch.tensor([[3]]))[0, 0, 11].isfinite()  # the first wrapper still reads the state


def test_recompiling_with_other_options_after_a_reset_keeps_the_users_handle():
    model = Drafter("linear").eval()
    handle = nanospec_fx.attach(model, head="lm_head")  # created before any compile, default options
    handle.observe([5, 6])
    compiled = compile_nanospec(model, capacity=8)
    with torch.no_grad():
        compiled(torch.tensor([[3]]))
    assert nanospec_fx.active_vocab(model) is handle and handle.capacity == 8
    assert set(handle.token_ids().tolist()) == {5, 6, 3}
    compiled = compile_nanospec(model, capacity=12)  # resets dynamo: the old wrapper is gone
    gc.collect()
    with torch.no_grad():
        out = compiled(torch.tensor([[4]]))
    assert handle.capacity == 12 and set(handle.token_ids().tolist()) == {5, 6, 3, 4}
    handle.observe([20])
    with torch.no_grad():
        assert compiled(torch.tensor([[4]]))[0, 0, 20].isfinite()
    assert out.shape == (1, 1, V)


def test_state_for_rebuilds_in_place_only_when_nothing_running_reads_it():
    w = nn.Parameter(torch.randn(V, H), requires_grad=False)
    state = state_for(w, None, VocabConfig(capacity=8))

    class Reader:  # stands in for a live compiled wrapper
        pass

    reader = Reader()
    state.bind(reader)
    with pytest.raises(ValueError, match="capacity: 8 -> 9"):
        state_for(w, None, VocabConfig(capacity=9))
    assert state_for(w, None, VocabConfig(capacity=8)) is state
    del reader
    gc.collect()
    assert state_for(w, None, VocabConfig(capacity=9)) is state and state.capacity == 9 and state.generation == 1


# ----------------------------------------------------------------------------- 8. gradients with a frozen head
@pytest.mark.parametrize("post,inductor", [("none", False), ("softcap", False), ("softcap", True)])
def test_a_frozen_head_backpropagates_into_the_body_like_the_masked_dense_head(post, inductor):
    class Trainee(Drafter):
        def forward(self, ids, _mask=None):
            z = super().forward(ids)
            if post == "softcap":
                z = 4.0 * torch.tanh(z / 4.0)
            return z if _mask is None else z.masked_fill(~_mask, float("-inf"))

    model = Trainee("linear", bias=True)
    model.lm_head.requires_grad_(False)  # EAGLE training: head frozen, body trainable
    compiled = compile_nanospec(model, capacity=16, inductor=inductor)
    ids, target = torch.tensor([[3, 5, 9, 5]]), torch.tensor([[5, 9, 5, 3]])

    def loss_and_grads(fn):
        model.zero_grad()
        logits = fn(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())  # targets are active tokens
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.body.parameters()] + [model.embed.weight.grad.clone()]

    got_loss, got = loss_and_grads(compiled)  # a NanoSpecWarning (dense fallback) would fail (conftest)
    mask = active(model)
    want_loss, want = loss_and_grads(lambda x: model(x, _mask=mask))
    torch.testing.assert_close(got_loss, want_loss)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert model.lm_head.weight.grad is None


def test_head_op_backward_passes_gradcheck():
    torch.manual_seed(0)
    w, b = torch.randn(V, H, dtype=torch.float64), torch.randn(V, dtype=torch.float64)
    state = ActiveVocab(w, b, capacity=8)
    state.observe([3, 7, 1, 5])
    ids, _, cursor, cw, cb = state.tensors()
    ops = torch.ops.nanospec
    finite = lambda t: torch.where(torch.isfinite(t), t, torch.zeros((), dtype=t.dtype))  # noqa: E731
    x = torch.randn(2, 3, H, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: finite(ops.compact_logits(x, cw, cb, cursor)), x)
    assert torch.autograd.gradcheck(lambda x: finite(ops.head_logits(x, cw, cb, ids, cursor, V)), x)
    assert torch.autograd.gradcheck(
        lambda x: finite(ops.scatter_logits(torch.tanh(ops.compact_logits(x, cw, cb, cursor)), ids, cursor, V)), x)
    assert torch.autograd.gradcheck(
        lambda x: finite(ops.compact_topk(ops.compact_logits(x, cw, cb, cursor), ids, cursor, 6)[0]), x
    )
    # and against the dense masked oracle
    mask = state.contains(torch.arange(V))
    g = torch.randn(2, 3, V, dtype=torch.float64)
    dense = F.linear(x, w, b).masked_fill(~mask, float("-inf"))
    (want,) = torch.autograd.grad(torch.where(mask, dense, 0.0).mul(g).sum(), x)
    (got,) = torch.autograd.grad(torch.where(mask, ops.head_logits(x, cw, cb, ids, cursor, V), 0.0).mul(g).sum(), x)
    torch.testing.assert_close(got, want)


# ----------------------------------------------------------------------------- 9. observe before the first call
def test_observe_on_a_drafter_that_was_never_called():
    model = Drafter("linear").eval()
    model.get_output_embeddings = lambda: model.lm_head  # as transformers models have
    state = nanospec_fx.active_vocab(model)  # created on demand
    state.observe([17])
    compiled = compile_nanospec(model, capacity=16)
    with torch.no_grad():
        out = compiled(torch.tensor([[2]]))
    assert nanospec_fx.active_vocab(model) is state and out[0, 0, 17].isfinite()
    plain = Drafter("linear").eval()
    assert nanospec_fx.active_vocab(plain, head="lm_head").weight is plain.lm_head.weight
    with pytest.raises(LookupError, match="attach"):
        nanospec_fx.active_vocab(Drafter("linear"))


def test_replacing_the_weight_data_is_picked_up():
    model = Drafter("linear").eval()
    compiled = compile_nanospec(model, capacity=16)
    ids = torch.tensor([[3, 5, 9]])
    check_against_oracle(model, compiled, ids)
    model.lm_head.weight.data = torch.randn(V, H)  # same Parameter object, new storage, same version
    check_against_oracle(model, compiled, ids)


def test_a_head_weight_passed_as_an_argument_is_reachable_from_the_tensor():
    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(V, H)

        def forward(self, ids, head_weight):
            return F.linear(torch.tanh(self.embed(ids)), head_weight)

    body, weight = Body().eval(), nn.Parameter(torch.randn(V, H), requires_grad=False)
    compiled = compile_nanospec(body, capacity=16)
    with torch.no_grad():
        out = compiled(torch.tensor([[4]]), weight)
    if nanospec_fx.vocab.state.registered_state(weight) is None:
        pytest.skip("this head was not rewritten (nothing to reach)")
    state = nanospec_fx.active_vocab(weight)
    state.observe([9])
    with torch.no_grad():
        assert compiled(torch.tensor([[4]]), weight)[0, 0, 9].isfinite()
    assert out[0, 0, 4].isfinite()


def test_a_state_created_under_inference_mode_can_be_updated_outside_it():
    model = Drafter("linear").eval()
    compiled = compile_nanospec(model, capacity=16)
    with torch.inference_mode():
        compiled(torch.tensor([[3]]))
    state = nanospec_fx.active_vocab(model)
    assert not state.cache_w.is_inference()
    state.observe([7])  # outside inference_mode: in-place writes to inference tensors would raise
    with torch.no_grad():
        assert compiled(torch.tensor([[3]]))[0, 0, 7].isfinite()
    state.reset()
    assert len(state) == 0


# ----------------------------------------------------------------------------- fed tokens stay active
def test_a_token_fed_again_is_not_evicted_by_the_same_calls_new_tokens():
    state = ActiveVocab(torch.randn(V, H), capacity=8)
    state.observe(list(range(8)))  # full ring; 0 is the oldest insertion
    state.observe([0, 20, 21, 22, 23, 24, 25, 26])  # 7 new ids: without renewal they evict 0..6
    assert state.contains([0, 20, 21, 22, 23, 24, 25, 26]).all()
    assert state.contains([7]).tolist() == [False]  # the oldest one not fed again made room


def test_a_compiled_drafter_keeps_every_id_it_was_fed_when_they_fit():
    """The pass fuzzer's case: call 0 feeds 12 ids, 3 more are observed by hand; call 1 feeds 12 ids again,
    one of them from call 0; all 12 must be active after call 1 (capacity 16)."""
    model = Drafter("linear").eval()
    compiled = compile_nanospec(model, capacity=16)
    first = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    second = torch.tensor([[1, 30, 31, 32, 33, 34], [35, 36, 37, 38, 39, 29]])
    with torch.no_grad():
        compiled(first)
        nanospec_fx.active_vocab(model).observe([13, 14, 15])
        out = compiled(second)
    assert nanospec_fx.active_vocab(model).contains(second).all()
    check_against_oracle(model, compiled, second)
    assert out.shape == (2, 6, V)


@pytest.mark.parametrize("kernels,trials", [("reference", 60), ("triton", 12)])
def test_every_fed_id_is_active_after_its_call_whenever_they_fit(kernels, trials, use_kernels):
    """Random call sequences (out-of-range ids, duplicates, pinned slots): the state stays consistent and a
    call whose distinct ids fit in the ring leaves all of them active; both kernel sets agree."""
    if kernels == "triton":
        pytest.importorskip("triton")
    import random

    use_kernels(kernels)
    rnd = random.Random(0)
    for _ in range(trials):
        vocab, capacity, pinned = rnd.choice([20, 40]), rnd.choice([4, 6, 8]), rnd.choice([0, 0, 1, 2])
        w = torch.randn(vocab, 3)
        state = ActiveVocab(w, capacity=capacity, num_pinned=pinned)
        for _ in range(6):
            ids = [rnd.randrange(-2, vocab + 2) for _ in range(rnd.randint(0, capacity + 3))]
            state.observe(ids, validate=False)
            n = len(state)
            active_ids = state.ids[:n]
            assert (active_ids >= 0).all() and int((state.slot_of >= 0).sum()) == n
            assert torch.equal(state.slot_of[active_ids].long(), torch.arange(n))
            torch.testing.assert_close(state.cache_w[:n], w[active_ids])
            fed = sorted({i for i in ids if 0 <= i < vocab})
            if fed and len(fed) <= capacity - pinned:
                assert state.contains(fed).all(), (ids, state.token_ids())


def test_switching_the_head_dtype_back_and_forth_rebuilds_the_state_in_place():
    model = Drafter("linear").eval()
    compiled = compile_nanospec(model, capacity=16)
    ids = torch.tensor([[3, 5]])
    check_against_oracle(model, compiled, ids)
    state = nanospec_fx.active_vocab(model)
    for dtype in (torch.bfloat16, torch.float32):  # a recompile for bf16, then the fp32 graph again
        model.to(dtype)
        with torch.no_grad():
            out = compiled(ids)
            want = model(ids, _mask=active(model))
        assert out.dtype == dtype and nanospec_fx.active_vocab(model) is state and state.cache_w.dtype == dtype
        torch.testing.assert_close(out, want, rtol=2e-2, atol=5e-2)
        assert state.contains([3, 5]).all()
