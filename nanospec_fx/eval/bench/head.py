"""LM-head time at real model shapes: dense, FR-Spec static, and nanospec.

Variants of the head (all in one process, on the same weights):

* ``dense``: ``F.linear`` over the whole vocabulary;
* ``static-N``: FR-Spec, ``F.linear`` over a fixed copy of N rows (ids mapped back after top-k);
* ``nanospec-ops``: ``torch.ops.nanospec.compact_logits`` (+ ``scatter_logits`` to [rows, V]
  for the drop-in output) called directly on an :class:`ActiveVocab`;
* ``nanospec-compiled``: the head module through ``torch.compile(backend="nanospec")``.

Here the capacity is set to the active size. How the nanospec ops' cost follows the active count at
a fixed capacity (the CPU host path computes only the active rows, the Triton head skips tiles past
the count), next to what ``explain``'s cost model predicts: :func:`bench_head_vs_active`, also
``python benchmarks/head_vs_active.py``. Times are medians over repeats; the bytes-read limit of a
head restricted to N rows is V / N.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import nanospec_fx
from nanospec_fx.diagnostics.calibration import FLUSH_BYTES, MachineConstants, cold_timings
from nanospec_fx.diagnostics.cost_model import HeadCost
from nanospec_fx.eval.bench.timing import timings
from nanospec_fx.kernels import ops
from nanospec_fx.kernels.dispatch import path_for
from nanospec_fx.vocab.config import DEFAULT_CAPACITY, DEFAULT_STATIC_SIZE

# hidden size H, vocabulary V of the LM heads of real models
SHAPES = {
    "llama3-8b": (4096, 128256),
    "qwen2-7b": (3584, 152064),
    "gemma3-270m": (640, 262144),
    "gemma3-27b": (5376, 262144),
}


class Head(nn.Module):
    """A bare LM head: what ``torch.compile(backend="nanospec")`` rewrites."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        self.lm_head.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)


def active_ids(vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab, generator=g)[:n]


def filled_state(weight: torch.Tensor, n: int, capacity: int | None = None) -> nanospec_fx.ActiveVocab:
    """An ActiveVocab of capacity ``capacity`` (default ``n``) holding ``n`` random tokens."""
    st = nanospec_fx.ActiveVocab(weight, capacity=capacity or n)
    st.observe(active_ids(weight.shape[0], n).to(weight.device))
    return st


@dataclass
class HeadTiming:
    shape: str
    hidden: int
    vocab: int
    rows: int
    variant: str
    size: int  # vocabulary rows the head computes
    ms: float  # median
    speedup: float  # dense time / this time
    limit: float  # bytes-read limit of the speedup: V / size
    of_limit: float  # speedup / limit
    min_ms: float = float("nan")  # fastest call: the least disturbed by other processes


def bench_head(shape: str, hidden: int, vocab: int, active: int = DEFAULT_CAPACITY, static_n: int = DEFAULT_STATIC_SIZE,
               rows=(1, 10),
               repeats: int = 10, dtype=torch.float32, compiled: bool = True, device: str = "cpu",
               progress: Callable[[str], None] | None = None, inductor: bool = True) -> list[HeadTiming]:
    """Every head variant at one shape; the weight is allocated once."""
    torch.manual_seed(0)
    weight = torch.randn(vocab, hidden, dtype=dtype, device=device).div_(math.sqrt(hidden))  # in place: allocate once
    w_static = weight[active_ids(vocab, static_n, seed=1).to(device)].contiguous()
    state = filled_state(weight, active)
    cmod = None
    if compiled:
        torch._dynamo.reset()  # a fresh cache per shape: the recompile limit must not turn the head eager
        head = Head(weight).eval()
        cmod = torch.compile(head, backend="nanospec", options={"capacity": active, "inductor": inductor},
                             dynamic=False)
        with torch.no_grad():
            cmod(torch.zeros(1, hidden, dtype=dtype, device=device))
        nanospec_fx.active_vocab(head).observe(active_ids(vocab, active).to(device))
    out = []
    for r in rows:
        x = torch.randn(r, hidden, dtype=dtype, device=device)
        variants: dict[str, tuple[int, Callable]] = {
            "dense": (vocab, lambda: F.linear(x, weight)),
            f"static-{static_n}": (static_n, lambda: F.linear(x, w_static)),
            "nanospec-ops compact": (active, lambda: ops.compact_logits(x=x, cache_w=state.cache_w, cache_b=None,
                                                                        cursor=state.cursor)),
            "nanospec-ops +scatter": (active, lambda: ops.scatter_logits(
                compact=ops.compact_logits(x=x, cache_w=state.cache_w, cache_b=None, cursor=state.cursor),
                ids=state.ids, cursor=state.cursor, vocab_size=vocab)),
        }
        if cmod is not None:
            with torch.inference_mode():  # it must really be the rewritten head (not an eager fallback)
                if int(torch.isinf(cmod(x)).sum()) != r * (vocab - active):
                    raise RuntimeError("the compiled head does not compute the active vocabulary only")
            variants["nanospec-compiled"] = (active, lambda: cmod(x))
        with torch.inference_mode():
            times = {}
            for name, (size, fn) in variants.items():
                ts = timings(fn, repeats)
                times[name] = (size, statistics.median(ts), min(ts))
                if progress:
                    progress(f"{shape} rows={r} {name}")
        dense = times["dense"][1]
        for name, (size, t, tmin) in times.items():
            sp, lim = dense / t, vocab / size
            out.append(HeadTiming(shape, hidden, vocab, r, name, size, 1e3 * t, sp, lim, sp / lim, 1e3 * tmin))
    return out


