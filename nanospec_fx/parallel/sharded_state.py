"""The replicated state of a vocabulary-parallel head: one rank's shard ``[V / tp, H]`` of the head, and an active
set and compact row cache that cover the whole vocabulary and are the same on every rank.

Why the sets stay identical: every rank observes the same ids in the same order (the drafter's inputs are
replicated under tensor parallelism, and ``observe`` is called SPMD), and ``observe`` is deterministic (same ids,
same state -> same slots), so slot order is identical too. Each observe fetches the rows of its ids from their owner
shards with one checked all-reduce (:func:`~nanospec_fx.parallel.collectives.fetch_checked`); what a rank decides alone
before a collective (a refresh) is agreed first (:mod:`nanospec_fx.parallel.consensus`).

Rows are inserted in plain torch (``kernels/`` has no "insert ids with these rows" op): ``nanospec.observe`` does
the slot bookkeeping with a stride-0 zero table as its weight (no ``[V, H]`` memory), then the fetched rows are
written to the slots of the observed ids (:func:`fetch_observed`, :func:`write_observed`). The same two functions
run eagerly here and traced into a compiled graph (``passes/vocab_parallel/observe.py``).
"""
from __future__ import annotations

import functools

import torch

from nanospec_fx.parallel.collectives import (
    RanksDiverged, VocabShard, agree_on_count, fetch_bias, fetch_checked, fetch_rows, listed_if_they_differ,
    local_shard, raise_if_diverged,
    state_digest,
)
from nanospec_fx.parallel.consensus import check_in
from nanospec_fx.kernels import ops
from nanospec_fx.kernels.schema import STATE
from nanospec_fx.kernels.state_lock import holding_state_lock
from nanospec_fx.vocab.request_vocab import RequestVocabs
from nanospec_fx.vocab.state import ActiveVocab, registered_state, state_for
from nanospec_fx.vocab.config import DEFAULT_CAPACITY, DEFAULT_POLICY, StateConfig


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

def fetch_observed(x, weight, bias, shard: VocabShard, ids, cursor, flag=None):
    """The rows ``[N, H]`` (and bias entries ``[N, 1]``, None without a bias) of the head rows ``x`` from their
    owner shards, and the fetches' verdict ``[2]`` (:func:`~nanospec_fx.parallel.collectives.fetch_checked`; the set's
    digest from ``ids``/``cursor`` joins the check). Traceable (plain arguments only)."""
    rows, verdict = fetch_checked(x, weight, shard, flag, state_digest(ids, cursor))
    bias_rows = None
    if bias is not None:
        bias_rows, bias_verdict = fetch_checked(x, bias.unsqueeze(-1), shard)
        verdict = verdict + bias_verdict  # its flag column is 0: only the divergence adds
    return rows, bias_rows, verdict


def write_observed(x, rows, bias_rows, slot_of, cache_w, cache_b, vocab_size: int) -> None:
    """After ``nanospec.observe``'s bookkeeping of ``x``: the fetched rows (and bias entries) into their slots.
    Traceable."""
    write_rows(x, rows, slot_of, cache_w, vocab_size)
    if bias_rows is not None:
        write_rows(x, bias_rows.squeeze(-1), slot_of, cache_b, vocab_size, matrix=False)


