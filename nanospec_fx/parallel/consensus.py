"""What the ranks of a tensor-parallel group decide locally, agreed before anyone runs a collective on it.

A compile (rewrite or dense), a refresh of the replicated rows: a rank that took such a decision alone would meet
another rank's collective of another size (gloo aborts the process) or wait for ever. Decisions are exchanged
through the group's store, a side channel with a timeout (:func:`store_exchange`), so a rank left alone ends in a
clear error on every rank, not a hang; a per-call flag is agreed with one all-reduce of one int
(:func:`all_ranks`).

Every collective of nanospec's own (an eager observe's fetch, a refresh, a compiled step whose graph fetches rows or
whose head reads the replicated rows) is preceded by a *check-in* through the same store (:func:`check_in`): each
rank says which step it is at and what it holds (its head shard's dtype and shape, whether it was written since,
how many times its set was reset). Ranks at different steps, or holding different heads, all raise
:class:`~nanospec_fx.parallel.collectives.RanksDiverged` before anyone enters a collective; a rank that does not come
(it
raised, ran the drafter eagerly, observed once more) leaves the others waiting at most the store's timeout, then
they raise naming it and its last step, and the first such message is the one every rank raises.
"""
from __future__ import annotations

import datetime
import json
import time

import torch
import torch.distributed as dist

from nanospec_fx.parallel.collectives import RanksDiverged, listed_if_they_differ, resolve_group

_counts: dict[tuple[str, str], int] = {}  # (group, topic) -> how many meetings of that topic this process made
_failed: dict[str, tuple] = {}  # group -> (its store, the failure message this process raised: the group is unusable)
_clients: dict[str, tuple] = {}  # group -> (its store, this process's own client of it: waits of at most _POLL)

FAILURE_KEY = "nanospec/failure"
_POLL = datetime.timedelta(seconds=1)  # how long one wait lasts before a waiting rank looks for a failure message


def _store_of(group_name: str):
    """The group's store (the one its process group was made with), or None for a fake group."""
    group = resolve_group(group_name)
    if dist.get_backend(group) == "fake":  # one process traces for all ranks: nothing to agree with
        return None
    from torch.distributed.distributed_c10d import _get_process_group_store

    return _get_process_group_store(group)


def _client(group_name: str, store):
    """This process's own client of ``store`` (a clone: its own connection), whose reads wait at most ``_POLL``: a
    meeting reads every other rank's key in one call that blocks until they are there (``multi_get``), and still
    looks for a failure message every ``_POLL``. Made once per group (a new group, a new store: a new client)."""
    known = _clients.get(group_name)
    if known is None or known[0] is not store:
        client = store.clone()
        client.set_timeout(_POLL)
        known = _clients[group_name] = (store, client)
    return known[1]


def meet(group_name: str, topic: str, value: str, what: str, remedy: str) -> list[str]:
    """Every rank's ``value`` at its next meeting on ``topic`` (``what`` it is doing, for the errors), in rank order,
    through the group's store, waiting at most the store's timeout (the process group's).

    Three store calls when every rank comes: one ``multi_set`` (this rank's value and its last step), one
    ``multi_get`` of the others' values (it blocks until they are set), one ``delete_key`` of this rank's value of
    the meeting before (every rank has read it: each set this one after reading it). A rank that does not come
    within the timeout is named with its last step (``remedy`` says why ranks part), and that message is left in the
    store (:func:`leave_failure`) and this rank's value taken back (a rank coming later finds the message and raises
    it, instead of meeting a rank that left); a rank waiting elsewhere in the store raises it within ``_POLL``, a rank
    whose collective failed meanwhile raises it too (:func:`explain_failure`), and this process raises it at every
    later meeting of the group without a store call (the group is unusable). The n-th meeting of a topic on one rank
    meets the n-th on the others, so every rank must meet as often (SPMD).
    """
    group = resolve_group(group_name)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    store = _store_of(group_name)
    if store is None:
        return [value] * world
    failed = _failed.get(group_name)
    if failed is not None and failed[0] is store:
        raise RanksDiverged(failed[1])
    count = _counts[(group_name, topic)] = _counts.get((group_name, topic), 0) + 1
    keys = [f"nanospec/{topic}/{count}/{r}" for r in range(world)]
    others = keys[:rank] + keys[rank + 1:]
    label = f"check-in {count}" if topic == "check-in" else f"exchange {count} of '{topic}'"
    store.multi_set([_last_key(rank), keys[rank]], [f"{label}, {what}", value])
    read = _read_all(group_name, store, others)
    if read is None:  # this meeting is abandoned: no rank coming later may complete it with this rank's record
        store.delete_key(keys[rank])
        missing = [r for r, key in enumerate(keys) if r != rank and not store.check([key])]
        leave_failure(group_name, store, (
            f"nanospec: rank {rank} of a tensor-parallel group reached {label} ({what}) and rank(s) {missing} did "
            f"not within {store.timeout.total_seconds():.0f} s ({_last_steps(store, missing)}). {remedy} The process "
            "group is now unusable on every rank."))
    if count > 1:
        store.delete_key(f"nanospec/{topic}/{count - 1}/{rank}")
    values = [v.decode() for v in read]
    return values[:rank] + [value] + values[rank:]


