"""The Triton observe (renewal fused into its allocation kernel) against the torch reference, and its launch budget.

The reference (``kernels/reference.py``: ``renew_fed_ids`` then the allocation) is the definition. The calls here
are built to hit the renewal: ids taken from the ring's oldest positions (the edge the next insertions claim) next to
new ids, pinned slots' ids, duplicates, out-of-range ids, and calls that overflow the ring; for the shared set and the
per-request rows (duplicate request rows, padding rows). The budget: one observe dispatches at most 2 Triton launches
and no torch compute op (counted by ``kernels.launch_count``; views and allocations are not compute ops).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from nanospec_fx.kernels import reference as R, schema  # noqa: E402
from nanospec_fx.kernels.launch_count import counting  # noqa: E402
from nanospec_fx.kernels.triton_util import INTERPRET, direct_launch  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the Triton interpreter")
SETTINGS = dict(deadline=None, max_examples=30, derandomize=True)


def _T():
    from nanospec_fx.kernels import triton_kernels
    return triton_kernels


def ring_order(ids: torch.Tensor, cursor: int, capacity: int, pinned: int) -> list[int]:
    """Token ids at the ring positions the next insertions claim, oldest first (-1: empty)."""
    ring = capacity - pinned
    k = torch.arange(cursor, cursor + ring)
    return ids[R.slot_for_insertion(k, capacity, pinned)].tolist()


# A call is a list of picks: ("edge", i) the i-th ring position's id (the oldest first; an empty one: a new id),
# ("pinned", i) a pinned slot's id, ("new", t) any id, ("dup", i) a repeat of an earlier pick, ("bad", v) out of range.
PICK = st.one_of(
    st.tuples(st.just("edge"), st.integers(0, 12)),
    st.tuples(st.just("edge"), st.integers(0, 2)),  # the oldest: the first the call's new ids claim
    st.tuples(st.just("pinned"), st.integers(0, 3)),
    st.tuples(st.just("new"), st.integers(0, 10_000)),
    st.tuples(st.just("dup"), st.integers(0, 40)),
    st.tuples(st.just("bad"), st.sampled_from([-7, -2, -1, 0, 1])),
)


def build_call(picks, ids, cursor, capacity, pinned, vocab) -> list[int]:
    edge = ring_order(ids, cursor, capacity, pinned)
    out: list[int] = []
    for kind, v in picks:
        if kind == "edge":
            t = edge[v % len(edge)]
            out.append(t if t >= 0 else v % vocab)
        elif kind == "pinned":
            out.append(int(ids[v % max(pinned, 1)]) if pinned and cursor > 0 else v)
        elif kind == "new":
            out.append(v % vocab)
        elif kind == "dup":
            out.append(out[v % len(out)] if out else 0)
        else:  # out of range: below 0 or at/after V
            out.append(v if v < 0 else vocab + v)
    return out


def assert_same(got, want, where=""):
    for name, x, y in zip(schema.STATE, got, want):
        assert torch.equal(x, y), f"{name} differs {where}"


@settings(**SETTINGS)
@given(
    vocab=st.integers(12, 90),
    capacity=st.integers(2, 24),
    pinned=st.integers(0, 4),
    hidden=st.integers(1, 9),
    with_bias=st.booleans(),
    int32=st.booleans(),
    fill=st.integers(-2, 30),
    calls=st.lists(st.lists(PICK, max_size=40), min_size=1, max_size=7),
)
def test_shared_set_observe_equals_the_reference_on_renewal_cases(vocab, capacity, pinned, hidden, with_bias,
                                                                   int32, fill, calls):
    capacity = min(capacity, vocab)
    pinned = min(pinned, capacity - 1)
    g = torch.Generator().manual_seed(vocab * 131 + capacity)
    w = torch.randn(vocab, hidden, generator=g)
    b = torch.randn(vocab, generator=g) if with_bias else None
    got, want = (schema.new_state(vocab, hidden, capacity, torch.float32, "cpu") for _ in range(2))
    start = torch.randperm(vocab, generator=g)[:capacity + fill]  # the ring filled (or not) before the calls
    with direct_launch():
        _T().observe(start, w, b, *got, pinned)
    R.observe(start, w, b, *want, pinned)
    for picks in calls:
        call = build_call(picks, want[0], int(want[2]), capacity, pinned, vocab)
        t = torch.tensor(call, dtype=torch.int32 if int32 else torch.int64)
        with direct_launch():
            _T().observe(t, w, b, *got, pinned)
        R.observe(t, w, b, *want, pinned)
        assert_same(got, want, f"after {call}")


def test_the_calls_renew_ids():
    """The pick strategy reaches the renewal: feeding the ring's oldest ids next to new ones keeps them active, where
    the same call without renewal loses them (so the comparison above covers the renewal, not only insertion)."""
    vocab, capacity, pinned = 40, 8, 2
    w = torch.randn(vocab, 3)
    state = schema.new_state(vocab, 3, capacity, torch.float32, "cpu")
    with direct_launch():
        _T().observe(torch.arange(10), w, None, *state, pinned)  # full ring: 0, 1 pinned; 8, 9, 4, 5, 6, 7
        oldest = ring_order(state[0], int(state[2]), capacity, pinned)[:2]
        _T().observe(torch.tensor([30, oldest[0], 31, oldest[1], 30]), w, None, *state, pinned)
    active = set(state[0][state[0] >= 0].tolist())
    assert {30, 31, *oldest} <= active and {0, 1} <= active
    plain = schema.new_state(vocab, 3, capacity, torch.float32, "cpu")
    R.observe(torch.arange(10), w, None, *plain, pinned)
    real = R.renew_fed_ids
    try:  # the same call on the same state without the renewal step
        R.renew_fed_ids = lambda *a, **k: None
        R.observe(torch.tensor([30, oldest[0], 31, oldest[1], 30]), w, None, *plain, pinned)
    finally:
        R.renew_fed_ids = real
    assert not set(oldest) <= set(plain[0][plain[0] >= 0].tolist())


@settings(**SETTINGS)
@given(
    vocab=st.integers(12, 60),
    capacity=st.integers(2, 12),
    pinned=st.integers(0, 3),
    requests=st.integers(1, 4),
    calls=st.lists(st.tuples(st.lists(st.integers(-2, 5), min_size=1, max_size=5),
                             st.lists(PICK, min_size=1, max_size=6)), min_size=1, max_size=6),
)
def test_per_request_observe_equals_the_reference_on_renewal_cases(vocab, capacity, pinned, requests, calls):
    """Rows: duplicates (several batch rows of one request, observed as one call in batch order) and padding rows
    (-1, -2, and rows past R: they observe nothing) next to the renewal picks, taken from each row's own ring."""
    capacity = min(capacity, vocab)
    pinned = min(pinned, capacity - 1)
    hidden = 3
    g = torch.Generator().manual_seed(vocab + 7 * capacity)
    w = torch.randn(vocab, hidden, generator=g)
    b = torch.randn(vocab, generator=g)
    got, want = (schema.new_request_state(requests, vocab, hidden, capacity, torch.float32, "cpu") for _ in range(2))
    start = torch.stack([torch.randperm(vocab, generator=g)[:capacity + 3] for _ in range(requests)])
    with direct_launch():  # every request's ring full before the calls
        _T().observe(start, w, b, *got, pinned, torch.arange(requests))
    R.observe(start, w, b, *want, pinned, torch.arange(requests))
    for rows, picks in calls:
        width = len(picks)
        tok = []
        for r in rows:
            q = r if 0 <= r < requests else 0
            tok.append(build_call(picks, want[0][q], int(want[2][q]), capacity, pinned, vocab)[:width])
        rows_t, tok_t = torch.tensor(rows), torch.tensor(tok)
        with direct_launch():
            _T().observe(tok_t, w, b, *got, pinned, rows_t)
        R.observe(tok_t, w, b, *want, pinned, rows_t)
        assert_same(got, want, f"after rows {rows}, ids {tok}")