class AgreesOnRanks:
    """What a replicated sharded state decides locally before a collective, agreed by every rank of its group.

    * **Ids out of range** (``observe(..., validate=True)``): not raised before the fetch on the rank that got them
      (the others would then wait in theirs), but flagged in the fetch's check column: every rank raises the same
      ``ValueError`` and no rank changes its set.
    * **Stale rows** (the head shard written in place): every rank refreshes together when every rank's shard was
      written (a ``[C, H]`` all-reduce on one rank alone would meet another rank's per-step fetch: a hang, or gloo
      aborting on the sizes); when only some were, every rank raises :class:`RanksDiverged` naming them.
    * **The step and the head** (:meth:`check_in`, before every collective and every compiled step): ranks at another
      step, whose head shards differ in dtype or shape, or whose sets were reset a different number of times, all
      raise :class:`RanksDiverged`, before any collective.
    """

    shard: VocabShard
    _invalid = False
    observes_meet_the_ranks = True
    _step: str | None = None  # the eager call under way ("observe"); None: a compiled draft step
    _since_reset = 0  # check-ins passed since this rank last emptied its set: equal on every rank while the sets are

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
        """Check in with every rank (:meth:`check_in`, at the step under way), then refresh if every rank's head
        shard was written since. Returns whether it refreshed."""
        return self.check_in(self._step or "compiled draft step")

    def check_in(self, step: str) -> bool:
        """Meet every rank of the group in its store before a collective
        (:func:`~nanospec_fx.parallel.consensus.check_in`)
        and compare what each holds: the step, its head shard's dtype and shape (a fetch of other sizes aborts gloo),
        how many steps since its set was reset, and whether its shard was written since the rows were cached. The same
        :class:`RanksDiverged` on every rank where they differ; every rank refreshes together when every shard was
        written. Returns whether it refreshed."""
        versions = self._weight_versions()
        stale = versions is not None and versions != self._seen_versions
        head = [(str(t.dtype), list(t.shape)) if t is not None else None
                for t in (local_shard(self.weight), local_shard(self.bias))]
        records = check_in(self.shard.group_name, step, {"head": head, "since_reset": self._since_reset,
                                                          "stale": stale})
        if listed := listed_if_they_differ([r["head"] for r in records]):
            raise RanksDiverged(
                f"nanospec: the ranks of a tensor-parallel group hold head shards of different dtypes or shapes "
                f"(weight, bias) at {step} ({listed}): their row fetches would differ in size (gloo aborts the "
                "process) and their rows in value. Every rank must hold the same head layout; every rank raises "
                "this before any collective.")
        # stays so (no rank counts on) until every rank resets between the same steps
        if listed := listed_if_they_differ([r["since_reset"] for r in records]):
            raise RanksDiverged(
                f"nanospec: the replicated active sets of a tensor-parallel group differ at {step}: the ranks last "
                f"reset them at different steps (steps since: {listed}; a reset() or request() on some ranks only). "
                "Call reset() on every rank (nanospec_fx.active_vocab(model).reset()); every rank raises this "
                "until then.")
        self._since_reset += 1
        written = [i for i, r in enumerate(records) if r["stale"]]
        if written and len(written) < len(records):
            raise RanksDiverged(
                f"nanospec: the head shard was written in place on rank(s) {written} only (an in-place write, "
                f"load_state_dict, an optimizer step) at {step}: the replicated rows of the other ranks would stay "
                "stale. Change the head on every rank together; every rank raises this, no rank refreshed.")
        if written:
            self._fetch_all_rows()
        return bool(written)

    def refresh(self) -> None:
        """Re-copy every cached row from its owner shard (a ``[C, H]`` all-reduce: call it on every rank), after a
        check-in (:meth:`check_in`)."""
        if not self.check_in("refresh"):
            self._fetch_all_rows()


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

    def observe(self, token_ids, validate: bool = True) -> None:
        self._step = "observe"  # the check-in before its fetch names the step
        try:
            super().observe(token_ids, validate)
        finally:
            self._step = None

    @holding_state_lock
    def reset(self) -> None:
        self.fetch_check.zero_()
        self._since_reset = 0
        super().reset()

    def _seed(self) -> None:
        if self.seed_ids is not None and hasattr(self, "fetch_check"):
            self.check_in("seed the set")  # seeding fetches rows: a collective like any observe
        super()._seed()

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
        id out of range on any rank, every rank raises with its set unchanged (ranks with different numbers of
        ids too: :func:`~nanospec_fx.parallel.collectives.agree_on_count` first, as their fetches would differ in
        size)."""
        flag = self._take_invalid()
        with torch.no_grad():
            x = self.rows_of(token_ids).reshape(-1).to(torch.int64)
            agree_on_count((x.numel(),), self.shard, self.cache_w.device)
            rows, bias_rows, verdict = fetch_observed(x, local_shard(self.weight), local_shard(self.bias), self.shard,
                                                      self.ids, self.cursor, flag)
            raise_if_diverged(verdict.tolist(), self.shard)
            ops.observe(token_ids=x, weight=self.zero_rows, bias=self.zero_bias, **dict(zip(STATE, self.tensors())),
                        num_pinned=self.num_pinned)
            write_observed(x, rows, bias_rows, self.slot_of, self.cache_w, self.cache_b, self.shard.vocab_size)

    @holding_state_lock
    def _fetch_all_rows(self) -> None:
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
    """Per-request active vocabularies (:class:`~nanospec_fx.vocab.request_vocab.RequestVocabs`) of one rank's shard of
    a vocabulary-parallel head: every request row covers the whole vocabulary and holds *all* its active rows, the
    same on every rank (the replicated compact row cache, one row per request), so ``logits`` computes the full
    ``[..., V]`` locally with no logits collective.

    ``weight`` is this rank's ``[shard_rows, H]`` shard (rows ``[rank * shard_rows, ...)`` of the head, the last
    shards possibly padded past the vocabulary); ``rows`` (default: every shard row) is the head's real number
    of rows, the last dim of the logits (``vocab_size`` is the token-id space, as on every state). Each observe
    fetches the rows of its ids from their owner shards (one ``[N, H]`` all-reduce, :func:`fetch_rows`). ``assign``
    (it seeds), ``observe*`` and ``refresh`` run a collective: call them on every rank of the group with the same
    ids, in the same order (SPMD). No head bias.
    Memory per rank: ``max_requests * capacity * H`` (the cache is replicated, not split) plus the slot maps.
    """

    def __init__(self, weight: torch.Tensor, max_requests: int = 8, capacity: int = DEFAULT_CAPACITY,
                 num_pinned: int = 0, *, shard: VocabShard, rows: int | None = None, seed_ids=None,
                 observes: bool = True, policy: str = DEFAULT_POLICY, token_to_row: torch.Tensor | None = None):
        if weight.dim() != 2 or weight.shape[0] != shard.shard_rows:
            raise ValueError(f"nanospec: this rank's head shard should have {shard.shard_rows} rows, got "
                             f"{tuple(weight.shape)}")
        rows = shard.vocab_size if rows is None else rows
        if not 0 < rows <= shard.vocab_size:
            raise ValueError(f"nanospec: {rows} head rows do not fit {shard.world_size} shards of "
                             f"{shard.shard_rows} (the last ones padded)")
        self.shard, self.sharded_rows = shard, rows
        with torch.no_grad(), torch.inference_mode(False):  # stride 0: no [V, H] memory
            self.zero_rows = weight.new_zeros(1, weight.shape[1]).expand(rows, -1)
        super().__init__(weight, None, max_requests, capacity, num_pinned, seed_ids=seed_ids, observes=observes,
                         policy=policy, token_to_row=token_to_row)

    def _head_rows(self, weight: torch.Tensor) -> int:
        return self.sharded_rows

    @holding_state_lock
    def _observe(self, rows: torch.Tensor, tokens: torch.Tensor, seeding: bool = False) -> None:
        if not (self.observes or seeding):
            return
        self.check_in("seed a request row" if seeding else "observe")
        flag = self._take_invalid()
        with torch.no_grad():
            head_rows = self._rows_of_tokens(tokens).reshape(tokens.shape)
            # the rows first (a checked all-reduce; the request rows join the check), then the bookkeeping: on a
            # divergence every rank raises with its sets unchanged
            checked = torch.cat([head_rows.reshape(-1), rows.reshape(-1).to(head_rows.dtype)])
            agree_on_count(tuple(head_rows.shape), self.shard, self.cache_w.device)
            fetched, verdict = fetch_checked(checked, self.weight.detach(), self.shard, flag,
                                             state_digest(self.ids, self.cursor))
            raise_if_diverged(verdict.tolist(), self.shard)
            if head_rows.numel():  # an empty batch took part in the collectives only
                fetched = fetched[:head_rows.numel()]
                ops.observe(token_ids=head_rows, weight=self.zero_rows, bias=None,
                            **dict(zip(STATE, self.tensors())), num_pinned=self.num_pinned, rows=rows)
                write_request_rows(rows, head_rows, fetched, self.slot_of, self.cache_w)

    @holding_state_lock
    def _fetch_all_rows(self) -> None:
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