def _read_all(group_name: str, store, keys: list[str]) -> list[bytes] | None:
    """The values of ``keys`` once every one is set (one ``multi_get`` when they are there within ``_POLL``), or
    None past the store's timeout; a failure message another rank left is raised at once (every ``_POLL``)."""
    if not keys:
        return []
    client = _client(group_name, store)
    deadline = time.monotonic() + store.timeout.total_seconds()
    while True:
        try:
            return client.multi_get(keys)
        except RuntimeError:  # DistStoreError: not there within _POLL
            raise_failure(group_name, store)
            if time.monotonic() >= deadline:
                return None


def store_exchange(group_name: str, topic: str, value: str, what: str) -> list[str]:
    """Every rank's ``value`` for the next exchange of ``topic`` (``what`` it is, for the error), in rank order
    (:func:`meet`: the store, not the group's collectives).

    A store is a side channel: a rank that exchanges while another is inside a collective (a recompile or a refresh
    on one rank only) does not meet that collective (gloo would abort on the sizes, or both would hang): after the
    timeout it raises naming the ranks that never came and why they would not, and leaves that message in the
    store for the ranks left in the collective (:func:`explain_failure`). Every rank compiles together.
    """
    return meet(group_name, topic, value, what, (
        "The ranks left the same program: every rank must compile together (a torch._dynamo.reset(), another input "
        "shape or dtype that fails a guard, or a graph only some ranks reach recompile one rank alone) and change "
        "the head together."))


def _last_key(rank: int) -> str:
    return f"nanospec/last/{rank}"


def _last_steps(store, ranks: list[int]) -> str:
    """What ``ranks`` last did with the store (their last check-in or exchange), for an error message."""
    def last(r):
        return store.get(_last_key(r)).decode() if store.check([_last_key(r)]) else "nothing yet"
    return "last step of " + "; ".join(f"rank {r}: {last(r)}" for r in ranks)


def raise_failure(group_name: str, store) -> None:
    """Raise the message a rank of the group left when it gave up (the group is unusable), and remember it: this
    process raises it before any later meeting, so it never enters a collective the others have left."""
    if store.check([FAILURE_KEY]):
        message = store.get(FAILURE_KEY).decode()
        _failed[group_name] = (store, message)
        raise RanksDiverged(message)


def leave_failure(group_name: str, store, message: str, kind: type = RanksDiverged) -> None:
    """Leave ``message`` for the other ranks unless one left its own first (then raise that one: every rank raises
    the same message), and raise it."""
    first = store.compare_set(FAILURE_KEY, "", message).decode()
    _failed[group_name] = (store, first)
    raise (kind if first == message else RanksDiverged)(first)