# --------------------------------------------------------------------------- the launch budget
def _filled(vocab=300, hidden=32, capacity=64, pinned=2):
    w = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(3))
    state = schema.new_state(vocab, hidden, capacity, torch.float32, "cpu")
    with direct_launch():
        _T().observe(torch.arange(100), w, None, *state, pinned)  # a full ring: the next calls evict and renew
    return w, state


CALLS = {
    "all active": [99, 98, 97, 99, 1, 0, 96, 95, 94],
    "new ids": [200, 201, 202, 99, 203],
    "renews the ring's edge": "edge",
    "duplicates and out-of-range": [250, 250, -1, 300, 7000, -5, 251, 99],
    "overflow": list(range(100, 190)),
}


@pytest.mark.parametrize("case", CALLS)
def test_one_observe_is_two_launches_and_no_torch_op(case):
    w, state = _filled()
    call = CALLS[case]
    if call == "edge":
        call = ring_order(state[0], int(state[2]), 64, 2)[:4] + [210, 211]
    with direct_launch(), counting() as seen:
        _T().observe(torch.tensor(call), w, None, *state, 2)
    assert len(seen.triton) <= 2 and seen.torch_ops == [], seen


@pytest.mark.parametrize("rows", [[0, 2, 0], [1], [-1, 1, 3, 1]])
def test_one_per_request_observe_is_two_launches_and_no_torch_op(rows):
    vocab, hidden = 80, 8
    w = torch.randn(vocab, hidden)
    state = schema.new_request_state(3, vocab, hidden, 10, torch.float32, "cpu")
    tok = torch.randint(-1, vocab, (len(rows), 4), generator=torch.Generator().manual_seed(1))
    with direct_launch(), counting() as seen:
        _T().observe(tok, w, None, *state, 1, torch.tensor(rows))
    assert len(seen.triton) <= 2 and seen.torch_ops == [], seen


