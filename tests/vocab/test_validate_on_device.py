"""A validated observe on a device checks the range there: no host sync, all-or-nothing (issue 39, item 2)."""
from __future__ import annotations

import pytest
import torch

import nanospec_fx
from nanospec_fx.kernels.launch_count import counting
from nanospec_fx.vocab.state import in_range_or_nothing

SYNC = "aten._local_scalar_dense.default"  # what int(t) / t.item() / bool(t) dispatch: a host sync on a GPU


@pytest.mark.parametrize("ids, kept", [([3, 0, 19], True), ([3, 20], False), ([-1, 4], False), ([], True)])
def test_the_device_check_keeps_all_or_nothing_and_reads_nothing_on_the_host(ids, kept):
    t = torch.tensor(ids, dtype=torch.int64)
    with counting() as seen:
        out = in_range_or_nothing(t, 20)
    assert SYNC not in seen.torch_ops
    assert out.tolist() == (ids if kept else [-1] * len(ids))


def test_the_host_check_reads_the_ids_on_the_host():
    """The counter sees a host read where one happens (so the test above can fail): the CPU path's ValueError."""
    state = nanospec_fx.ActiveVocab(torch.randn(20, 4), capacity=8)
    with counting() as seen:
        state.observe(torch.tensor([1, 2]))
    assert SYNC in seen.torch_ops


@pytest.mark.cuda
def test_a_validated_observe_on_cuda_makes_no_host_sync_and_leaves_the_state_on_a_bad_id():
    state = nanospec_fx.ActiveVocab(torch.randn(20, 4, device="cuda"), capacity=8)
    state.observe(torch.tensor([1, 2], device="cuda"))
    before = [t.clone() for t in state.tensors()]
    torch.cuda.set_sync_debug_mode("error")
    try:
        state.observe(torch.tensor([3, 25], device="cuda"))
        state.observe(torch.tensor([4], device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(state.ids[:2], before[0][:2]) and 3 not in state.token_ids().tolist()
    assert 4 in state.token_ids().tolist()