def check_in(group_name: str, step: str, facts: dict) -> list[dict]:
    """Every rank's ``facts`` (JSON values) at its next check-in, in rank order, after checking that every rank is
    at the same ``step`` (a short name: "observe", "compiled draft step"...).

    Called before each collective of nanospec's own, so the ranks meet in the store (bounded) before they meet in
    the collective (unbounded, or aborting on sizes). Ranks at different steps raise :class:`RanksDiverged`
    listing each rank's step, at once; a rank that does not come within the store's timeout is named with its last
    step, and that message is left for the others. Three store calls when every rank comes (:func:`meet`), no
    device sync."""
    values = meet(group_name, "check-in", json.dumps({"step": step, **facts}), step, (
        "A rank raised, ran the drafter outside nanospec (eagerly, or in a frame Dynamo skipped), observed, reset or "
        "compiled alone: every rank must make the same nanospec calls in the same order (SPMD)."))
    records = [json.loads(v) for v in values]
    if listed := listed_if_they_differ([r["step"] for r in records]):
        raise RanksDiverged(
            f"nanospec: the ranks of a tensor-parallel group are at different steps at check-in "
            f"{_counts[(group_name, 'check-in')]} ({listed}): a rank observed, reset or ran a draft step the others "
            "did not. Every rank must make the same nanospec calls in the same order (SPMD); every rank raises this "
            "before any collective.")
    return records


def explain_failure(group_name: str, error: BaseException) -> None:
    """A rank whose collective failed (timed out) while another rank of its group raised a nanospec error in
    :func:`store_exchange` raises that error too (the same message on every rank); else nothing."""
    try:
        group = resolve_group(group_name)
        if dist.get_backend(group) == "fake":
            return
        from torch.distributed.distributed_c10d import _get_process_group_store

        store = _get_process_group_store(group)
        if not store.check([FAILURE_KEY]):
            if "timed out" not in str(error).lower() and "timeout" not in str(error).lower():
                return
            # the rank that gave up left the message when its own wait ended, about when this collective's did
            store.wait([FAILURE_KEY], min(store.timeout, datetime.timedelta(seconds=10)))
        message = store.get(FAILURE_KEY).decode()
        _failed[group_name] = (store, message)
    except Exception:  # noqa: BLE001 - no group, no store, no message: the original error stands
        return
    raise RuntimeError(message) from error


def agree(group_name: str, decision: str, what: str = "drafter") -> None:
    """Every rank of the group compiled the same decision for its vocabulary-parallel head (``what``: the drafter,
    or the target whose observers run collectives), or all raise.

    A rank that rewrites the head stops gathering logits; a rank that runs it dense still gathers: mixed
    decisions would hang at the next draft step. This exchanges each rank's decision through the group's store at
    compile time (:func:`store_exchange`: a rank compiling alone gets a clear error after the timeout, not a hang
    in another rank's collective) and raises the same ``RuntimeError``, listing every rank's decision, on every
    rank.
    """
    decisions = store_exchange(group_name, "compile", decision, what=f"compiling a tensor-parallel {what}")
    if len(set(decisions)) > 1:
        listed = "; ".join(f"rank {r}: {d}" for r, d in enumerate(decisions))
        raise RuntimeError(
            f"nanospec: the ranks of a tensor-parallel {what} took different decisions for its vocabulary-parallel "
            f"head ({listed}). Every rank must compile the {what} the same way (same options, same grad mode, the "
            "same code path, the same input shapes), or the ranks would wait forever on different collectives.")


def all_ranks(group_name: str, holds: bool, device: torch.device | str = "cpu") -> bool:
    """Whether ``holds`` is true on every rank of the group (one all-reduce of one int, MIN; a host read). Every
    rank gets the same answer, so a decision taken on it is the same everywhere (a rank that checked something
    locally and found it false turns it off on every rank, instead of leaving the ranks on different collectives).
    """
    if dist.get_backend(resolve_group(group_name)) == "fake":
        return holds
    flag = torch.tensor([int(bool(holds))], dtype=torch.int32, device=device)
    flag = torch.ops._c10d_functional.wait_tensor.default(
        torch.ops._c10d_functional.all_reduce.default(flag, "min", group_name))
    return bool(flag.item())
