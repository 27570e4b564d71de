"""The cost model's constants measured on this machine: ``explain(module, calibrate=True)``.

:data:`nanospec_fx.diagnostics.cost_model.MACHINE` holds constants fitted on one 2-core test machine. Another CPU
streams at
another bandwidth, reads a large matrix at another share of it and pays another fixed cost per call: carried over
to a second 2-core machine they put the prediction 2-3.5x off (docs/kernels.md). :func:`calibrate` measures the
three constants here, with caches flushed before every timed call as in a draft round:

* the bandwidth the compact head streams with: the slope of plain ``F.linear`` over two cache-sized blocks;
* the dense head's share of it (one row over a matrix larger than any cache) and, from four rows, the FLOPs per
  byte at which the dense product turns compute-bound;
* the fixed cost of one call of the path's own compact head with one active token, less the bytes it moves: what
  no byte count sees (dispatch, small ops, cold code). This one is a measurement of nanospec itself, so a
  prediction at one active token is close to it by construction; the other sizes and row counts are predictions.

CPU only (the host and reference paths). On a GPU the Triton constants stay assumed (no GPU timing yet).

Timings on a loaded machine can be noise: a slope of zero turns into a bandwidth of petabytes per second. Each
measurement is checked against :data:`PLAUSIBLE` and taken again up to :data:`ATTEMPTS` times; if none is
plausible, :class:`CalibrationError` says which constant was off (``explain`` then warns and keeps the fitted
constants).
"""
from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FLUSH_BYTES = 128 << 20  # more than the last-level cache of the machines this was checked on (32 MiB)
_DENSE_BYTES = 256 << 20  # the dense probe's matrix: streams from memory, as a vocabulary-sized head does
ATTEMPTS = 3
# Bounds no CPU's measurement falls outside: a bandwidth between a slow laptop's memory and far above any cache
# (bytes/s), a dense head between 1% and twice the compact head's bandwidth, a positive compute bound.
PLAUSIBLE = {"bandwidth": (1e8, 5e12), "dense_efficiency": (0.01, 2.0), "dense_flops_per_byte": (1e-3, 1e4)}


class CalibrationError(RuntimeError):
    """The measured constants are implausible (a loaded machine): the message names the constant and its bounds."""


@dataclass(frozen=True)
class MachineConstants:
    """A path's cost-model constants (the fields of :data:`nanospec_fx.diagnostics.cost_model.MACHINE`), and where
    from."""

    fixed_bytes: int  # a nanospec call's fixed cost, as bytes at ``bandwidth``
    dense_efficiency: float  # the dense head's bandwidth relative to the compact head's
    dense_flops_per_byte: float | None  # the dense head is compute-bound at this many FLOPs per byte; None: never
    bandwidth: float | None = None  # bytes/s the compact head streams with (None: not measured)
    source: str = "fitted on the project's 2-core test machine; explain(..., calibrate=True) measures this one"

    @classmethod
    def fitted(cls, path: str) -> "MachineConstants":
        """``cost_model.MACHINE[path]``: fitted on the project's test machine (host, reference), assumed (triton)."""
        from nanospec_fx.diagnostics.cost_model import MACHINE

        fixed, efficiency, flops_per_byte = MACHINE[path]
        if path == "triton":
            return cls(fixed, efficiency, flops_per_byte, source="assumed (no GPU timing yet)")
        return cls(fixed, efficiency, flops_per_byte)

    def describe(self) -> str:
        if self.bandwidth is None:
            return f"constants {self.source}"
        return (f"constants measured on this machine: compact head {self.bandwidth / 1e9:.1f} GB/s, fixed cost "
                f"{1e6 * self.fixed_bytes / self.bandwidth:.0f} us per call, dense head at "
                f"{self.dense_efficiency:.2f} of that bandwidth, compute-bound from "
                f"{self.dense_flops_per_byte:.2f} FLOP/byte")


def cold_timings(fn, repeats: int, flush: torch.Tensor) -> list[float]:
    """Seconds of ``fn()`` with the caches flushed before each call (``flush`` is rewritten, untimed): in a draft
    round the drafter's body runs between two head calls and evicts the head's data, so a warm loop would time
    the compact head from the cache instead of from memory. Device work included (synchronised on a GPU)."""
    sync = torch.cuda.synchronize if flush.is_cuda else (lambda: None)
    fn()
    times = []
    for _ in range(repeats):
        flush.add_(1)
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return times


