"""The active vocabulary of a vocabulary-parallel (tensor-parallel) LM head: a replicated compact row cache.

A vocabulary-parallel head holds ``V / tp`` rows of the head on each rank; the dense drafter computes its slice
of the logits and all-gathers ``[..., V]`` at every draft step. Here every rank keeps the *same* active set and
*all* active rows: when tokens become active, their rows are fetched from their owner shards with one small
collective (an all-reduce of ``[N, H]`` for the ``N`` ids of that observe, zeros from every rank but the owner,
so the sum is the owner's row, bit for bit), and the draft head then computes the whole compact head locally
on every rank, with **no logits collective**.

Why the sets stay identical: every rank observes the same ids in the same order (the drafter's inputs are
replicated under tensor parallelism, and ``state.observe`` is called SPMD), and ``observe`` is deterministic
(same ids, same state -> same slots), so slot order is identical too (tested across two gloo processes).
Nothing forces it, so it is checked where it is cheap: every row fetch carries check columns of its ids and of a
digest of the set in its own all-reduce, and every rank raises the same error when they differ
(:func:`fetch_checked`); what a rank decides alone before a collective (a compile, a refresh) is agreed through the
group's store with a timeout (:func:`store_exchange`), so a rank left alone ends in a clear error, not a hang.

Rows are inserted at the state level in plain torch (``kernels/`` has no "insert ids with these rows" op):
``nanospec.observe`` does the slot bookkeeping with a stride-0 zero table as its weight (no ``[V, H]``
memory), then the fetched rows are written to the slots of the observed ids (:func:`observe_shard`). The
same function runs eagerly (``ActiveVocab.observe``) and is traced into the compiled graph.
"""
from __future__ import annotations

import datetime
import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx

from nanospec_fx.kernels import ops  # noqa: F401 - registers torch.ops.nanospec
from nanospec_fx.kernels import ops_per_request
from nanospec_fx.request_vocab import RequestVocabs
from nanospec_fx.state import STATE_TENSORS, ActiveVocab, registered_state, state_for
from nanospec_fx.vocab_config import DEFAULT_CAPACITY, DEFAULT_POLICY, StateConfig


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


def write_rows(token_ids: torch.Tensor, rows: torch.Tensor, slot_of: torch.Tensor, cache: torch.Tensor,
               vocab_size: int, matrix: bool = True) -> None:
    """``cache[slot_of[id]] = row`` for every active id of ``token_ids``, with fixed shapes and no host sync
    (see :func:`write_slots`). ``matrix``: rows are ``[N, H]`` (weights), else ``[N]`` (a bias).
    Plain arguments only (no ``.dim()``, ``.dtype``), so that it traces into an FX graph.
    """
    ok = (token_ids >= 0) & (token_ids < vocab_size)
    slot = slot_of[torch.clamp(token_ids, 0, vocab_size - 1)].to(torch.int64)
    write_slots(slot, ok, rows, cache, matrix)


def write_slots(slot: torch.Tensor, ok: torch.Tensor, rows: torch.Tensor, cache: torch.Tensor,
                matrix: bool = True) -> None:
    """``cache[slot[i]] = rows[i]`` where ``ok[i]`` and ``slot[i] >= 0``, with fixed shapes and no host sync.

    Entries that are not active (out of range, or dropped by a call bringing more new ids than the ring holds)
    write to the slot of the first active entry, with that entry's row, so every duplicate write of a slot carries
    the same value (``index_copy_`` with repeated indices is then deterministic). With no active entry at all,
    slot 0 is written with its own value.
    """
    active = ok & (slot >= 0)
    first = torch.argmax(active.to(torch.int32)).reshape(1)  # index_select, not rows[first]: no .item() when traced
    some = torch.any(active)
    spare_slot = torch.where(some, slot.index_select(0, first), torch.zeros_like(first))
    rows = rows.type_as(cache)
    spare_row = torch.where(some, rows.index_select(0, first), cache[:1])
    target = torch.where(active, slot, spare_slot)
    value = torch.where(active.unsqueeze(-1) if matrix else active, rows, spare_row)
    cache.index_copy_(0, target, value)