def test_an_eager_draft_step_is_at_most_four_launches():
    """observe of the step's ids + compact head + top-k, the Triton path as an eager draft loop calls it."""
    w, state = _filled()
    ids, slot_of, cursor, cache_w, cache_b = state
    x = torch.randn(1, w.shape[1])
    with direct_launch(), counting() as seen:
        _T().observe(torch.tensor([5, 250, 99, 251]), w, None, *state, 2)
        logits = _T().compact_logits(x, cache_w, None, cursor)
        _T().compact_topk(logits, ids, cursor, 10)
    assert seen.launches <= 4, seen


def test_the_count_sees_torch_ops_and_launches():
    """The counter is not blind: the plain-torch renewal the kernel replaced is dozens of compute ops, a Triton call
    is counted as a launch, and views are not ops."""
    w, state = _filled()
    with counting() as seen:
        R.renew_fed_ids(torch.tensor([5, 250, 99]), state[0], state[1], state[2], 2)
        state[0].view(8, 8).t()
    assert len(seen.torch_ops) > 20 and not any("view" in op or "transpose" in op for op in seen.torch_ops)
    with direct_launch(), counting() as seen:
        _T().compact_logits(torch.randn(1, w.shape[1]), state[3], None, state[2])
    assert seen.triton == ["_head_kernel"]


def test_an_eager_draft_step_through_the_ops_is_at_most_four_launches(use_kernels):
    """The same step through ``torch.ops.nanospec`` (what a drafter's graph calls): the count looks through the op
    calls into their bodies."""
    use_kernels("triton")
    w, state = _filled()
    ids, slot_of, cursor, cache_w, cache_b = state
    ops = torch.ops.nanospec
    x, fed = torch.randn(1, w.shape[1]), torch.tensor([5, 250, 99, 251])
    with counting() as seen:
        ops.observe(fed, w, None, *state, 2)
        ops.compact_topk(ops.compact_logits(x, cache_w, None, cursor), ids, cursor, 10)
    assert seen.triton == ["_observe_alloc_kernel", "_observe_copy_kernel", "_head_kernel", "_topk_kernel"], seen
    assert seen.launches <= 4, seen
