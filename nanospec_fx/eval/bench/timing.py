"""The one timer of the benchmarks: wall time of a call with the device synchronised around it (the runtime
never synchronises to time itself: a benchmark hands it a :class:`PhaseTimer`)."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def sync() -> None:
    """Wait for queued device work (CUDA kernels run asynchronously; on CPU this does nothing)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_call(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes, device work included."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def timings(fn: Callable[[], object], repeats: int, warmup: int = 2, min_seconds: float = 0.3) -> list[float]:
    """Wall times of ``fn()`` in seconds: at least ``repeats`` calls and ``min_seconds`` in all (fast
    calls are repeated more, up to 200 times, so their median is not one scheduler hiccup)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    while len(times) < repeats or (sum(times) < min_seconds and len(times) < 200):
        times.append(time_call(fn))
    return times


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds of each function, calls interleaved so that load changes hit every variant alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(time_call(fn))
    return {name: statistics.median(t) for name, t in times.items()}


class Stopwatch:
    """Accumulates the seconds spent in ``with watch:`` blocks (e.g. the head's share of a draft round)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __enter__(self) -> "Stopwatch":
        sync()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        sync()
        self.seconds += time.perf_counter() - self._start


class PhaseTimer:
    """Seconds per phase of a decode loop: the ``timer`` of :func:`nanospec_fx.speculative.decode`
    (``timer(phase)`` is that phase's :class:`Stopwatch`)."""

    def __init__(self) -> None:
        self.watches: dict[str, Stopwatch] = {}

    def __call__(self, phase: str) -> Stopwatch:
        return self.watches.setdefault(phase, Stopwatch())

    def seconds(self, phase: str) -> float:
        return self.watches[phase].seconds if phase in self.watches else 0.0