def observe_shard(token_ids, shard_weight, shard_bias, zero_rows, zero_bias, check, ids, slot_of, cursor, cache_w,
                  cache_b, num_pinned: int, shard: VocabShard) -> None:
    """``nanospec.observe`` for a vocabulary-parallel head, traced into a compiled graph: the rows of the observed
    ids from their owners (one checked ``[N, H]`` all-reduce, another ``[N]`` one with a bias), then the slot
    bookkeeping (identical on every rank) and the rows written to their slots. The fetches' verdicts are added
    to ``check`` (``[2]``, int64), which the call reads after the graph ran (it cannot raise inside it)."""
    x = token_ids.reshape(-1).to(torch.int64)
    rows, verdict = fetch_checked(x, shard_weight, shard, digest=state_digest(ids, cursor))
    if shard_bias is not None:
        bias_rows, bias_verdict = fetch_checked(x, shard_bias.unsqueeze(-1), shard)
        verdict = verdict + bias_verdict
    torch.ops.nanospec.observe.default(x, zero_rows, zero_bias, ids, slot_of, cursor, cache_w, cache_b, num_pinned)
    write_rows(x, rows, slot_of, cache_w, shard.vocab_size)
    if shard_bias is not None:
        write_rows(x, bias_rows.squeeze(-1), slot_of, cache_b, shard.vocab_size, matrix=False)
    check.add_(verdict)