def _cold_median(fn, flush: torch.Tensor, repeats: int) -> float:
    return statistics.median(cold_timings(fn, repeats, flush))


def implausible(constants: MachineConstants) -> str | None:
    """Which measured constant lies outside :data:`PLAUSIBLE`, and its value (None: all plausible)."""
    for name, (low, high) in PLAUSIBLE.items():
        value = getattr(constants, name)
        if value is None or not low <= value <= high:
            return f"{name} = {value:.3g}, outside [{low:g}, {high:g}]" if value is not None else f"{name} unmeasured"
    return None


@functools.lru_cache(maxsize=None)
def calibrate(hidden_size: int, dtype: torch.dtype = torch.float32, repeats: int = 9) -> MachineConstants:
    """Measure this CPU's cost-model constants for heads of width ``hidden_size`` in ``dtype`` (about a second;
    cached per process). Uses torch's current thread count, as the head calls do. Raises
    :class:`CalibrationError` when no attempt gave plausible constants (nothing is cached then)."""
    if hidden_size < 1:
        raise ValueError(f"hidden_size must be >= 1, got {hidden_size}")
    reasons = []
    for _ in range(ATTEMPTS):
        constants = measure(hidden_size, dtype, repeats)
        reason = implausible(constants)
        if reason is None:
            return constants
        reasons.append(reason)
    raise CalibrationError(f"calibration gave implausible constants in {ATTEMPTS} attempts ({'; '.join(reasons)}): "
                           "timings this noisy mean the machine is busy; measure again on an idle one")


def measure(hidden_size: int, dtype: torch.dtype = torch.float32, repeats: int = 9) -> MachineConstants:
    """One measurement of the constants, unchecked (:func:`calibrate` checks it)."""
    from nanospec_fx.kernels import ops
    from nanospec_fx.vocab.state import ActiveVocab

    b = torch.empty((), dtype=dtype).element_size()
    g = torch.Generator().manual_seed(0)
    flush = torch.zeros(FLUSH_BYTES // 4)
    with torch.inference_mode():
        x1 = torch.randn(1, hidden_size, generator=g).to(dtype)
        x4 = torch.randn(4, hidden_size, generator=g).to(dtype)
        # streaming bandwidth: the slope between two blocks of a compact cache's size (the intercept is F.linear's)
        small, large = 1024, 4096
        blocks = {n: torch.randn(n, hidden_size, generator=g).to(dtype) for n in (small, large)}
        t = {n: _cold_median(lambda w=w: F.linear(x1, w), flush, repeats) for n, w in blocks.items()}
        bandwidth = (large - small) * hidden_size * b / max(t[large] - t[small], 1e-9)
        # the dense head: one row streams, four rows show where it turns compute-bound
        n_dense = max(1, _DENSE_BYTES // (hidden_size * b))
        dense_w = torch.randn(n_dense, hidden_size, generator=g).to(dtype)
        t1 = _cold_median(lambda: F.linear(x1, dense_w), flush, max(5, repeats // 2))
        t4 = _cold_median(lambda: F.linear(x4, dense_w), flush, max(5, repeats // 2))
        dense_bytes = n_dense * hidden_size * b
        efficiency = dense_bytes / t1 / bandwidth
        flops_per_byte = 2 * 4 * hidden_size * n_dense / (t4 * bandwidth)
        # the fixed cost: the path's own compact head with one active token, less the bytes it moves
        state = ActiveVocab(blocks[large], capacity=large)
        state.observe(torch.tensor([0]))
        t_fixed = _cold_median(
            lambda: ops.compact_logits(x=x1, cache_w=state.cache_w, cache_b=None, cursor=state.cursor), flush, repeats)
        fixed_bytes = max(0, int(t_fixed * bandwidth) - 2 * hidden_size * b)
    return MachineConstants(fixed_bytes, efficiency, flops_per_byte, bandwidth, "measured on this machine")
