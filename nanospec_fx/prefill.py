"""Token ids embedded by a call that scores no head (a prefill call), held until the head reads its set.

A drafter's prefill call embeds the prompt and returns hidden states or a KV cache; its graph has no
head, so nothing there can observe into the head's active vocabulary. The ids are keyed by the table
they were looked up in (the tensor itself, held weakly): once a rewritten head whose graph looks up that
table has run, they go straight into its set; before that, they are kept and that head observes them
before its own call's ids. The link is the table tensor:
two instances of one class have two tables, and a model that is freed takes its pending ids with it.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

_PENDING: WeakIdKeyDictionary = WeakIdKeyDictionary()  # table tensor -> list of int64 id tensors
_READERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # table tensor -> WeakSet of ActiveVocab that observe it
_COLLAPSE_AT = 1 << 16  # pending ids kept unique beyond this many (a head that never reads them: bounded memory)


def record(table: torch.Tensor, ids: torch.Tensor) -> None:
    """Observe ``ids`` (looked up in ``table``) into the states of the heads that read ``table``; before any
    such head ran, keep them for the first one."""
    readers = list(_READERS.get(table, ()))
    if readers:
        for state in readers:
            state.observe(ids.detach(), validate=False)
        return
    kept = _PENDING.setdefault(table, [])
    kept.append(ids.detach().flatten().to(torch.int64).clone())
    if sum(t.numel() for t in kept) > _COLLAPSE_AT:
        kept[:] = [torch.unique(torch.cat(kept))]


def claim(table: torch.Tensor, states: list) -> torch.Tensor | None:
    """The heads of ``states`` observe lookups into ``table`` (a rewritten graph runs with them: several heads of one
    graph claim together): later prefill ids go straight into them; returns the ids recorded before, in the order
    they were embedded (None: none), for each of them to observe."""
    readers = _READERS.setdefault(table, weakref.WeakSet())
    for state in states:
        readers.add(state)
    kept = _PENDING.pop(table, None)
    return torch.cat(kept) if kept else None


def clear() -> None:
    _PENDING.clear()
    _READERS.clear()


class RecordingCall:
    """A head-less graph compiled with its lookups' ids as extra outputs: each call records them under
    their table (an input of the graph, read from the call's arguments) and returns the graph's own outputs."""

    def __init__(self, compiled: Callable, outputs: int, tables: list[tuple[int, int]]):
        self.compiled, self.outputs, self.tables = compiled, outputs, tables  # (table input position, output index)

    def __call__(self, *args: Any) -> Any:
        result = self.compiled(*args)
        for position, index in self.tables:
            record(args[position], result[index])
        return result[: self.outputs]