def local_shard(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's rows of a head weight or bias: the tensor itself, or a DTensor's local shard."""
    return tensor.to_local() if tensor is not None and hasattr(tensor, "to_local") else tensor


class AgreesOnRanks:
    """What a replicated sharded state decides locally before a collective, agreed by every rank of its group.

    * **Ids out of range** (``observe(..., validate=True)``): not raised before the fetch on the rank that got them
      (the others would then wait in theirs), but flagged in the fetch's check column: every rank raises the same
      ``ValueError`` and no rank changes its set.
    * **Stale rows** (the head shard written in place): a rank that sees it refreshes only after every rank said
      so through the group's store (a ``[C, H]`` all-reduce on one rank alone would meet another rank's per-step
      fetch: a hang, or gloo aborting on the sizes). A rank whose shard alone changed gets a clear error after the
      store's timeout.
    """

    shard: VocabShard
    _invalid = False

    def _check_range(self, tokens: torch.Tensor) -> None:
        try:
            super()._check_range(tokens)
        except ValueError:
            # seeds checked while building, or a frozen set: no collective follows, raise here
            if not hasattr(self, "_seen_versions") or not self.observes:
                raise
            self._invalid = True

    def _take_invalid(self) -> torch.Tensor:
        invalid, self._invalid = self._invalid, False
        return torch.tensor(int(invalid))

    def refresh_if_stale(self) -> bool:
        versions = self._weight_versions()
        if versions is None or versions == self._seen_versions:
            return False
        store_exchange(self.shard.group_name, "refresh", "stale", what=(
            "a refresh of the replicated head rows: the head shard was written in place on this rank (an in-place "
            "write, load_state_dict, an optimizer step). Change the head on every rank together"))
        self.refresh()
        return True


class ShardedActiveVocab(AgreesOnRanks, ActiveVocab):
    """The ActiveVocab of one rank's shard ``[V / tp, H]`` of a vocabulary-parallel head: the set and the cache
    cover the whole vocabulary (``slot_of[V]``, ``cache_w[C, H]`` holding rows of every shard) and are the same
    on every rank. ``observe``, ``reset`` and ``refresh`` must be called on every rank of the group, with the same
    ids (SPMD, as the drafter itself runs): ``observe`` and ``refresh`` run a collective.
    With a draft vocabulary (``draft_to_target``) the head's R rows are sharded and ids are mapped to rows first.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, capacity: int = DEFAULT_CAPACITY,
                 num_pinned: int = 0, *, shard: VocabShard, seed_ids: torch.Tensor | None = None, observes: bool = True,
                 policy: str = DEFAULT_POLICY, token_to_row: torch.Tensor | None = None):
        local = local_shard(weight)  # ``weight`` itself (a DTensor head's is the state's key, like any weight)
        if local.dim() != 2 or local.shape[0] != shard.shard_rows:
            raise ValueError(f"nanospec: this rank's head shard should have {shard.shard_rows} rows, got "
                             f"{tuple(local.shape)}")
        self.shard = shard
        with torch.no_grad(), torch.inference_mode(False):  # stride 0: no [V, H] memory
            self.zero_rows = local.new_zeros(1, local.shape[1]).expand(shard.vocab_size, -1)
            self.zero_bias = local_shard(bias).new_zeros(1).expand(shard.vocab_size) if bias is not None else None
            # what the compiled graph's checked fetches found (see observe_shard); sticky until reset()
            self.fetch_check = torch.zeros(2, dtype=torch.int64, device=local.device)
        super().__init__(weight, bias, capacity, num_pinned, seed_ids=seed_ids, observes=observes, policy=policy,
                         token_to_row=token_to_row)

    def _head_rows(self, weight: torch.Tensor) -> int:
        return self.shard.vocab_size

    def _fresh_factory(self):
        return functools.partial(ShardedActiveVocab, shard=self.shard)

    def graph_inputs(self) -> list[torch.Tensor]:
        """The zero tables a compiled graph's observers pass to ``nanospec.observe`` (after the state tensors),
        then the verdicts of their checked fetches (``fetch_check``)."""
        return [self.zero_rows] + ([self.zero_bias] if self.zero_bias is not None else []) + [self.fetch_check]

    def graph_input_names(self) -> list[str]:
        return ["zero_rows"] + (["zero_bias"] if self.zero_bias is not None else []) + ["fetch_check"]

    def raise_if_diverged(self) -> None:
        """After a compiled call: the same error on every rank if its fetches found the ranks' ids different
        (a host read of two ints). Sticky: the sets differ until ``reset()`` on every rank."""
        raise_if_diverged(self.fetch_check.tolist(), self.shard, "compiled draft step")

    def reset(self) -> None:
        self.fetch_check.zero_()
        super().reset()

    def fits(self, weight: torch.Tensor) -> bool:
        local = local_shard(weight)
        return (tuple(local.shape) == (self.shard.shard_rows, self.hidden_size) and local.dtype == self.cache_w.dtype
                and local.device == self.cache_w.device)

    def bias_fits(self, bias: torch.Tensor | None) -> bool:
        if bias is None or self.bias is None:
            return bias is None and self.bias is None
        local, mine = local_shard(bias), local_shard(self.bias)
        return (tuple(local.shape) == (self.shard.shard_rows,) and local.dtype == mine.dtype
                and local.device == mine.device)

    def _weight_versions(self) -> tuple | None:
        try:
            return tuple((t._version, t.data_ptr()) if t is not None else None
                         for t in (local_shard(self.weight), local_shard(self.bias)))
        except RuntimeError:
            return None

    def _insert(self, token_ids: torch.Tensor) -> None:
        """The rows first (one checked all-reduce, plus one for a bias), then the bookkeeping: on a divergence or an
        id out of range on any rank, every rank raises with its set unchanged."""
        flag = self._take_invalid()
        with torch.no_grad():
            x = self.rows_of(token_ids).reshape(-1).to(torch.int64)
            rows, verdict = fetch_checked(x, local_shard(self.weight), self.shard, flag,
                                          state_digest(self.ids, self.cursor))
            if self.bias is not None:
                bias_rows, bias_verdict = fetch_checked(x, local_shard(self.bias).unsqueeze(-1), self.shard)
                verdict[0] += bias_verdict[0]
            raise_if_diverged(verdict.tolist(), self.shard)
            torch.ops.nanospec.observe.default(x, self.zero_rows, self.zero_bias, *self.tensors(), self.num_pinned)
            write_rows(x, rows, self.slot_of, self.cache_w, self.shard.vocab_size)
            if self.bias is not None:
                write_rows(x, bias_rows.squeeze(-1), self.slot_of, self.cache_b, self.shard.vocab_size, matrix=False)

    def refresh(self) -> None:
        """Re-copy the rows of every slot from their owner shards (one ``[C, H]`` all-reduce: on every rank)."""
        with torch.no_grad(), torch.inference_mode(False):
            rows = torch.clamp(self.ids, min=0)
            self.cache_w.copy_(fetch_rows(rows, local_shard(self.weight.detach()), self.shard))
            if self.bias is not None:
                self.cache_b.copy_(fetch_bias(rows, local_shard(self.bias.detach()), self.shard))
        self._seen_versions = self._weight_versions()

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", shard={self.shard.rank}/{self.shard.world_size})"


