"""Whether a timed run has the cores it asks for.

On a shared machine torch's threads plus what else runs can exceed the cores: OpenMP threads then spin on
shared cores and a compiled variant can run many times slower while an eager row looks normal, so every
ratio of the table is wrong with nothing said. Each measuring verb checks at its start (and the JSON keeps
the verdict). ``load_average`` and ``usable_cores`` are the only readers of the machine's state: tests
replace them.
"""
from __future__ import annotations

import math
import os


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages, None where the system has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def free_cores(load: float | None, cores: int) -> int:
    """The cores the rest of the machine leaves free: ``cores`` less the 1-minute load average, rounded up
    (a load of 0.3 on 2 cores leaves 2; 1.2 leaves 1), at least 0. Unknown load: all of them."""
    if load is None:
        return cores
    return max(0, math.ceil(cores - load))


def oversubscription(threads: int, load: float | None, cores: int, processes: int = 1) -> str | None:
    """What to say when ``processes`` x ``threads`` torch threads exceed the cores the machine leaves free
    (None when they fit)."""
    free = free_cores(load, cores)
    wanted = threads * processes
    if wanted <= free:
        return None
    busy = "" if load is None else f" with a 1-minute load average of {load:.1f}"
    who = f"{processes} processes x {threads} threads" if processes > 1 else f"{threads} threads"
    fewer = max(1, free // processes)
    remedy = "rerun on an idle machine" + (f", or with --threads {fewer}" if fewer < threads else "")
    return (f"oversubscribed: {who} on {cores} cores{busy} ({free} free); spinning threads on shared cores can slow "
            f"the compiled variants many times more than the eager ones, so the timings and ratios of this run are "
            f"not trustworthy: {remedy}")


def check(threads: int, processes: int = 1) -> tuple[list[float] | None, str | None]:
    """The machine's load average now, and :func:`oversubscription`'s verdict for ``threads``."""
    load = load_average()
    return load, oversubscription(threads, load[0] if load else None, usable_cores(), processes)
