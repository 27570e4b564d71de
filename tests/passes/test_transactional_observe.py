"""A call that raises leaves the active set as it was: its lookup's ids are observed only when the lookup
succeeds (every id a row of its table), so a rejected request (a -1 pad, an id past V) never evicts the live
context from a full ring. A compiled graph that skips the lookup of a bad id it never reads (inductor keeps only
the last position here) does not raise, and observes none of the ids eager rejects either.

Oracle: the set before the failing call, read on the host (plain lists)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nanospec_fx
from helpers import compile_nanospec

V = 50


class Drafter(nn.Module):
    def __init__(self, index: bool = False):
        super().__init__()
        self.embed, self.index = nn.Embedding(V, 8), index
        self.lm_head = nn.Linear(8, V, bias=False)

    def forward(self, ids):
        h = self.embed.weight[ids] if self.index else self.embed(ids)
        return self.lm_head(torch.tanh(h)[:, -1])


@pytest.mark.parametrize("inductor", [False, True])
@pytest.mark.parametrize("bad", [[[5, 6, -1]], [[7, V, 8]], [[9, 10], [11, V + 3]]])
def test_a_call_that_raises_observes_nothing(inductor, bad):
    torch.manual_seed(0)
    model = Drafter().eval()
    compiled = compile_nanospec(model, capacity=4, inductor=inductor)
    with torch.inference_mode():
        compiled(torch.tensor([[1, 2, 3, 4]]))  # the ring is full with the live context
        before = nanospec_fx.active_vocab(model).token_ids().tolist()
        try:  # eager raises; inductor's code checks only the ids it reads (here the last position's)
            compiled(torch.tensor(bad))
            assert inductor, "eager runs the lookup of every id"
        except (IndexError, RuntimeError):
            pass
        assert nanospec_fx.active_vocab(model).token_ids().tolist() == before == [1, 2, 3, 4]
        compiled(torch.tensor([[12, 13]]))  # a good call afterwards still observes
    assert sorted(nanospec_fx.active_vocab(model).token_ids().tolist()) == [3, 4, 12, 13]  # 1, 2 evicted


def test_negative_indices_that_index_reads_are_not_a_failure():
    """``E[ids]`` reads E[-1] (it does not raise): the call's other ids are still observed."""
    torch.manual_seed(0)
    model = Drafter(index=True).eval()
    compiled = compile_nanospec(model, capacity=8)
    with torch.inference_mode():
        out = compiled(torch.tensor([[3, -1, 5]]))
        assert {3, 5} <= set(nanospec_fx.active_vocab(model).token_ids().tolist())
        with pytest.raises(IndexError):
            compiled(torch.tensor([[6, -V - 1]]))
    assert 6 not in nanospec_fx.active_vocab(model).token_ids().tolist()
    assert torch.isfinite(out[0, [3, 5]]).all()


def test_property_a_rejected_call_never_changes_a_full_ring():
    """Any batch of ids with one bad id (a pad, past V) at any position: the set is unchanged (hypothesis)."""
    from hypothesis import given, settings, strategies as st

    torch.manual_seed(0)
    model = Drafter().eval()
    compiled = compile_nanospec(model, capacity=6)
    with torch.inference_mode():
        compiled(torch.tensor([[40, 41, 42, 43, 44, 45]]))

    @settings(max_examples=25, deadline=None, derandomize=True)
    @given(st.lists(st.integers(0, V - 1), min_size=2, max_size=6), st.integers(0, 5),
           st.sampled_from([-1, -7, V, V + 11]))
    def check(good, where, bad):
        ids = list(good)
        ids.insert(where % (len(ids) + 1), bad)
        before = nanospec_fx.active_vocab(model).token_ids().tolist()
        with torch.inference_mode(), pytest.raises(IndexError):
            compiled(torch.tensor([ids]))
        assert nanospec_fx.active_vocab(model).token_ids().tolist() == before

    check()


# --- A call with several lookups is one transaction -------------------------------------------------------------
# Every observe of a graph's ids that exist before a head reads the set runs only when every lookup of the graph
# (token tables, a second table, positions) can read all of its ids: a call that raises at ANY lookup leaves every
# state exactly as it was. Oracle: clones of every state tensor taken before the failing call (torch.equal).