class ShardedRequestVocabs(AgreesOnRanks, RequestVocabs):
    """Per-request active vocabularies (:class:`~nanospec_fx.request_vocab.RequestVocabs`) of one rank's shard of
    a vocabulary-parallel head: every request row covers the whole vocabulary and holds *all* its active rows, the
    same on every rank (the replicated compact row cache, one row per request), so ``logits`` computes the full
    ``[..., V]`` locally with no logits collective.

    ``weight`` is this rank's ``[shard_rows, H]`` shard (rows ``[rank * shard_rows, ...)`` of the head, the last
    shards possibly padded past the vocabulary); ``vocab_size`` (default: every shard row) is the head's real number
    of rows, the last dim of the logits. Each observe fetches the rows of its ids from their owner shards (one
    ``[N, H]`` all-reduce, :func:`fetch_rows`). ``assign`` (it seeds), ``observe*`` and ``refresh`` run a
    collective: call them on every rank of the group with the same ids, in the same order (SPMD). No head bias.
    Memory per rank: ``max_requests * capacity * H`` (the cache is replicated, not split) plus the slot maps.
    """

    def __init__(self, weight: torch.Tensor, max_requests: int = 8, capacity: int = DEFAULT_CAPACITY,
                 num_pinned: int = 0, *, shard: VocabShard, vocab_size: int | None = None, seed_ids=None,
                 observes: bool = True, policy: str = DEFAULT_POLICY, token_to_row: torch.Tensor | None = None):
        if weight.dim() != 2 or weight.shape[0] != shard.shard_rows:
            raise ValueError(f"nanospec: this rank's head shard should have {shard.shard_rows} rows, got "
                             f"{tuple(weight.shape)}")
        vocab_size = shard.vocab_size if vocab_size is None else vocab_size
        if not 0 < vocab_size <= shard.vocab_size:
            raise ValueError(f"nanospec: {vocab_size} head rows do not fit {shard.world_size} shards of "
                             f"{shard.shard_rows} (the last ones padded)")
        self.shard, self.sharded_rows = shard, vocab_size
        with torch.no_grad(), torch.inference_mode(False):  # stride 0: no [V, H] memory
            self.zero_rows = weight.new_zeros(1, weight.shape[1]).expand(vocab_size, -1)
        super().__init__(weight, None, max_requests, capacity, num_pinned, seed_ids=seed_ids, observes=observes,
                         policy=policy, token_to_row=token_to_row)

    def _head_rows(self, weight: torch.Tensor) -> int:
        return self.sharded_rows

    def _observe(self, rows: torch.Tensor, tokens: torch.Tensor, seeding: bool = False) -> None:
        if not (self.observes or seeding):
            return
        self.refresh_if_stale()
        flag = self._take_invalid()
        with torch.no_grad():
            head_rows = self._rows_of_tokens(tokens).reshape(rows.numel(), -1)
            # the rows first (a checked all-reduce; the request rows join the check), then the bookkeeping: on a
            # divergence every rank raises with its sets unchanged
            checked = torch.cat([head_rows.reshape(-1), rows.reshape(-1).to(head_rows.dtype)])
            fetched, verdict = fetch_checked(checked, self.weight.detach(), self.shard, flag,
                                             state_digest(self.ids, self.cursor))
            raise_if_diverged(verdict.tolist(), self.shard)
            fetched = fetched[:head_rows.numel()]
            ops_per_request.observe_per_request(head_rows, rows, self.zero_rows, None, *self.tensors(),
                                                self.num_pinned)
            write_request_rows(rows, head_rows, fetched, self.slot_of, self.cache_w)

    def refresh(self) -> None:
        """Re-copy every cached row from the owner shards (one ``[C, H]`` all-reduce per request row: on every
        rank)."""
        with torch.no_grad(), torch.inference_mode(False):
            for row in range(self.max_requests):
                ids = torch.clamp(self.ids[row], min=0)
                self.cache_w[row].copy_(fetch_rows(ids, self.weight.detach(), self.shard))
        self._seen_versions = self._weight_versions()

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", shard={self.shard.rank}/{self.shard.world_size})"


