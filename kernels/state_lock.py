"""One lock per active-vocabulary state, taken by everything that writes it: the ``nanospec.observe`` op (so the
observers a compiled graph runs are serialised too, whichever thread calls the graph) and the state's own methods.

Why here and why keyed by memory: a compiled graph calls the op with the state's tensors, never with the Python
object that owns them, so the only thing the op and :class:`~nanospec_fx.ActiveVocab` /
:class:`~nanospec_fx.RequestVocabs` both see is the slot table ``ids``. The lock is picked from a fixed stripe of
re-entrant locks by the address of that table's storage: a host-side read of metadata (no device sync, no
registry that grows, nothing stored on the tensor, so states stay picklable and copyable). Two states that share
a stripe only wait for each other; one thread never holds two stripes at once (a state's writers touch only its
own tensors), so stripes cannot deadlock. Uncontended, the cost is one ``RLock`` acquire per call.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable

import torch

_STRIPES = tuple(threading.RLock() for _ in range(64))
_GOLDEN = 0x9E3779B97F4A7C15  # Fibonacci hashing: spreads aligned addresses over the stripes


def state_lock(ids: torch.Tensor) -> threading.RLock:
    """The lock of the state whose slot table is ``ids`` (any view of it gives the same lock)."""
    address = ids.untyped_storage().data_ptr()
    return _STRIPES[((address * _GOLDEN) & 0xFFFFFFFFFFFFFFFF) >> 58]


def serialised_op(body: Callable, ids_position: int) -> Callable:
    """``body`` (an op that writes the state tensors) run holding the lock of the state it writes, found in its
    ``ids`` argument (keyword, or positional at ``ids_position``)."""
    @functools.wraps(body)
    def locked(*args, **kwargs):
        ids = kwargs["ids"] if "ids" in kwargs else args[ids_position]
        with state_lock(ids):
            return body(*args, **kwargs)
    return locked


def holding_state_lock(method: Callable) -> Callable:
    """A state method (``self.ids`` is its slot table) run holding that state's lock: its reads see no half-done
    write, its writes interleave with no other (re-entrant: a method may call another)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with state_lock(self.ids):
            return method(self, *args, **kwargs)
    return locked