def bench_head_sweep(shape: str, hidden: int, vocab: int, sizes, rows=(1, 10), repeats: int = 10,
                     dtype=torch.float32, device: str = "cpu", progress=None) -> list[HeadTiming]:
    """Head time against the active size (nanospec ops, compact logits) next to the dense head."""
    torch.manual_seed(0)
    weight = torch.randn(vocab, hidden, dtype=dtype, device=device).div_(math.sqrt(hidden))  # in place: allocate once
    out = []
    with torch.inference_mode():
        for r in rows:
            x = torch.randn(r, hidden, dtype=dtype, device=device)
            ts = timings(lambda: F.linear(x, weight), repeats)
            dense = statistics.median(ts)
            out.append(HeadTiming(shape, hidden, vocab, r, "dense", vocab, 1e3 * dense, 1.0, 1.0, 1.0, 1e3 * min(ts)))
            for n in sizes:
                st = filled_state(weight, n)
                ts = timings(lambda: ops.compact_logits(x=x, cache_w=st.cache_w, cache_b=None, cursor=st.cursor),
                             repeats)
                t = statistics.median(ts)
                out.append(HeadTiming(shape, hidden, vocab, r, "nanospec-ops compact", n, 1e3 * t, dense / t,
                                      vocab / n, dense / t / (vocab / n), 1e3 * min(ts)))
                if progress:
                    progress(f"rows={r} size={n}")
    return out


@dataclass
class ActiveTiming:
    rows: int
    active: int
    variant: str  # "compact" (top-k reads compact logits) or "+scatter" ([rows, V] logits)
    path: str  # the implementation that ran (kernels.dispatch.path_for)
    ms: float  # median
    dense_ms: float
    speedup: float  # dense / nanospec, measured (medians)
    predicted: float  # explain's cost model for this path, rows and active count
    min_speedup: float = float("nan")  # dense / nanospec from the fastest calls (the least disturbed by load)

    @property
    def error(self) -> float:
        """Prediction relative to the measurement (+0.2: predicted 20% more speedup than measured)."""
        return self.predicted / self.speedup - 1


def bench_head_vs_active(hidden: int, vocab: int, actives=(1, 100, 1000, 3000), capacity: int = 3072, rows=(1, 4),
                         repeats: int = 30, dtype=torch.float32, device: str = "cpu",
                         machine: MachineConstants | None = None) -> list[ActiveTiming]:
    """nanospec head time at a fixed capacity against the active count, measured and predicted.

    Every call starts with cold caches (:func:`cold_timings`): the dense head once per row count,
    then at each size the nanospec ops, compact logits and compact + scatter to [rows, V]. ``machine``: the cost
    model's constants (default: those of ``cost_model.MACHINE``; ``calibration.calibrate`` measures them here).
    """
    torch.manual_seed(0)
    weight = torch.randn(vocab, hidden, dtype=dtype, device=device).div_(math.sqrt(hidden))
    path, size = path_for(device), weight.element_size()
    states = {n: filled_state(weight, n, capacity) for n in actives}
    flush = torch.zeros(FLUSH_BYTES // 4, dtype=torch.float32, device=device)
    out = []
    with torch.inference_mode():
        for r in rows:
            x = torch.randn(r, hidden, dtype=dtype, device=device)
            dense_ts = cold_timings(lambda: F.linear(x, weight), max(3, repeats // 5), flush)
            dense = statistics.median(dense_ts)
            for n, st in states.items():
                variants = {
                    "compact": lambda: ops.compact_logits(x=x, cache_w=st.cache_w, cache_b=None, cursor=st.cursor),
                    "+scatter": lambda: ops.scatter_logits(
                        compact=ops.compact_logits(x=x, cache_w=st.cache_w, cache_b=None, cursor=st.cursor),
                        ids=st.ids, cursor=st.cursor, vocab_size=vocab),
                }
                for variant, fn in variants.items():
                    ts = cold_timings(fn, repeats, flush)
                    t = statistics.median(ts)
                    cost = HeadCost.for_path(vocab, hidden, size, variant == "compact", path, capacity, machine)
                    out.append(ActiveTiming(r, n, variant, path, 1e3 * t, 1e3 * dense, dense / t, cost.predict(r, n),
                                            min(dense_ts) / min(ts)))
    return out
