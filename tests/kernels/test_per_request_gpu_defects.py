"""GPU-only defects of the per-request path, caught on a CPU: the Triton path reads nothing on the host (no
device sync on a GPU), every implementation follows the declared schema, and every wrapper launches under the
device guard. (The int64 offsets of the per-request kernels are checked by ``kernels/compile_check.py``, run by
tests/kernels/test_kernels.py::test_kernels_compile_for_sm90.)"""
from __future__ import annotations

import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from nanospec_fx.kernels import host_per_request as HP, ops_per_request as OPR  # noqa: E402
from nanospec_fx.kernels import reference_per_request as RP, schema, triton_per_request as TP  # noqa: E402
from nanospec_fx.kernels.triton_util import INTERPRET, direct_launch  # noqa: E402

V, H, C, R = 29, 8, 7, 3


class NoHostReads(TorchDispatchMode):
    """Fails on any read of tensor data by the host (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("host read of a tensor value: this would sync with a GPU")
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not INTERPRET, reason="Triton on CPU needs the interpreter")
def test_the_triton_path_never_reads_data_on_the_host(monkeypatch):
    monkeypatch.setenv("NANOSPEC_KERNELS", "triton")
    w, b = torch.randn(V, H), torch.randn(V)
    state = schema.new_request_state(R, V, H, C, torch.float32, "cpu")
    ids, _, cursor, cache_w, cache_b = state
    rows = torch.tensor([2, 0, 2, 1])
    with NoHostReads():
        OPR.observe_per_request(torch.randint(0, V, (4, 3)), rows, w, b, *state, 1)
        x = torch.randn(4, H)
        compact = OPR.compact_logits_per_request(x, rows, cache_w, cache_b, cursor)
        OPR.head_logits_per_request(x, rows, cache_w, cache_b, ids, cursor, V)
        OPR.scatter_logits_per_request(compact, rows, ids, cursor, V)
        OPR.compact_topk_per_request(compact, rows, ids, cursor, 3, True)
        OPR.compact_argmax_per_request(compact, rows, ids, cursor)
    assert int(cursor.sum()) > 0  # it did observe
    with pytest.raises(AssertionError, match="host read"), NoHostReads():  # the detector works: the host path reads
        HP.compact_logits_per_request(x, rows, cache_w, cache_b, cursor)


@pytest.mark.parametrize("op", schema.REQUEST_OPS)
def test_every_implementation_follows_the_schema(op):
    want = schema.arguments(op)
    for fn in (getattr(OPR, f"_{op}"), getattr(RP, op), getattr(HP, op), getattr(TP, op)):
        assert tuple(inspect.signature(fn).parameters) == want, (op, fn.__module__)
    registered = getattr(torch.ops.nanospec, op).default._schema
    assert tuple(a.name for a in registered.arguments) == want
    written = {a.name for a in registered.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == set(schema.mutated(op))
    assert op not in schema.OPS  # eager ops: the passes never emit them


def test_every_wrapper_launches_under_the_device_guard(monkeypatch):
    seen = []

    def guard(t):
        seen.append(t.device)
        from nanospec_fx.kernels.triton_util import device_guard
        return device_guard(t)

    monkeypatch.setattr(TP, "device_guard", guard)
    w = torch.randn(V, H)
    state = schema.new_request_state(R, V, H, C, torch.float32, "cpu")
    ids, _, cursor, cache_w, _ = state
    rows = torch.tensor([1, 0])
    calls = [
        lambda: TP.observe_per_request(torch.tensor([[3, 4], [5, -1]]), rows, w, None, *state, 0),
        lambda: TP.compact_logits_per_request(torch.randn(2, H), rows, cache_w, None, cursor),
        lambda: TP.head_logits_per_request(torch.randn(2, H), rows, cache_w, None, ids, cursor, V),
        lambda: TP.scatter_logits_per_request(torch.randn(2, C), rows, ids, cursor, V),
        lambda: TP.compact_topk_per_request(torch.randn(2, C), rows, ids, cursor, 2),
    ]
    with direct_launch():
        for call in calls:
            before = len(seen)
            if INTERPRET:
                call()
            else:  # without the interpreter a CPU launch fails after the guard was entered
                with pytest.raises(Exception):
                    call()
            assert len(seen) > before
    assert set(seen) == {torch.device("cpu")}


@pytest.mark.cuda
def test_on_a_gpu_the_per_request_path_matches_the_reference_without_syncing(monkeypatch):
    """On CUDA tensors (auto -> Triton): equal to the reference on CPU, and no host sync (sync debug mode errors)."""
    from nanospec_fx import RequestVocabs

    monkeypatch.delenv("NANOSPEC_KERNELS", raising=False)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(V, H, generator=g), torch.randn(V, generator=g)
    cpu, gpu = RequestVocabs(w, b, R, C), RequestVocabs(w.cuda(), b.cuda(), R, C)
    for v in (cpu, gpu):
        for rid in "abc":
            v.assign(rid)
    batch, tokens = ["c", "a", "c", "b"], torch.randint(-1, V, (4, 5), generator=g)
    x = torch.randn(4, H, generator=g)
    cpu.observe_rows(cpu.rows_for(batch), tokens)
    monkeypatch.setenv("NANOSPEC_KERNELS", "reference")
    want = cpu.logits(x, cpu.rows_for(batch)), cpu.topk(x, cpu.rows_for(batch), 3)
    monkeypatch.delenv("NANOSPEC_KERNELS")
    rows, tokens, x = gpu.rows_for(batch), tokens.cuda(), x.cuda()  # copies before the check: they may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu.observe_rows(rows, tokens)
        logits, (vals, toks) = gpu.logits(x, rows), gpu.topk(x, rows, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(logits.cpu(), want[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(vals.cpu(), want[1][0], rtol=1e-5, atol=1e-4)
    assert torch.equal(toks.cpu(), want[1][1])
    for name, got, ref in zip(schema.STATE, gpu.tensors(), cpu.tensors()):
        assert torch.equal(got.cpu(), ref), name
