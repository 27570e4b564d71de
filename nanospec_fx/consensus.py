"""What the ranks of a tensor-parallel group decide locally, agreed before anyone runs a collective on it.

A compile (rewrite or dense), a refresh of the replicated rows: a rank that took such a decision alone would meet
another rank's collective of another size (gloo aborts the process) or wait for ever. Decisions are exchanged
through the group's store, a side channel with a timeout (:func:`store_exchange`), so a rank left alone ends in a
clear error on every rank, not a hang; a per-call flag is agreed with one all-reduce of one int
(:func:`all_ranks`).
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from nanospec_fx.collectives import resolve_group

_exchanges: dict[tuple[str, str], int] = {}  # (group, topic) -> how many exchanges this process made


def store_exchange(group_name: str, topic: str, value: str, what: str) -> list[str]:
    """Every rank's ``value`` for the next exchange of ``topic`` (``what`` it is, for the error), in rank order,
    through the group's store (not its collectives), waiting at most the store's timeout (the process group's).

    A store is a side channel: a rank that exchanges while another is inside a collective (a recompile or a refresh
    on one rank only) does not meet that collective (gloo would abort on the sizes, or both would hang): after the
    timeout it raises naming the ranks that never came and why they would not, and leaves that message in the
    store for the ranks left in the collective (:func:`explain_failure`). The n-th exchange of a topic on one rank
    meets the n-th on the others, so every rank must exchange as often (every rank compiles together).
    """
    group = resolve_group(group_name)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if dist.get_backend(group) == "fake":  # one process traces for all ranks: nothing to agree with
        return [value] * world
    from torch.distributed.distributed_c10d import _get_process_group_store

    store = _get_process_group_store(group)
    count = _exchanges[(group_name, topic)] = _exchanges.get((group_name, topic), 0) + 1
    keys = [f"nanospec/{topic}/{count}/{r}" for r in range(world)]
    store.set(keys[rank], value)
    try:
        store.wait(keys, store.timeout)
    except RuntimeError:  # DistStoreError: a timeout
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        message = (f"nanospec: rank {rank} of a tensor-parallel group started {what}, and rank(s) {missing} did not "
                   f"within {store.timeout.total_seconds():.0f} s (exchange {count} of '{topic}'). The ranks left "
                   "the same program: every rank must compile together (a torch._dynamo.reset(), another input "
                   "shape or dtype that fails a guard, or a graph only some ranks reach recompile one rank alone) "
                   "and change the head together. The process group is now unusable on every rank.")
        store.set(FAILURE_KEY, message)
        raise RuntimeError(message) from None
    return [store.get(key).decode() for key in keys]


FAILURE_KEY = "nanospec/failure"


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
