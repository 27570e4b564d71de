"""Exact counts of the CPU host path's work per op call: torch compute ops and the bytes of what they produce.

The ops pick the host path only for real, untraced CPU tensors; under a dispatch mode (which is how ops are
counted) they take the reference instead (:mod:`nanospec_fx.kernels.dispatch`). So this calls the host
implementations themselves, on a state's tensors, under :func:`nanospec_fx.kernels.launch_count.counting` (aten
compute ops, views and allocations excluded) and a mode that adds up the bytes of every tensor those ops return.
Counts, not timings: they do not depend on the machine's load.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Bytes(TorchDispatchMode):
    """Bytes of every non-view tensor the ops under it return (what they write)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not func.is_view:
                self.total += t.numel() * t.element_size()
        return out


def host_op_counts(state, rows: int = 1, k: int = 1) -> dict[str, dict]:
    """``{op: {"torch_ops", "ops", "bytes_produced"}}`` for one host-path call of each op a draft step makes on
    ``state`` (an :class:`~nanospec_fx.ActiveVocab` on the CPU) as it is: ``observe`` of one active id (the fed
    token), ``compact_logits`` of ``rows`` rows, ``compact_topk`` of ``k`` over their log-softmax."""
    from nanospec_fx.kernels import host
    from nanospec_fx.kernels.launch_count import counting

    ids, slot_of, cursor, cache_w, cache_b = state.tensors()
    x = torch.randn(rows, cache_w.shape[1], dtype=cache_w.dtype)
    scores = torch.log_softmax(host.compact_logits(x, cache_w, None, cursor).float(), -1)
    token = ids[:1].clone()
    calls = {
        "observe (1 active id)": lambda: host.observe(token, state.head_rows, None, ids, slot_of, cursor, cache_w,
                                                      cache_b, state.num_pinned),
        f"compact_logits ({rows} row(s))": lambda: host.compact_logits(x, cache_w, None, cursor),
        f"compact_topk (k={k}, {rows} row(s))": lambda: host.compact_topk(scores, ids, cursor, k),
    }
    out = {}
    for name, call in calls.items():
        bytes_mode = _Bytes()
        with bytes_mode, counting() as seen:
            call()
        out[name] = {"torch_ops": len(seen.torch_ops), "ops": seen.torch_ops, "bytes_produced": bytes_mode.total}
    return out