def write_request_rows(rows: torch.Tensor, head_rows: torch.Tensor, fetched: torch.Tensor, slot_of: torch.Tensor,
                       cache_w: torch.Tensor) -> None:
    """``cache_w[r, slot_of[r, t]] = row`` for each head row ``t`` of ``head_rows[b]`` (``[B, n]``, -1: padding)
    that request row ``r = rows[b]`` holds after its observe; ``fetched`` holds their rows ``[B * n, H]``."""
    requests, capacity = cache_w.shape[:2]
    vocab_size = slot_of.shape[1]
    t = head_rows.reshape(-1)
    r = rows.reshape(-1, 1).expand(-1, head_rows.shape[1]).reshape(-1)
    ok = (t >= 0) & (t < vocab_size)
    slot = slot_of[r, torch.clamp(t, 0, vocab_size - 1)].to(torch.int64)
    flat = torch.where(slot >= 0, r * capacity + slot, slot)
    write_slots(flat, ok, fetched, cache_w.view(requests * capacity, -1))


def sharded_state_for(weight: torch.Tensor, bias: torch.Tensor | None, config: StateConfig, shard: VocabShard, *,
                      name: str | None = None) -> ShardedActiveVocab:
    """The replicated active vocabulary of this rank's head shard (one per shard weight, as ``state_for``)."""
    existing = registered_state(weight)
    if existing is not None and not (isinstance(existing, ShardedActiveVocab) and existing.shard == shard):
        raise ValueError(f"nanospec: the head shard {name or tuple(weight.shape)} already has an active vocabulary "
                         f"that is not this vocabulary-parallel one ({existing!r}); drop it first "
                         "(torch._dynamo.reset() and a fresh model)")

    return state_for(weight, bias, config, name=name, factory=functools.partial(ShardedActiveVocab, shard=shard))


def shard_observers(graph: fx.Graph, into, zero: list[fx.Node], shard: VocabShard) -> int:
    """Turn every ``nanospec.observe`` of ``into``'s state in ``graph`` into :func:`observe_shard`, traced in
    place (its collective becomes ``_c10d_functional`` nodes of the graph). ``zero``: the graph inputs of
    ``state.graph_inputs()``. Returns how many; ``into.observer_shapes`` lists their ids' shapes (each fetch's
    all-reduce has that many rows: the ranks agree on them)."""
    from nanospec_fx.kernels.schema import is_op, op_arg
    from nanospec_fx.passes.patterns import example_value as patterns_value
    from nanospec_fx.passes.rewrite_head import set_example_value

    tracer = fx.proxy.GraphAppendingTracer(graph)

    def proxy(node):
        return fx.Proxy(node, tracer) if isinstance(node, fx.Node) else node

    zero_rows, zero_bias, check = zero[0], zero[1] if len(zero) > 2 else None, zero[-1]
    s = into.state
    observers = [n for n in graph.nodes if is_op(n, "observe") and op_arg(n, "cursor") is s.cursor]
    order = {n: i for i, n in enumerate(graph.nodes)}
    for shard_of in (into.weight, into.bias):  # a DTensor head's ``W.to_local()``: computed before the first observer
        if (shard_of is not None and shard_of.op != "placeholder" and observers
                and order[shard_of] > order[observers[0]]):
            observers[0].prepend(shard_of)
    into.observer_shapes = [str(tuple(getattr(patterns_value(op_arg(n, "token_ids")), "shape", ())))
                            for n in observers]
    for node in observers:
        before = set(graph.nodes)
        with graph.inserting_before(node):
            observe_shard(proxy(op_arg(node, "token_ids")), proxy(into.weight), proxy(into.bias), proxy(zero_rows),
                          proxy(zero_bias), proxy(check), *(proxy(getattr(s, f)) for f in STATE_TENSORS), into.num_pinned, shard)
        for new in graph.nodes:
            if new not in before:
                if is_op(new, "observe"):
                    new.meta["val"] = new.meta["example_value"] = None
                else:
                    set_example_value(new)
        graph.erase_node(node)
    return len(observers)


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
