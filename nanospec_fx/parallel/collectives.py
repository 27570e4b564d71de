"""The collectives of a vocabulary-parallel head's replicated state: which rows this rank holds
(:class:`VocabShard`), and the checked row fetch that carries, in its own all-reduce, the check that every rank
fetched the same ids (:func:`fetch_checked`).

Every rank keeps the same active set and all its rows; rows join with one small all-reduce (zeros from every rank
but the owner, so the sum is the owner's row, bit for bit). Nothing forces the ranks to feed the same ids, so each
fetch checks it where it is cheap, and every rank raises the same error when they differ. What a rank decides
alone before a collective is agreed in :mod:`nanospec_fx.parallel.consensus`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class VocabShard:
    """Which rows of a ``[V, H]`` head this rank holds: rows ``[rank * shard_rows, (rank + 1) * shard_rows)``,
    where ``rank`` is the rank in the process group named ``group_name`` (the one the dense head gathers over)."""

    group_name: str
    world_size: int
    rank: int
    shard_rows: int

    @property
    def vocab_size(self) -> int:
        return self.world_size * self.shard_rows

    @property
    def offset(self) -> int:
        return self.rank * self.shard_rows

    @property
    def group(self) -> dist.ProcessGroup:
        return resolve_group(self.group_name)

    @classmethod
    def of(cls, group_name: str, world_size: int, shard_rows: int) -> "VocabShard":
        group = resolve_group(group_name)
        size = dist.get_world_size(group)
        if size != world_size:
            raise ValueError(f"nanospec: process group {group_name!r} has {size} ranks, the graph gathers {world_size}")
        return cls(group_name, world_size, dist.get_rank(group), shard_rows)


def listed_if_they_differ(values: list, show: Callable[[Any], str] = str, sep: str = "; ") -> str | None:
    """Each rank's value (``"rank 0: a; rank 1: b"``) when the ranks' ``values`` are not all equal, None when they
    are: the evidence every :class:`RanksDiverged` message names."""
    if len({repr(v) for v in values}) <= 1:
        return None
    return sep.join(f"rank {r}: {show(v)}" for r, v in enumerate(values))


def resolve_group(group_name: str) -> dist.ProcessGroup:
    """The process group a functional collective names (``_c10d_functional`` ops take its name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


# The check columns every row fetch carries (see :func:`fetch_checked`): the low 24 bits of the id and of the state's
# digest, each as three 8-bit limbs, their squares, and one flag column. Every sum over up to 24 ranks is an exact
# float32 integer (flags: 2**rank).
ID_LIMBS = 6
CHECK_COLUMNS = 2 * ID_LIMBS + 1


class RanksDiverged(RuntimeError):
    """The ranks of a tensor-parallel group fetched head rows for different token ids: their replicated active sets
    (and so their logits) would differ silently. Raised on every rank together (every rank sees the same sums)."""


def fetch_checked(token_ids: torch.Tensor, shard_weight: torch.Tensor, shard: VocabShard,
                  flag: torch.Tensor | None = None, digest: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The head rows ``[N, H]`` of ``token_ids`` from their owner shards, and a verdict ``[2]`` (int64): whether
    the ranks fetched different ids (or hold different sets: ``digest``, e.g. :func:`state_digest`), and the bit
    mask (``2**rank``) of the ranks whose ``flag`` was set.

    One all-reduce of ``[N, H + 13]``: each rank contributes its own rows (zeros elsewhere, so every sum is one
    owner's row plus exact zeros), and check columns: the three 8-bit limbs ``a`` of the id and of the digest,
    their squares and the flag. Summed over the ``W`` ranks, ``W * sum(a**2) == sum(a)**2`` holds iff every rank
    had the same limb (Cauchy-Schwarz), so every rank reads the same verdict from the same sums: all raise
    together or none does. Half-precision rows travel as float32 (the limbs' sums must be exact); float32/64 rows
    keep their dtype. Ids outside ``[0, V)`` get zero rows. Traceable into an FX graph (plain arguments only;
    ``_c10d_functional`` ops, which also run eagerly).
    """
    local = token_ids - shard.offset
    owned = (local >= 0) & (local < shard.shard_rows)
    rows = shard_weight.index_select(0, torch.clamp(local, 0, shard.shard_rows - 1))
    mine = torch.where(owned.unsqueeze(-1), rows, torch.zeros_like(rows))
    wide = mine + mine.new_zeros(1, dtype=torch.float32)  # float32 at least, no .dtype read (traceable)
    zero = torch.zeros_like(token_ids)
    values = torch.stack([token_ids, zero if digest is None else zero + digest], -1)
    x = torch.bitwise_and(values, 0xFFFFFF)
    limbs = torch.cat([torch.bitwise_and(torch.bitwise_right_shift(x, 8 * k), 255) for k in range(3)], -1)
    mark = zero if flag is None else zero + flag.to(torch.int64) * 2 ** min(shard.rank, 23)
    checks = torch.cat([limbs, limbs * limbs, mark.unsqueeze(-1)], -1).type_as(wide)
    summed = torch.ops._c10d_functional.all_reduce.default(torch.cat([wide, checks], -1), "sum", shard.group_name)
    summed = torch.ops._c10d_functional.wait_tensor.default(summed)
    sums = summed[:, -CHECK_COLUMNS:].double()
    s, q = sums[:, :ID_LIMBS], sums[:, ID_LIMBS:2 * ID_LIMBS]
    diverged = (q * shard.world_size != s * s).any()
    mask = torch.cat([sums[:, -1], sums.new_zeros(1)]).max()  # the same on every row (0 with no row)
    verdict = torch.stack([diverged.to(torch.int64), mask.to(torch.int64)])
    return summed[:, :-CHECK_COLUMNS].type_as(mine), verdict


def state_digest(ids: torch.Tensor, cursor: torch.Tensor) -> torch.Tensor:
    """A cheap summary of a replicated set (its slots' ids and ring cursor), the same on every rank while the
    sets are: a fetch checks it with the ids (a ``reset()`` or another set on one rank only shows there)."""
    return ids.to(torch.int64).sum() * 7 + cursor.to(torch.int64).sum()


def raise_if_diverged(verdict, shard: VocabShard, what: str = "observe") -> None:
    """The same error on every rank when a checked fetch's ``verdict`` (``[diverged, flag mask]``, host values)
    says the ranks diverged: a ``ValueError`` for ids out of range on some ranks, else :class:`RanksDiverged`."""
    diverged, mask = (int(v) for v in verdict)
    if (diverged or mask) and dist.get_backend(resolve_group(shard.group_name)) == "fake":
        return  # a fake group's collectives compute nothing: its sums check nothing
    if mask:
        ranks = [r for r in range(min(shard.world_size, 24)) if mask >> r & 1]
        raise ValueError(
            f"nanospec: token ids outside [0, {shard.vocab_size}) were given to a tensor-parallel {what} on rank(s) "
            f"{ranks} of {shard.world_size} (every rank raises this; no rank changed its active set)")
    if diverged:
        raise RanksDiverged(
            f"nanospec: the ranks of a tensor-parallel group fetched head rows for different token ids in one {what}, "
            "or hold different active sets (each rank must observe the same ids in the same order: the drafter's "
            "inputs, the target's picks, and reset or configure its set when the others do). "
            "Their replicated active sets would differ silently, so every rank raises this; call reset() on every "
            "rank (nanospec_fx.active_vocab(model).reset()) and feed identical ids.")


def fetch_rows(token_ids: torch.Tensor, shard_weight: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The head rows ``[N, H]`` of ``token_ids`` (the same ids on every rank), from their owner shards, eagerly:
    :func:`fetch_checked`, then the same error on every rank if the ranks' ids differ (a host read)."""
    rows, verdict = fetch_checked(token_ids, shard_weight, shard)
    raise_if_diverged(verdict.tolist(), shard, "row fetch")
    return rows


def fetch_bias(token_ids: torch.Tensor, shard_bias: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The bias entries ``[N]`` of ``token_ids`` from their owner shards (as :func:`fetch_rows`)."""
    return fetch_rows(token_ids, shard_bias.unsqueeze(-1), shard).squeeze(-1)


def local_shard(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's rows of a head weight or bias: the tensor itself, or a DTensor's local shard."""
    return tensor.to_local() if tensor is not None and hasattr(tensor, "to_local") else tensor

def agree_on_count(shape: tuple[int, ...], shard: VocabShard, device: torch.device | str = "cpu",
                   what: str = "observe") -> None:
    """Before an eager fetch of the ids ``shape`` (e.g. ``(N,)``; ``(B, n)`` for per-request rows): the same error on
    every rank when the ranks' shapes differ.

    A fetch's all-reduce has one row per id, and gloo aborts the process (nothing to catch) when the ranks'
    sizes differ; one all-gather of ``len(shape)`` ints, the same size on every rank, lets each rank read every
    shape and raise :class:`RanksDiverged` together, with no rank's set changed. (A compiled step's fetch sizes
    are agreed at compile time: the consensus names its observers' shapes.)"""
    group = resolve_group(shard.group_name)
    if dist.get_backend(group) == "fake":  # a fake group's collectives compute nothing
        return
    mine = torch.tensor(shape, dtype=torch.int64, device=device)
    gathered = torch.ops._c10d_functional.wait_tensor.default(torch.ops._c10d_functional.all_gather_into_tensor.default(
        mine, shard.world_size, shard.group_name))
    shapes = [tuple(s) for s in gathered.view(shard.world_size, len(shape)).tolist()]
    if listed := listed_if_they_differ(shapes, show=lambda s: " x ".join(map(str, s)), sep=", "):
        raise RanksDiverged(
            f"nanospec: the ranks of a tensor-parallel group gave different numbers of token ids to one {what} "
            f"({listed}), so their row fetches would differ in size (gloo aborts the process, other backends hang). "
            "Each rank must observe the same ids in the same order; every rank raises this, no rank changed its "
            "active set.")
