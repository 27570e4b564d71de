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