class TwoLookups(nn.Module):
    """``kind`` picks the second lookup: another token table, the same table with other ids, a position table
    (P rows, read at arange), or two token heads (one state each); ``swap`` looks the second one up first."""

    P = 6

    def __init__(self, kind: str, swap: bool = False):
        super().__init__()
        self.kind, self.swap = kind, swap
        self.embed = nn.Embedding(V, 8)
        self.other = nn.Embedding(self.P if kind == "positions" else V, 8)
        self.lm_head = nn.Linear(8, V, bias=False)
        if kind == "two_heads":
            self.head2 = nn.Linear(8, V, bias=False)

    def forward(self, ids, ids2):
        def first():
            return self.embed(ids).mean(1)

        def second():
            if self.kind == "positions":
                return self.other(torch.arange(ids.shape[1])).mean(0)
            table = self.embed if self.kind == "same_table" else self.other
            return table(ids2).mean(1)

        a, b = (second(), first()) if self.swap else (first(), second())
        h = torch.tanh(a + b)
        if self.kind == "two_heads":
            return self.lm_head(h), self.head2(h)
        return self.lm_head(h)


def _states(model):
    names = ["lm_head", "head2"] if model.kind == "two_heads" else ["lm_head"]
    return [nanospec_fx.active_vocab(model, head=n) for n in names]


def _snapshot(states):
    return [[t.clone() for t in s.tensors()] for s in states]


def _unchanged(states, snapshot) -> bool:
    return all(len(s.tensors()) == len(snap) and all(torch.equal(t, c) for t, c in zip(s.tensors(), snap))
               for s, snap in zip(states, snapshot))


CASES = [("other_table", False), ("other_table", True), ("same_table", False), ("same_table", True),
         ("positions", False), ("positions", True), ("two_heads", False)]


@pytest.mark.parametrize("kind,swap", CASES)
def test_a_call_that_raises_at_any_lookup_changes_no_state(kind, swap):
    torch.manual_seed(0)
    model = TwoLookups(kind, swap).eval()
    compiled = compile_nanospec(model, capacity=4)
    good = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        compiled(good, torch.tensor([[5, 6]]))  # a full ring: 3, 4, 5, 6 (or 1..4 without a second token lookup)
        states = _states(model)
        full = [s.token_ids().tolist() for s in states]
        bad_calls = [(torch.tensor([[7, 8, 9]]), torch.tensor([[10, V]])),  # the second lookup raises
                     (torch.tensor([[7, -1, 9]]), torch.tensor([[10, 11]]))]  # the first one raises
        if kind == "positions":  # 7 positions into a 6-row table, every token id valid
            bad_calls = [(torch.tensor([[7, 8, 9, 10, 11, 12, 13]]), torch.tensor([[14, 15]]))]
        for ids, ids2 in bad_calls:
            snapshot = _snapshot(states)
            with pytest.raises((IndexError, RuntimeError)):
                model(ids, ids2)  # eager raises too
            with pytest.raises((IndexError, RuntimeError)):
                compiled(ids, ids2)
            assert _unchanged(states, snapshot), f"{kind}: a call that raised changed a state"
        assert [s.token_ids().tolist() for s in states] == full
        compiled(torch.tensor([[20, 21]]), torch.tensor([[22]]))  # a good call afterwards observes its ids
    expected = {20, 21} | ({22} if kind in ("other_table", "same_table", "two_heads") else set())
    for s in states:
        assert expected <= set(s.token_ids().tolist())


def test_a_rejected_several_lookup_call_under_inductor_changes_no_state():
    """Inductor may skip reading a bad id it never needs; whether it raises or not, nothing is observed."""
    torch.manual_seed(0)
    model = TwoLookups("other_table").eval()
    compiled = compile_nanospec(model, capacity=4, inductor=True)
    with torch.inference_mode():
        compiled(torch.tensor([[1, 2, 3, 4]]), torch.tensor([[5, 6]]))
        states = _states(model)
        snapshot = _snapshot(states)
        try:
            compiled(torch.tensor([[7, 8, 9]]), torch.tensor([[10, V + 2]]))
        except (IndexError, RuntimeError):
            pass
        assert _unchanged(states, snapshot)
