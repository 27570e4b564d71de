"""Eviction order: FIFO by first insertion, the same in the kernels, the reference and the plain-Python ring model
(``nanospec_fx.vocab.ring_model``, which the coverage evaluation also replays requests through).

LRU (refresh on re-observation) exists only in the coverage simulation, to measure the
alternative (docs/kernels.md, "Eviction order"; tested in tests/eval/test_coverage.py).
"""
from __future__ import annotations

import pytest
import torch

from nanospec_fx.kernels import host as H, ops, reference as R
from nanospec_fx.kernels.schema import new_state
from nanospec_fx.kernels.triton_util import INTERPRET, direct_launch
from nanospec_fx.vocab.ring_model import RingModel


def _calls(vocab: int, capacity: int, pinned: int, seed: int):
    """Calls that feed the oldest ring tokens again next to new ones: where renewal decides what stays.

    Each call is drawn from the ring model's state (the oracle), so the sequence keeps hitting the
    case; ``plain`` (the same model with renewal off) shows that it does.
    """
    g = torch.Generator().manual_seed(seed)
    sim = RingModel(capacity, num_pinned=pinned)
    plain = RingModel(capacity, num_pinned=pinned, renew=False)
    calls, differs = [], False
    for _ in range(24):
        oldest = sim.oldest()[: int(torch.randint(0, 3, (1,), generator=g))]
        fresh = torch.randint(0, vocab, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
        call = fresh[:1] + oldest + fresh[1:]
        sim.observe(call)
        plain.observe(call)
        calls.append((call, set(sim)))
        differs |= set(sim) != set(plain)
    assert differs, "the sequence never needs renewal: the test could not fail without it"
    return calls


def _observe_impl(impl):
    if impl == "triton":
        if not INTERPRET:
            pytest.skip("CPU variant")
        from nanospec_fx.kernels import triton_kernels as T
        return T.observe
    return {"reference": R.observe, "host": H.observe, "op": ops.observe}[impl]


@pytest.mark.parametrize("impl", ["reference", "host", "op", "triton"])
def test_every_observe_renews_the_tokens_a_call_feeds(impl):
    """Every implementation, called directly, keeps the ring model's set (renewal included) after each call."""
    _check_against_the_ring_model(_observe_impl(impl))


@pytest.mark.parametrize("impl", ["reference", "host", "op", "triton"])
def test_the_renewal_check_fails_with_renewal_switched_off(impl, monkeypatch):
    monkeypatch.setattr(R, "renew_fed_ids", lambda *args: None)
    monkeypatch.setattr(H, "renewed_slots", lambda *args: set())
    if impl == "triton" and INTERPRET:  # the renewal fused into the allocation kernel: its constexpr switch
        from nanospec_fx.kernels import triton_observe
        monkeypatch.setattr(triton_observe, "RENEW", False)
    with pytest.raises(AssertionError, match="after observing"):
        _check_against_the_ring_model(_observe_impl(impl))


def _check_against_the_ring_model(fn):
    vocab, capacity, pinned = 40, 10, 2
    w = torch.randn(vocab, 4, generator=torch.Generator().manual_seed(0))
    state = new_state(vocab, 4, capacity, torch.float32, "cpu")
    for call, expected in _calls(vocab, capacity, pinned, seed=5):
        with direct_launch():
            fn(torch.tensor(call), w, None, *state, pinned)
        ids = state[0]
        assert set(ids[ids >= 0].tolist()) == expected, f"after observing {call}"


@pytest.mark.parametrize("impl", ["reference", "host", "triton"])
def test_kernels_and_the_ring_model_evict_the_same_tokens(impl):
    """Random calls with many re-observations: the active set of the state equals the ring model's."""
    if impl == "triton":
        if not INTERPRET:
            pytest.skip("CPU variant")
        from nanospec_fx.kernels import triton_kernels as T
        fn = T.observe
    else:
        fn = {"reference": R.observe, "host": H.observe}[impl]
    g = torch.Generator().manual_seed(3)
    vocab, capacity, pinned = 40, 10, 2
    w = torch.randn(vocab, 4, generator=g)
    state = new_state(vocab, 4, capacity, torch.float32, "cpu")
    sim = RingModel(capacity, num_pinned=pinned)
    for _ in range(12):
        call = torch.randint(0, vocab, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g)
        with direct_launch():
            fn(call, w, None, *state, pinned)
        sim.observe(call.tolist())
        ids = state[0]
        assert set(ids[ids >= 0].tolist()) == set(sim)
