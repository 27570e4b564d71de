"""Token ids embedded by a call that scores no head (a prefill call), held until the heads of its model read them.

A drafter's prefill call embeds the prompt and returns hidden states or a KV cache; its graph has no
head, so nothing there can observe into the head's active vocabulary. The ids are kept in a log per
(table, model): the table tensor they were looked up in, and the model's other parameters and buffers that
call read (its *owners*, held weakly). A rewritten head whose graph looks up that table reads a log only when
its own call received every owner: that proves the prefill ran the same model, not another one that shares
the embedding (drafters sharing the target's ``nn.Embedding``, two drafters on one table). Each head reads a
log once, whole (its ids in embedding order, the last ``_KEEP`` of them), and then gets the log's later ids
as they are recorded (a head that ran before a log existed gets it that way from the start, if it owns it), so
every head of the model sees the prompt, however many heads it has and whenever each first runs. A prefill that
reads nothing but the table proves no owner: its ids go to every head that looks that table up. A freed table or
owner drops its logs.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

_LOGS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # table tensor -> list of _Log
_HEADS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # table tensor -> {ActiveVocab: what its head's call read}
_KEEP = 1 << 16  # ids a log keeps for heads that have not read it yet (the newest; bounded memory, no sync)


class _Log:
    """The ids one model's prefill calls looked up in one table, and the heads that have read them."""

    def __init__(self, owners: list[torch.Tensor]):
        self.owners = [weakref.ref(t) for t in owners]
        self.ids: list[torch.Tensor] = []
        self.readers: weakref.WeakSet = weakref.WeakSet()  # ActiveVocab that observed every id of this log

    def alive(self) -> bool:
        return all(r() is not None for r in self.owners)

    def is_of(self, owners: list[torch.Tensor]) -> bool:
        return len(owners) == len(self.owners) and all(r() is t for r, t in zip(self.owners, owners))

    def owned_by(self, tensors: set[int]) -> bool:
        return all(id(r()) in tensors for r in self.owners)

    def append(self, ids: torch.Tensor) -> None:
        self.ids.append(ids)
        total = sum(t.numel() for t in self.ids)  # shapes only: no device read
        while total > _KEEP:
            if len(self.ids) > 1:
                total -= self.ids.pop(0).numel()
            else:
                self.ids[0], total = self.ids[0][-_KEEP:], _KEEP


def _logs(table: torch.Tensor) -> list[_Log]:
    logs = _LOGS.get(table)
    if logs is None:
        return []
    logs[:] = [log for log in logs if log.alive()]
    return logs


def record(table: torch.Tensor, ids: torch.Tensor, owners: list[torch.Tensor]) -> None:
    """Keep ``ids`` (looked up in ``table`` by a call that also read ``owners``) in their model's log, and observe
    them into the heads that have read it."""
    logs = _logs(table)
    log = next((log for log in logs if log.is_of(owners)), None)
    if log is None:
        log = _Log(owners)
        _LOGS.setdefault(table, logs).append(log)
        for state, tensors in list(_HEADS.get(table, {}).items()):  # heads that ran before: theirs if they own it
            if log.owned_by({id(t) for t in tensors.keys()}):
                log.readers.add(state)
    kept = ids.detach().flatten().to(torch.int64).clone()
    for state in list(log.readers):
        state.observe(kept, validate=False)
    log.append(kept)


def claim(table: torch.Tensor, state, tensors: Callable[[], Iterable[torch.Tensor]]) -> torch.Tensor | None:
    """The ids of every log of ``table`` that ``state``'s head has not read and whose owners are all among
    ``tensors()`` (the parameters and buffers of the head's call), in embedding order per log; ``state`` reads
    those logs' later ids as they are recorded. None: nothing new."""
    heads = _HEADS.get(table)
    if heads is None:
        heads = _HEADS[table] = weakref.WeakKeyDictionary()
    logs = [log for log in _logs(table) if state not in log.readers]
    if not logs and state in heads:
        return None
    read = list(tensors())
    heads[state] = WeakIdKeyDictionary({t: True for t in read})  # a later prefill of its model goes straight in
    mine = {id(t) for t in read}
    kept = []
    for log in logs:
        if log.owned_by(mine):
            log.readers.add(state)
            kept += log.ids
    return torch.cat(kept) if kept else None


class RecordingCall:
    """A head-less graph compiled with its lookups' ids as extra outputs: each call records them under
    their table (an input of the graph, read from the call's arguments) and the other parameters and buffers
    the call received (``owners``: input positions), then returns the graph's own outputs. A call that raises
    records nothing."""

    def __init__(self, compiled: Callable, outputs: int, tables: list[tuple[int, int]], owners: list[int] = ()):
        self.compiled, self.outputs, self.tables = compiled, outputs, tables  # (table input position, output index)
        looked_up = {position for position, _ in tables}
        self.owners = [p for p in owners if p not in looked_up]

    def __call__(self, *args: Any) -> Any:
        result = self.compiled(*args)
        owners = [args[p] for p in self.owners]
        for position, index in self.tables:
            record(args[position], result[index], owners)
        return result[: self.outputs]
