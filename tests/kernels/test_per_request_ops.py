"""The ops with ``rows`` (a per-request state) against plain-torch oracles, on every implementation.

Each batch row b is computed against the active set of request ``rows[b]``. The oracle is the dense head
``x @ W.T + b`` with -inf outside that request's set (a Python set written by hand into the state, not by
``observe``), and a stable sort of those masked logits for top-k. ``observe`` with ``rows`` is checked
against a Python model of the sets without eviction, and with eviction against the shared-set op applied to
each request's ids (its definition). Implementations: reference, host (CPU), Triton (interpreter on CPU).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanospec_fx.kernels import ops, reference, schema  # noqa: F401  (ops registers torch.ops.nanospec)
from nanospec_fx.kernels.selection import use_kernels as kernels_scope
from nanospec_fx.kernels.triton_util import INTERPRET
from helpers import request_state_by_hand

OPS = torch.ops.nanospec
NEG = float("-inf")
V, H, C, R = 37, 24, 9, 4  # odd shapes: C not a power of two, V not a multiple of any block
IMPLS = [
    "reference",
    "host",
    pytest.param("triton", marks=pytest.mark.skipif(not INTERPRET, reason="Triton on CPU needs the interpreter")),
]
TOL = dict(rtol=1e-5, atol=1e-4)


@pytest.fixture(params=IMPLS)
def impl(request, use_kernels):
    pytest.importorskip("triton") if request.param == "triton" else None
    use_kernels(request.param)
    return request.param


def _head(seed=0, with_bias=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, H, generator=g), (torch.randn(V, generator=g) if with_bias else None)


def _state_by_hand(weight, bias, sets: list[list[int]]):
    """Per-request state whose request r holds ``sets[r]`` in slot order (written directly, not observed)."""
    return request_state_by_hand(weight, bias, sets, C)


SETS = [[3, 17, 0, 11, 6], [36, 5], [], [8, 1, 30, 2, 29, 14, 22, 4, 9]]  # request 2 empty, request 3 full


def _oracle_logits(x, rows, weight, bias, sets):
    """The dense head masked to each row's request's set; a padding row (outside [0, R)) holds an empty set."""
    dense = x @ weight.T + (bias if bias is not None else 0)
    mask = torch.zeros(*rows.shape, V, dtype=torch.bool)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in rows.shape]).reshape(-1, rows.dim()).tolist():
        r = int(rows[tuple(idx)])
        mask[tuple(idx)][sets[r] if 0 <= r < len(sets) else []] = True
    return dense.masked_fill(~mask, NEG), mask


def _oracle_topk(masked, mask, k, largest=True):
    """Stable sort of the masked logits; rows with fewer than k active tokens pad with the smallest inactive ids."""
    key = masked if largest else masked.masked_fill(~mask, float("inf"))
    vals, order = torch.sort(key, dim=-1, descending=largest, stable=True)
    return vals[..., :k], order[..., :k]


@pytest.mark.parametrize("with_bias", [True, False])
# [0, 3], [3, 0, 3]: requests far apart (the host path gathers their caches instead of reading a span as a view)
# -1 and R: padding rows (engines pad batches with -1), read as an empty set on every implementation, never as
# another request's (-1 would index the last request row); [-1, -1]: a batch of padding only
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [3, 3, 0, 3, 1], [2], [1, 0, 1, 0, 2, 3, 3], [0, 3], [3, 0, 3],
                                  [-1, 0, 3, -1], [3, R, 1, -1], [-1, -1]])
def test_head_against_the_masked_dense_head(impl, with_bias, rows):
    weight, bias = _head(1, with_bias)
    ids, slot_of, cursor, cache_w, cache_b = _state_by_hand(weight, bias, SETS)
    rows = torch.tensor(rows)
    x = torch.randn(rows.numel(), H, generator=torch.Generator().manual_seed(2))
    want, mask = _oracle_logits(x, rows, weight, bias, SETS)
    b = cache_b if with_bias else None
    got = OPS.head_logits(x, cache_w, b, ids, cursor, V, rows)
    torch.testing.assert_close(got, want, **TOL)
    assert torch.isneginf(got[~mask]).all()
    compact = OPS.compact_logits(x, cache_w, b, cursor, rows)
    assert compact.shape == (rows.numel(), C)
    torch.testing.assert_close(OPS.scatter_logits(compact, ids, cursor, V, rows), want, **TOL)
    for k, largest in ((1, True), (4, True), (3, False), (C + 2, True)):
        vals, toks = OPS.compact_topk(compact, ids, cursor, k, largest, rows)
        want_vals, want_toks = _oracle_topk(want, mask, k, largest)
        if not largest:  # padding of rows with fewer than k active tokens: +inf, as the shared op pads
            want_vals = torch.where(torch.gather(mask, -1, want_toks), want_vals, float("inf"))
        torch.testing.assert_close(vals, want_vals, **TOL)
        assert torch.equal(toks, want_toks)
    assert torch.equal(OPS.compact_argmax(compact, ids, cursor, rows), want.argmax(-1))


def test_leading_dims_and_empty_batch(impl):
    weight, bias = _head(3)
    ids, slot_of, cursor, cache_w, cache_b = _state_by_hand(weight, bias, SETS)
    rows = torch.tensor([[1, 0, 3], [3, 3, 2]])
    x = torch.randn(2, 3, H, generator=torch.Generator().manual_seed(4))
    want, _ = _oracle_logits(x, rows, weight, bias, SETS)
    torch.testing.assert_close(OPS.head_logits(x, cache_w, cache_b, ids, cursor, V, rows), want, **TOL)
    empty = OPS.head_logits(x[:0], cache_w, cache_b, ids, cursor, V, rows[:0])
    assert empty.shape == (0, 3, V)
    before = [t.clone() for t in (ids, slot_of, cursor, cache_w, cache_b)]
    empty_rows = torch.zeros(0, dtype=torch.int64)  # an empty batch observes nothing
    OPS.observe(torch.zeros(0, dtype=torch.int64), weight, bias, ids, slot_of, cursor, cache_w, cache_b, 0, empty_rows)
    assert all(torch.equal(a, b) for a, b in zip(before, (ids, slot_of, cursor, cache_w, cache_b)))


def _observe_stream(seed, steps, batch, width):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        rows = torch.randint(0, R, (batch,), generator=g)
        tok = torch.randint(-2, V + 2, (batch, width), generator=g)  # some out of range: ignored
        yield rows, tok


def test_observe_without_eviction_matches_a_python_model_of_the_sets(impl):
    weight, bias = _head(5)
    big = V  # capacity = V: nothing is ever evicted
    state = schema.new_request_state(R, V, H, big, weight.dtype, "cpu")
    model: list[list[int]] = [[] for _ in range(R)]
    for rows, tok in _observe_stream(6, 6, 5, 3):
        OPS.observe(tok, weight, bias, *state, 0, rows)
        for b in range(rows.numel()):
            for t in tok[b].tolist():
                if 0 <= t < V and t not in model[int(rows[b])]:
                    model[int(rows[b])].append(t)
    ids, slot_of, cursor, cache_w, cache_b = state
    for r in range(R):
        n = len(model[r])
        assert int(cursor[r]) == n
        assert ids[r, :n].tolist() == model[r]  # slot order: order of first occurrence, batch order within a call
        assert ((slot_of[r] >= 0).nonzero().flatten().tolist()) == sorted(model[r])
        torch.testing.assert_close(cache_w[r, :n], weight[model[r]])
        torch.testing.assert_close(cache_b[r, :n], bias[model[r]])


@pytest.mark.parametrize("num_pinned", [0, 2])
def test_observe_with_eviction_is_the_shared_op_per_request(impl, num_pinned):
    """Row r of the per-request state equals a shared-set state fed, call by call, request r's ids of the call
    concatenated in batch order (the definition); the shared op is checked against its own oracles elsewhere."""
    weight, bias = _head(7)
    state = schema.new_request_state(R, V, H, C, weight.dtype, "cpu")
    singles = [schema.new_state(V, H, C, weight.dtype, "cpu") for _ in range(R)]
    for rows, tok in _observe_stream(8, 4, 6, 3):
        OPS.observe(tok, weight, bias, *state, num_pinned, rows)
        for r in range(R):
            mine = tok[rows == r].reshape(-1)
            if mine.numel():
                reference.observe(mine, weight, bias, *singles[r], num_pinned)
        for r in range(R):
            for name, got, want in zip(schema.STATE, state, singles[r]):
                assert torch.equal(got[r], want.reshape(got[r].shape)), (r, name)


def test_padding_rows_observe_nothing(impl):
    """Ids of batch rows outside [0, R) join no request (written out by hand: request 2 gets 3, 4, 10 in batch
    order, request 0 gets 7; the padding rows' 1, 2, 5, 6, 8, 9 nowhere)."""
    weight, bias = _head(11)
    state = schema.new_request_state(R, V, H, C, weight.dtype, "cpu")
    rows = torch.tensor([-1, 2, R, 0, -1, 2])
    tok = torch.tensor([[1, 2], [3, 4], [5, 6], [7, -1], [8, 9], [10, 3]])
    OPS.observe(tok, weight, bias, *state, 0, rows)
    ids, slot_of, cursor, cache_w, cache_b = state
    want = {0: [7], 1: [], 2: [3, 4, 10], 3: []}
    assert cursor.tolist() == [len(want[r]) for r in range(R)]
    for r, tokens in want.items():
        assert ids[r, :len(tokens)].tolist() == tokens and (ids[r, len(tokens):] == -1).all()
        assert (slot_of[r] >= 0).nonzero().flatten().tolist() == sorted(tokens)
        torch.testing.assert_close(cache_w[r, :len(tokens)], weight[tokens])


def test_isolation_a_token_fed_to_one_request_is_inactive_for_the_others(impl):
    weight, bias = _head(9)
    state = schema.new_request_state(R, V, H, C, weight.dtype, "cpu")
    OPS.observe(torch.tensor([[5, 6], [7, -1]]), weight, bias, *state, 0, torch.tensor([0, 2]))
    ids, slot_of, cursor, cache_w, cache_b = state
    x = torch.randn(R, H)
    got = OPS.head_logits(x, cache_w, cache_b, ids, cursor, V, torch.arange(R))
    finite = torch.isfinite(got)
    assert finite[0].nonzero().flatten().tolist() == [5, 6]
    assert finite[2].nonzero().flatten().tolist() == [7]
    assert not finite[1].any() and not finite[3].any()


def test_selection_ties_and_nan_follow_the_shared_rule(impl):
    """Equal values: the smaller token id first; NaN counts as largest (as torch.sort / argmax order them)."""
    weight, bias = _head(10)
    ids, slot_of, cursor, cache_w, cache_b = _state_by_hand(weight, bias, SETS)
    rows = torch.tensor([0, 3, 3, 1, 2])
    compact = torch.tensor([
        [1.0, 2.0, 2.0, 1.0, 0.5, 9.0, 9.0, 9.0, 9.0],  # request 0: tokens 17 and 0 tie at 2.0; slots past 5 ignored
        [0.0, 0.0, 0.0, 5.0, 0.0, 5.0, 0.0, 5.0, 0.0],  # request 3: tokens 2, 14, 4 tie at 5.0
        [1.0, float("nan"), 3.0, 1.0, float("nan"), 0.0, 0.0, 0.0, 0.0],  # NaN at tokens 1 and 29
        [4.0, 4.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0, 7.0],  # request 1: tokens 36, 5 tie
        [7.0] * C,  # request 2: empty
    ])
    dense = torch.full((rows.numel(), V), NEG)
    for b, r in enumerate(rows.tolist()):
        for slot, token in enumerate(SETS[r]):
            dense[b, token] = compact[b, slot]
    assert torch.equal(OPS.compact_argmax(compact, ids, cursor, rows), dense.argmax(-1))
    vals, toks = OPS.compact_topk(compact, ids, cursor, 3, True, rows)
    want_vals, want_toks = torch.sort(dense, dim=-1, descending=True, stable=True)
    assert torch.equal(toks, want_toks[:, :3])
    torch.testing.assert_close(vals, want_vals[:, :3], equal_nan=True)


@st.composite
def _batches(draw):
    """A per-request state of drawn shape and sets, and a batch of rows mapped to its requests."""
    vocab, hidden = draw(st.integers(2, 70)), draw(st.integers(1, 40))
    capacity, requests = draw(st.integers(1, min(vocab, 20))), draw(st.integers(1, 5))
    sets = [draw(st.lists(st.integers(0, vocab - 1), max_size=capacity, unique=True)) for _ in range(requests)]
    rows = draw(st.lists(st.integers(-1, requests), min_size=0, max_size=7))  # -1, requests: padding rows
    return vocab, hidden, capacity, sets, rows, draw(st.booleans()), draw(st.integers(0, 2 ** 16))


@given(case=_batches())
@settings(deadline=None, max_examples=30, derandomize=True)
def test_drawn_shapes_against_the_masked_dense_head(case):
    vocab, hidden, capacity, sets, rows, with_bias, seed = case
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=g)
    bias = torch.randn(vocab, generator=g) if with_bias else None
    ids, slot_of, cursor, cache_w, cache_b = request_state_by_hand(weight, bias, sets, capacity)
    rows = torch.tensor(rows, dtype=torch.int64)
    x = torch.randn(rows.numel(), hidden, generator=g)
    dense = x @ weight.T + (bias if bias is not None else 0)
    mask = torch.zeros(rows.numel(), vocab, dtype=torch.bool)
    for b, r in enumerate(rows.tolist()):
        mask[b, sets[r] if 0 <= r < len(sets) else []] = True  # a padding row: an empty set
    want = dense.masked_fill(~mask, NEG)
    k = min(3, vocab)
    for mode in ("reference", "host"):  # the Triton kernels: the fixed shapes above (the interpreter is slow)
        with kernels_scope(mode):
            b = cache_b if with_bias else None
            got = OPS.head_logits(x, cache_w, b, ids, cursor, vocab, rows)
            torch.testing.assert_close(got, want, **TOL)
            compact = OPS.compact_logits(x, cache_w, b, cursor, rows)
            vals, toks = OPS.compact_topk(compact, ids, cursor, k, True, rows)
            want_vals, want_toks = torch.sort(want, dim=-1, descending=True, stable=True)
            assert torch.equal(toks, want_toks[:, :k]), mode
            torch.testing.assert_close(vals, want_vals[:, :k], **TOL)
            torch.testing.assert_close(OPS.scatter_logits(compact, ids, cursor, vocab, rows), want, **TOL)
            empty = ~mask.any(-1)
            want_arg = torch.where(empty, 0, want.argmax(-1)) if rows.numel() else rows
            assert torch.equal(OPS.compact_argmax(compact, ids, cursor, rows), want_arg), mode


def test_calls_with_rows_run_under_grad_and_refuse_a_backward():
    """Per-request calls are inference only: with an input that needs a gradient they compute the same logits, and
    a backward through them raises instead of returning the shared set's gradient formula."""
    weight, bias = _head(12)
    ids, slot_of, cursor, cache_w, cache_b = _state_by_hand(weight, bias, SETS)
    rows = torch.tensor([0, 3, -1])
    x = torch.randn(3, H, requires_grad=True)
    got = OPS.head_logits(x, cache_w, cache_b, ids, cursor, V, rows)
    torch.testing.assert_close(got.detach(), _oracle_logits(x.detach(), rows, weight, bias, SETS)[0], **TOL)
    with pytest.raises(NotImplementedError, match="no autograd"):
        got.masked_fill(torch.isinf(got), 0).sum().backward()
