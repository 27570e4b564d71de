"""The one timer of the benchmarks (the ``nanospec-fx`` verbs and every script in benchmarks/): wall time of a call
with the device synchronised around it, or CUDA-event time with the L2 cache flushed (:func:`device_timings`). The
runtime never synchronises to time itself: a benchmark hands it a :class:`PhaseTimer`."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def sync() -> None:
    """Wait for queued device work (CUDA kernels run asynchronously; on CPU this does nothing)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds ``fn()`` takes, device work included; ``clock=time.process_time``: this process's CPU time, which
    a busy machine disturbs far less than wall time."""
    sync()
    start = clock()
    fn()
    sync()
    return clock() - start


def timings(fn: Callable[[], object], repeats: int, warmup: int = 2, min_seconds: float = 0.3,
            clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Times of ``fn()`` in seconds (:func:`time_call`): at least ``repeats`` calls and ``min_seconds`` in all
    (fast calls are repeated more, up to 200 times, so their median is not one scheduler hiccup)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    while len(times) < repeats or (sum(times) < min_seconds and len(times) < 200):
        times.append(time_call(fn, clock))
    return times


_L2_FLUSH: list[torch.Tensor] = []  # one buffer larger than any L2 cache, made on first use


def device_timings(fn: Callable[[], object], iters: int, warmup: int = 3, before: Callable[[], object] | None = None,
                   device: str = "cpu") -> list[float]:
    """Seconds of ``iters`` calls of ``fn()``, each after an untimed ``before()`` (new inputs, a barrier). On CUDA:
    CUDA-event times with the L2 cache flushed before each call (a drafter's other work evicts the head between
    steps), read after one synchronisation; elsewhere :func:`time_call`."""
    for _ in range(warmup):
        if before:
            before()
        fn()
    if torch.device(device).type != "cuda":
        times = []
        for _ in range(iters):
            if before:
                before()
            times.append(time_call(fn))
        return times
    if not _L2_FLUSH:
        _L2_FLUSH.append(torch.empty(256 * 2**20, dtype=torch.int8, device="cuda"))
    events = []
    for _ in range(iters):
        if before:
            before()
        _L2_FLUSH[0].zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in events]


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3,
                        clock: Callable[[], float] = time.perf_counter,
                        before: Callable[[], object] | None = None) -> dict[str, float]:
    """Median seconds of each function, calls interleaved so that load changes hit every variant alike
    (``clock=time.process_time``: this process's CPU time, as :func:`time_call`). ``before``, if given, runs
    untimed before every timed call: what precedes the call where it really runs (a decode loop's draft round
    follows the target's verify, which leaves the caches cold), so each call pays what it pays there."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if before is not None:
                before()
            times[name].append(time_call(fn, clock))
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
    """Seconds per phase of a decode loop: the ``timer`` of :func:`nanospec_fx.eagle.speculative.decode`
    (``timer(phase)`` is that phase's :class:`Stopwatch`)."""

    def __init__(self) -> None:
        self.watches: dict[str, Stopwatch] = {}

    def __call__(self, phase: str) -> Stopwatch:
        return self.watches.setdefault(phase, Stopwatch())

    def seconds(self, phase: str) -> float:
        return self.watches[phase].seconds if phase in self.watches else 0.0
