"""The torch reference of the nanospec ops against plain-Python and dense-eager oracles.

The observe oracle is ``nanospec_fx.vocab.ring_model.RingModel``, a list-and-dict ring written from the docstring's rules
(torch-free, shared with the coverage evaluation, never with the kernels); the logits
oracles are a dense ``F.linear`` masked to the active set and a stable sort of it.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from nanospec_fx.kernels import host as H, ops, reference as R
from nanospec_fx.vocab.ring_model import RingModel

NEG = float("-inf")


def make_state(vocab, hidden, capacity, dtype=torch.float32):
    return dict(
        ids=torch.full((capacity,), -1, dtype=torch.int64),
        slot_of=torch.full((vocab,), -1, dtype=torch.int32),
        cursor=torch.zeros(1, dtype=torch.int64),
        cache_w=torch.zeros(capacity, hidden, dtype=dtype),
        cache_b=torch.zeros(capacity, dtype=dtype),
    )


def observe(state, tokens, weight, bias=None, num_pinned=0, fn=R.observe):
    """``fn``: one observe implementation (every one renews the tokens a call feeds)."""
    t = torch.as_tensor(tokens, dtype=torch.int64)
    fn(t, weight, bias, state["ids"], state["slot_of"], state["cursor"], state["cache_w"], state["cache_b"], num_pinned)


def assert_matches_model(state, model, weight, bias):
    assert state["ids"].tolist() == model.ids
    assert int(state["cursor"]) == model.cursor
    expect_slot_of = [-1] * model.vocab_size
    for t, s in model.slot_of.items():
        expect_slot_of[t] = s
    assert state["slot_of"].tolist() == expect_slot_of
    n = min(model.cursor, model.capacity)
    active = state["ids"][:n]
    assert torch.equal(state["cache_w"][:n], weight[active])
    if bias is not None:
        assert torch.equal(state["cache_b"][:n], bias[active])


# --------------------------------------------------------------------------- observe
def test_dedup_and_order_of_first_occurrence():
    w = torch.randn(20, 4)
    s = make_state(20, 4, 8)
    observe(s, [5, 3, 5, 3, 7, 5], w)
    assert s["ids"].tolist() == [5, 3, 7, -1, -1, -1, -1, -1]
    assert int(s["cursor"]) == 3
    assert s["slot_of"][[5, 3, 7]].tolist() == [0, 1, 2]
    observe(s, [7, 9, 3, 1], w)  # 7 and 3 already active: not inserted again
    assert s["ids"][:5].tolist() == [5, 3, 7, 9, 1]
    assert int(s["cursor"]) == 5
    assert torch.equal(s["cache_w"][:5], w[[5, 3, 7, 9, 1]])


def test_ring_eviction_oldest_first():
    w = torch.randn(30, 3)
    s = make_state(30, 3, 4)
    observe(s, [0, 1, 2, 3], w)
    observe(s, [10, 11], w)
    assert s["ids"].tolist() == [10, 11, 2, 3]
    assert s["slot_of"][[0, 1]].tolist() == [-1, -1]
    assert s["slot_of"][[10, 11, 2, 3]].tolist() == [0, 1, 2, 3]
    assert int(s["cursor"]) == 6
    assert torch.equal(s["cache_w"], w[[10, 11, 2, 3]])


def test_pinned_slots_are_never_evicted():
    w = torch.randn(30, 3)
    s = make_state(30, 3, 4)
    observe(s, [0, 1, 2, 3], w, num_pinned=2)
    for t in (10, 11, 12):
        observe(s, [t], w, num_pinned=2)
    assert s["ids"].tolist() == [0, 1, 12, 11]
    assert s["slot_of"][[2, 3, 10]].tolist() == [-1, -1, -1]
    assert int(s["cursor"]) == 7


def test_overflow_in_one_call_keeps_the_last():
    w = torch.randn(30, 3)
    one = make_state(30, 3, 4)
    observe(one, [0, 1, 2, 3], w, num_pinned=2)
    observe(one, [10, 11, 12, 10], w, num_pinned=2)  # 3 new ids, ring of 2: 10 in then out
    assert one["ids"].tolist() == [0, 1, 12, 11]
    assert int(one["slot_of"][10]) == -1
    assert int(one["cursor"]) == 7
    # From empty, more new ids than the capacity: pinned keep the first, the ring the last.
    s = make_state(30, 3, 4)
    observe(s, list(range(20, 29)), w, num_pinned=1)
    assert s["ids"].tolist() == [20, 27, 28, 26]
    assert int(s["cursor"]) == 9
    assert sorted(t for t in range(30) if int(s["slot_of"][t]) >= 0) == [20, 26, 27, 28]


def test_out_of_range_ids_are_ignored_and_do_not_shadow_token_zero():
    w = torch.randn(10, 2)
    s = make_state(10, 2, 6)
    observe(s, [-3, 10, 4, 99, 0, -1], w)
    assert s["ids"].tolist() == [4, 0, -1, -1, -1, -1]
    assert int(s["cursor"]) == 2


def test_empty_input_changes_nothing():
    w = torch.randn(10, 2)
    s = make_state(10, 2, 3)
    observe(s, [1, 2], w)
    before = {k: v.clone() for k, v in s.items()}
    observe(s, torch.empty(0, dtype=torch.int64), w)
    assert all(torch.equal(before[k], s[k]) for k in s)


def test_bias_is_copied_and_left_alone_without_one():
    w, b = torch.randn(10, 2), torch.randn(10)
    s = make_state(10, 2, 3)
    observe(s, [7, 2], w, b)
    assert torch.equal(s["cache_b"][:2], b[[7, 2]])
    s2 = make_state(10, 2, 3)
    observe(s2, [7, 2], w)
    assert torch.equal(s2["cache_b"], torch.zeros(3))


OBSERVES = {"reference": R.observe, "host": H.observe, "op": ops.observe}


@pytest.mark.parametrize("impl", OBSERVES)
def test_a_call_keeps_the_tokens_it_feeds_while_they_fit(impl):
    w = torch.randn(30, 3)
    s = make_state(30, 3, 4)
    observe(s, [0, 1, 2, 3], w, fn=OBSERVES[impl])
    observe(s, [0, 10], w, fn=OBSERVES[impl])  # 0 is the oldest: without renewal 10 would evict it
    assert s["ids"].tolist() == [0, 10, 2, 3]  # 0 renewed (inserted again, slot 0), 10 evicts 1
    assert s["slot_of"][[0, 10, 1]].tolist() == [0, 1, -1]
    assert int(s["cursor"]) == 6
    assert torch.equal(s["cache_w"], w[[0, 10, 2, 3]])
    # 3 new + 2 endangered (2, 3 sit where the next insertions go) > ring of 4: no renewal, 2 and 3 are evicted
    observe(s, [2, 3, 20, 21, 22], w, fn=OBSERVES[impl])
    assert s["ids"].tolist() == [22, 10, 20, 21] and int(s["cursor"]) == 9


@pytest.mark.parametrize("impl", ["reference", "host"])
@settings(max_examples=40, deadline=None)
@given(
    vocab=st.integers(1, 40),
    capacity=st.integers(1, 12),
    pinned=st.integers(0, 11),
    calls=st.lists(st.lists(st.integers(-3, 45), max_size=20), max_size=6)
    | st.lists(st.lists(st.integers(0, 15), max_size=5), min_size=4, max_size=12),  # small calls: renewals
    with_bias=st.booleans(),
)
def test_observe_matches_the_ring_model(impl, vocab, capacity, pinned, calls, with_bias):
    capacity = min(capacity, vocab)
    pinned = min(pinned, capacity - 1)
    w = torch.randn(vocab, 3)
    b = torch.randn(vocab) if with_bias else None
    s = make_state(vocab, 3, capacity)
    model = RingModel(capacity, pinned, vocab_size=vocab)
    for tokens in calls:
        observe(s, tokens, w, b, pinned, fn=OBSERVES[impl])
        model.observe(tokens)
        assert_matches_model(s, model, w, b)


def test_observe_accepts_int32_and_nd_ids():
    w = torch.randn(10, 2)
    s = make_state(10, 2, 5)
    observe(s, torch.tensor([[3, 1], [3, 8]], dtype=torch.int32), w)
    assert s["ids"][:3].tolist() == [3, 1, 8]


# --------------------------------------------------------------------------- logits
def filled(vocab=23, hidden=7, capacity=9, tokens=(4, 17, 0, 22, 9), bias=True, dtype=torch.float32):
    w = torch.randn(vocab, hidden).to(dtype)
    b = torch.randn(vocab).to(dtype) if bias else None
    s = make_state(vocab, hidden, capacity, dtype)
    observe(s, list(tokens), w, b)
    return w, b, s


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [(), (4, 17, 0, 22, 9), tuple(range(30, 0, -2))])
def test_compact_and_scatter_match_masked_dense_linear(bias, tokens):
    torch.manual_seed(0)
    w, b, s = filled(vocab=31, tokens=tokens, bias=bias)
    x = torch.randn(2, 3, 7)
    dense = F.linear(x, w, b)
    compact = R.compact_logits(x, s["cache_w"], s["cache_b"] if bias else None, s["cursor"])
    n = min(int(s["cursor"]), 9)
    assert compact.shape == (2, 3, 9)
    torch.testing.assert_close(compact[..., :n], dense[..., s["ids"][:n]])
    assert (compact[..., n:] == NEG).all()
    full = R.scatter_logits(compact, s["ids"], s["cursor"], 31)
    active = torch.zeros(31, dtype=torch.bool)
    active[s["ids"][:n]] = True
    torch.testing.assert_close(full[..., active], dense[..., active])
    assert (full[..., ~active] == NEG).all()
    torch.testing.assert_close(
        R.head_logits(x, s["cache_w"], s["cache_b"] if bias else None, s["ids"], s["cursor"], 31), full
    )


def test_scatter_ignores_slots_past_the_count_whatever_they_hold():
    _, _, s = filled()
    compact = torch.arange(9.0).expand(2, 9).clone()  # post-ops turned the -inf padding finite
    full = R.scatter_logits(compact, s["ids"], s["cursor"], 23)
    assert full[0, [4, 17, 0, 22, 9]].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert int(torch.isfinite(full).sum()) == 10


# --------------------------------------------------------------------------- selection
def eager_restricted(full, active_ids, k, largest):
    """The oracle: stable sort of the full logits restricted to the active set (sorted ids)."""
    a = torch.sort(active_ids).values
    vals, order = torch.sort(full[..., a], dim=-1, descending=largest, stable=True)
    return vals[..., :k], a[order[..., :k]]


@settings(max_examples=30, deadline=None)
@given(
    vocab=st.integers(2, 50),
    capacity=st.integers(1, 16),
    tokens=st.lists(st.integers(0, 49), max_size=30),
    rows=st.integers(1, 3),
    levels=st.integers(1, 4),
    k=st.integers(1, 16),
    largest=st.booleans(),
    specials=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_topk_and_argmax_equal_a_stable_sort_restricted_to_the_active_set(
    vocab, capacity, tokens, rows, levels, k, largest, specials, seed
):
    g = torch.Generator().manual_seed(seed)
    capacity = min(capacity, vocab)
    w = torch.zeros(vocab, 1)
    s = make_state(vocab, 1, capacity)
    observe(s, tokens, w)
    n = min(int(s["cursor"]), capacity)
    # Few distinct values -> many ties; optional NaN / +-inf among the active logits.
    compact = torch.randint(0, levels, (rows, capacity), generator=g).float()
    if specials:
        pick = torch.randint(0, 4, (rows, capacity), generator=g)
        compact = torch.where(pick == 0, torch.tensor(float("nan")), compact)
        compact = torch.where(pick == 1, torch.tensor(NEG), compact)
        compact = torch.where(pick == 2, torch.tensor(float("inf")), compact)
    compact[:, n:] = 5.0  # stale slots (finite after a post-op): must be ignored
    k = min(k, vocab)  # k may exceed the capacity: the rest is padding
    vals, toks = R.compact_topk(compact, s["ids"], s["cursor"], k, largest)
    full = R.scatter_logits(compact, s["ids"], s["cursor"], vocab)
    m = min(k, n)
    ev, et = eager_restricted(full, s["ids"][:n], m, largest)
    torch.testing.assert_close(vals[:, :m], ev, equal_nan=True)
    assert torch.equal(toks[:, :m], et)
    pad = NEG if largest else float("inf")
    inactive = [t for t in range(vocab) if t not in set(s["ids"][:n].tolist())]
    assert (vals[:, m:] == pad).all()
    assert toks[:, m:].tolist() == [inactive[: k - m]] * rows  # the smallest inactive ids, ascending
    if n and not specials and largest:
        # Without NaN, the values are those of torch.topk on the scattered logits.
        torch.testing.assert_close(vals[:, :m], torch.topk(full, m).values)
    am = R.compact_argmax(compact, s["ids"], s["cursor"])
    assert am.shape == (rows,)
    if n == 0:
        assert (am == 0).all()  # as torch.argmax of all -inf logits
    else:
        assert torch.equal(am, eager_restricted(full, s["ids"][:n], 1, True)[1][:, 0])
        finite_max = (full.isnan() | (full > NEG)).any(-1)
        # torch.argmax (first maximum, NaN counts as max) agrees whenever the max is not -inf.
        assert torch.equal(am[finite_max], full.argmax(-1)[finite_max])


def test_topk_tie_rule_example():
    ids = torch.tensor([9, 2, 5, 7])
    cursor = torch.tensor([4])
    compact = torch.tensor([[1.0, 3.0, 3.0, 1.0]])
    vals, toks = R.compact_topk(compact, ids, cursor, 4)
    assert vals.tolist() == [[3.0, 3.0, 1.0, 1.0]]
    assert toks.tolist() == [[2, 5, 7, 9]]  # equal values: smaller token id first
    assert R.compact_argmax(compact, ids, cursor).tolist() == [2]
    vals, toks = R.compact_topk(compact, ids, cursor, 2, largest=False)
    assert toks.tolist() == [[7, 9]]


def test_topk_pads_past_the_capacity_with_valid_inactive_ids():
    ids, cursor = torch.tensor([0, 2, 3]), torch.tensor([3])
    vals, toks = R.compact_topk(torch.tensor([[1.0, 3.0, 2.0]]), ids, cursor, 6)
    assert toks.tolist() == [[2, 3, 0, 1, 4, 5]]
    assert vals.tolist() == [[3.0, 2.0, 1.0] + [float("-inf")] * 3]
    with pytest.raises(ValueError):
        R.compact_topk(torch.zeros(1, 3), ids, cursor, -1)


# --------------------------------------------------------------------------- the custom ops
def test_custom_ops_run_the_reference_and_pass_opcheck(use_kernels):
    use_kernels("reference")
    torch.manual_seed(0)
    w, b, s = filled()
    x = torch.randn(3, 7)
    state = [s[k] for k in ("ids", "slot_of", "cursor", "cache_w", "cache_b")]
    compact = torch.ops.nanospec.compact_logits(x, s["cache_w"], s["cache_b"], s["cursor"])
    assert torch.equal(compact, R.compact_logits(x, s["cache_w"], s["cache_b"], s["cursor"]))
    cases = [
        (ops.observe, (torch.tensor([1, 2, 1]), w, b, *[t.clone() for t in state], 0)),
        (ops.compact_logits, (x, s["cache_w"], s["cache_b"], s["cursor"])),
        (ops.compact_logits, (x, s["cache_w"], None, s["cursor"])),
        (ops.scatter_logits, (compact, s["ids"], s["cursor"], 23)),
        (ops.head_logits, (x, s["cache_w"], s["cache_b"], s["ids"], s["cursor"], 23)),
        (ops.compact_topk, (compact, s["ids"], s["cursor"], 3, False)),
        (ops.compact_argmax, (compact, s["ids"], s["cursor"])),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    v, t = torch.ops.nanospec.compact_topk(compact, s["ids"], s["cursor"], 3)
    ev, et = R.compact_topk(compact, s["ids"], s["cursor"], 3)
    assert torch.equal(v, ev) and torch.equal(t, et)
