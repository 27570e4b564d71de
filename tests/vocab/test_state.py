"""ActiveVocab's public API: dedup, eviction, reset, bad ids, lookup from modules."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nanospec_fx
from nanospec_fx.vocab.state import ActiveVocab, state_for
from nanospec_fx.vocab.config import VocabConfig
from nanospec_fx.vocab.ring_model import RingModel
from drafters import TinyDrafter
from helpers import compile_nanospec


def make(vocab=20, hidden=4, capacity=5, bias=False, num_pinned=0):
    w = torch.randn(vocab, hidden)
    b = torch.randn(vocab) if bias else None
    return ActiveVocab(w, b, capacity=capacity, num_pinned=num_pinned), w, b


def test_observe_dedups_and_keeps_first_occurrence_order():
    state, w, _ = make(capacity=8)
    state.observe(torch.tensor([[3, 3, 7], [1, 7, 3]]))
    assert state.token_ids().tolist() == [3, 7, 1]
    state.observe([7, 9])
    assert state.token_ids().tolist() == [3, 7, 1, 9]
    assert len(state) == 4
    torch.testing.assert_close(state.cache_w[:4], w[[3, 7, 1, 9]])


def test_full_state_evicts_oldest_first():
    state, w, _ = make(capacity=3)
    state.observe([1, 2, 3])
    state.observe([4])  # evicts 1
    assert sorted(state.token_ids().tolist()) == [2, 3, 4]
    assert state.contains(torch.tensor([1, 2, 3, 4])).tolist() == [False, True, True, True]
    state.observe([5, 6])  # evicts 2, 3
    assert sorted(state.token_ids().tolist()) == [4, 5, 6]
    slots = state.slot_of[state.ids]
    assert torch.equal(slots, torch.arange(3, dtype=slots.dtype)), "membership map and ids agree"
    torch.testing.assert_close(state.cache_w, w[state.ids])


def test_more_new_tokens_than_capacity_in_one_call_keeps_the_last():
    state, w, _ = make(capacity=4)
    state.observe(torch.arange(10))
    assert sorted(state.token_ids().tolist()) == [6, 7, 8, 9]
    torch.testing.assert_close(state.cache_w, w[state.ids])
    assert len(state) == 4


def test_pinned_slots_are_never_evicted():
    state, _, _ = make(capacity=4, num_pinned=2)
    state.observe([10, 11])  # the pinned core
    state.observe(torch.arange(12))
    ids = state.token_ids().tolist()
    assert ids[:2] == [10, 11] and len(ids) == 4


def test_bias_rows_follow_their_tokens():
    state, _, b = make(capacity=4, bias=True)
    state.observe([5, 2])
    torch.testing.assert_close(state.cache_b[:2], b[[5, 2]])


@pytest.mark.parametrize("bad", [[-1], [20], [3, 25]])
def test_out_of_range_ids_raise_and_leave_the_state_untouched(bad):
    state, _, _ = make(vocab=20)
    state.observe([1, 2])
    before = [t.clone() for t in state.tensors()]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        state.observe(bad)
    for t, b in zip(state.tensors(), before):
        assert torch.equal(t, b)


def test_float_ids_are_rejected():
    state, _, _ = make()
    with pytest.raises(TypeError, match="integer"):
        state.observe(torch.tensor([1.0]))


def test_unvalidated_observe_skips_out_of_range_ids():
    state, _, _ = make(vocab=20)
    state.observe(torch.tensor([-5, 3, 20, 4]), validate=False)
    assert state.token_ids().tolist() == [3, 4]


def test_reset_empties_in_place():
    state, _, _ = make()
    addresses = [t.data_ptr() for t in state.tensors()]
    state.observe([1, 2, 3])
    state.reset()
    assert len(state) == 0 and state.token_ids().numel() == 0
    assert not state.contains(torch.tensor([1, 2, 3])).any()
    assert [t.data_ptr() for t in state.tensors()] == addresses


def test_refresh_recopies_rows_after_weights_change():
    state, w, _ = make()
    state.observe([4, 8])
    with torch.no_grad():
        w.mul_(2)
    state.refresh()
    torch.testing.assert_close(state.cache_w[:2], w[[4, 8]])


def test_capacity_is_clamped_to_the_vocabulary_and_validated():
    state, _, _ = make(vocab=6, capacity=100)
    assert state.capacity == 6
    with pytest.raises(ValueError):
        ActiveVocab(torch.randn(5, 2), capacity=0)
    with pytest.raises(ValueError):
        ActiveVocab(torch.randn(5, 2), capacity=3, num_pinned=3)
    with pytest.raises(ValueError):
        ActiveVocab(torch.randn(5), capacity=3)


def test_state_for_reuses_and_rebuilds():
    w = nn.Parameter(torch.randn(10, 4))
    a = state_for(w, None, VocabConfig(capacity=4))
    assert state_for(w, None, VocabConfig(capacity=4)) is a
    a.observe([3, 1])
    b = state_for(w, None, VocabConfig(capacity=5))  # no compiled wrapper reads it: rebuilt in place, tokens kept
    assert b is a and b.capacity == 5 and b.token_ids().tolist() == [3, 1]


@pytest.mark.parametrize("num_pinned", [0, 2])
@pytest.mark.parametrize("insertions", [3, 6, 9, 14])  # before the ring fills, at its end, after one wrap, two
def test_a_rebuild_in_place_keeps_the_ring_age_order(num_pinned, insertions):
    """A state rebuilt in place (the head's dtype changed) evicts next what it would have evicted without the rebuild:
    the ring's oldest token, not the token of its first slot. The plain-Python ring is the oracle."""
    w = nn.Parameter(torch.randn(40, 4))
    config = VocabConfig(capacity=6, num_pinned=num_pinned)
    state, ring = state_for(w, None, config), RingModel(6, num_pinned)
    for token in range(insertions):
        state.observe([token])
        ring.observe([token])
    w.data = w.data.double()
    assert state_for(w, None, config) is state and state.cache_w.dtype == torch.float64  # rebuilt in place
    for token in range(20, 28):  # each new token evicts the oldest
        state.observe([token])
        ring.observe([token])
        assert sorted(state.token_ids().tolist()) == sorted(ring.slot_of), token


def test_active_vocab_lookup_from_compiled_and_original_module():
    model = TinyDrafter(30, 4).eval()
    with pytest.raises(LookupError, match="no active vocabulary yet"):
        nanospec_fx.active_vocab(model)
    compiled = compile_nanospec(model, capacity=6)
    with torch.no_grad():
        compiled(torch.tensor([[1, 2]]))
    assert nanospec_fx.active_vocab(compiled) is nanospec_fx.active_vocab(model)
    assert nanospec_fx.active_vocab(model, head="lm_head.weight").vocab_size == 30
    with pytest.raises(KeyError):
        nanospec_fx.active_vocab(model, head="embed.weight")
    with pytest.raises(TypeError):
        nanospec_fx.active_vocab("not a module")
