"""Round trips to a process group's store, counted: what tensor parallelism's check-in costs a rank (shared by
benchmarks/tp_check_in.py and the 2-rank test that asserts the count)."""
from __future__ import annotations


class CountingStore:
    """A store that counts the calls made through it (and through its clones), by method, and the waits that ran
    out (a reader polling for a rank that had not come yet): each call is one round trip to the store."""

    def __init__(self, store, counts: dict):
        self.store, self.counts = store, counts

    def clone(self):
        self.counts["clone"] = self.counts.get("clone", 0) + 1
        return CountingStore(self.store.clone(), self.counts)

    def __getattr__(self, name):
        method = getattr(self.store, name)
        if not callable(method) or name in ("timeout", "set_timeout"):  # local: no round trip
            return method

        def counted(*args, **kwargs):
            try:
                result = method(*args, **kwargs)
            except RuntimeError:
                self.counts["waits_ran_out"] = self.counts.get("waits_ran_out", 0) + 1
                raise
            self.counts[name] = self.counts.get(name, 0) + 1
            return result
        return counted

    @property
    def timeout(self):
        return self.store.timeout
