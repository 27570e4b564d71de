"""RequestVocabs: one active vocabulary per request, for one LM head, in one set of device tensors.

A serving engine batches many requests; NanoSpec's set is per request (its prompt, its accepted tokens, the
target's top-k at its positions). Each request gets a *row* of the state - its own slot table, membership map,
cursor and cache of head rows (``[R, C, H]``) - and every head call takes ``rows``, the request row of each
batch row, so each row is computed against its own request's set. Why gathered rows per request and not one
union of the sets with a mask per row: docs/per-request.md (measured).

It is plain eager code on top of the nanospec custom ops with their ``rows`` argument: usable where no
``torch.compile`` graph is seen (vLLM calls a drafter's ``compute_logits`` eagerly). Rows are assigned and
released on the host (cheap Python bookkeeping); observe and the head never sync with the device. The shared set of
:class:`~nanospec_fx.ActiveVocab` (one set for the batch, the ``torch.compile`` path) is unchanged.

Padding rows: a batch row whose ``rows`` entry lies outside ``[0, max_requests)`` (engines pad batches with -1)
reads as an empty set and writes nothing, on every kernel path: all -inf logits, top-k padding (head rows 0..k-1,
value -inf), argmax 0, nothing observed. It never reads another request's set (docs/per-request.md).
"""
from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch

from nanospec_fx.kernels import ops
from nanospec_fx.kernels.schema import STATE, new_request_state
from nanospec_fx.kernels.state_lock import holding_state_lock
from nanospec_fx.vocab.policies import resolve, token_to_row
from nanospec_fx.vocab.state import VocabState, as_token_ids, check_token_range, in_range_or_nothing
from nanospec_fx.vocab.config import DEFAULT_CAPACITY, DEFAULT_POLICY, StateConfig, VocabConfig


def token_to_row_from_d2t(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """EAGLE-3's ``d2t`` offsets (target id = draft id + d2t[draft id]) as a token -> head-row map [vocab_size]."""
    d2t = torch.as_tensor(d2t, dtype=torch.int64).flatten().cpu()
    return token_to_row(torch.arange(d2t.numel()) + d2t, vocab_size)


class RequestVocabs(VocabState):
    """Per-request active vocabularies of one head: ``max_requests`` rows of ``capacity`` slots each.

    ``RequestVocabs(weight, bias=None, max_requests=8, capacity=3072)``; give the arguments after the weight by
    name (``RequestVocabs(lm_head.weight, max_requests=8, capacity=3072)``): the second positional one is the bias.

    Args:
        weight, bias: the head's [R_head, H] weight and optional [R_head] bias (held; rows are copied into the cache).
        max_requests: request rows, allocated up front (memory: ``max_requests * capacity * H`` elements of the
            weight's dtype, plus ``max_requests * V`` int32 for the membership maps).
        capacity: active tokens per request (clamped to R_head); full: the request's oldest insertion is evicted.
        num_pinned: per request, the first slots filled are never evicted.
        seed_ids: token ids every request holds after :meth:`assign` and :meth:`reset`.
        observes: ``False`` freezes every set after seeding (the ``static`` policy; one shared
            :class:`~nanospec_fx.ActiveVocab` serves that case with one copy instead of one per request).
        policy: the policy's name, for display (:meth:`from_config` sets it).
        token_to_row: int64 [V]: token id -> head row, -1 where the head has none (EAGLE-3, see
            :func:`token_to_row_from_d2t`). Observed ids are token ids; logits, top-k and argmax are over head rows.
    """

    #: Whether every observe is a collective every rank of a group must make (a sharded set): then an empty batch
    #: still calls it, so a rank with nothing to observe meets the others instead of leaving them waiting.
    observes_meet_the_ranks = False

    SIGNATURE = (f"RequestVocabs(weight, bias=None, max_requests=8, capacity={DEFAULT_CAPACITY}); "
                 f"e.g. RequestVocabs(weight, max_requests=8, capacity={DEFAULT_CAPACITY})")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        max_requests: int = 8,
        capacity: int = DEFAULT_CAPACITY,
        num_pinned: int = 0,
        *,
        seed_ids: Any = None,
        observes: bool = True,
        policy: str = DEFAULT_POLICY,
        token_to_row: torch.Tensor | None = None,
    ):
        head_rows, hidden, capacity = self._check_arguments(weight, bias, capacity, num_pinned,
                                                            max_requests=max_requests)
        self.weight, self.bias = weight, bias
        self.max_requests, self.capacity, self.num_pinned, self.hidden_size = max_requests, capacity, num_pinned, hidden
        self.rows = head_rows  # the last dim of logits: head rows (= token ids without a token map)
        self.device = weight.device
        self.observes, self.policy = observes, policy
        self.vocab_size = self._set_token_map(token_to_row, head_rows, self.device)  # the token-id space
        with torch.no_grad(), torch.inference_mode(False):
            state = new_request_state(max_requests, head_rows, hidden, capacity, weight.dtype, self.device)
            if bias is not None:
                state[STATE.index("cache_b")] = state[STATE.index("cache_b")].to(bias.dtype)
        self.ids, self.slot_of, self.cursor, self.cache_w, self.cache_b = state
        self.seed_ids = None
        if seed_ids is not None:
            seed = as_token_ids(seed_ids).flatten().to(self.device)
            self._check_seed(seed)
            self.seed_ids = seed
        self._row_of: dict[Hashable, int] = {}
        self._free = list(range(max_requests))
        self.head_calls = 0  # head evaluations (logits, compact_logits, topk, argmax): proves the path is taken
        self._seen_versions = self._weight_versions()

    @classmethod
    def from_config(cls, weight: torch.Tensor, bias: torch.Tensor | None, config: VocabConfig | StateConfig,
                    max_requests: int = 8) -> "RequestVocabs":
        """Built from the vocabulary options the backend takes (``VocabConfig``: capacity, num_pinned, policy with
        its frequencies, draft_to_target...), so a server and ``torch.compile`` users spell them alike."""
        state = resolve(config) if isinstance(config, VocabConfig) else config
        return cls(weight, bias, max_requests, **state.keywords())

    # ----------------------------------------------------------------- request rows (host bookkeeping)
    @holding_state_lock
    def assign(self, request_id: Hashable) -> int:
        """The row of ``request_id``: its current one, or a free row emptied and seeded. ``RuntimeError`` when
        every row is taken (see :attr:`free_rows`)."""
        if request_id in self._row_of:
            return self._row_of[request_id]
        if not self._free:
            raise RuntimeError(
                f"nanospec: all {self.max_requests} request rows are assigned; release finished requests, or build "
                "RequestVocabs with a larger max_requests (or compute this request's logits with the dense head)")
        row = self._free.pop(0)
        self._row_of[request_id] = row
        self._reset_row(row)
        return row

    @holding_state_lock
    def release(self, request_id: Hashable) -> None:
        """Empty the row of ``request_id`` and free it (the request finished or was preempted). Unknown: no-op."""
        row = self._row_of.pop(request_id, None)
        if row is None:
            return
        self._clear_row(row)
        self._free.append(row)
        self._free.sort()

    @holding_state_lock
    def reset(self, request_id: Hashable) -> None:
        """Empty and re-seed the set of ``request_id``, keeping its row."""
        self._reset_row(self.row_of(request_id))

    def row_of(self, request_id: Hashable) -> int:
        """The row assigned to ``request_id`` (``KeyError`` if none)."""
        try:
            return self._row_of[request_id]
        except KeyError:
            raise KeyError(f"nanospec: request {request_id!r} has no row; call assign({request_id!r}) first") from None

    def rows_for(self, request_ids: Sequence[Hashable]) -> torch.Tensor:
        """int64 [B] on the head's device: the row of each request id (repeats allowed)."""
        rows = torch.tensor([self.row_of(r) for r in request_ids], dtype=torch.int64)
        return rows.to(self.device, non_blocking=True)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._row_of

    @property
    def request_ids(self) -> list:
        """The request ids that hold a row."""
        return list(self._row_of)

    @property
    def free_rows(self) -> int:
        """How many more requests :meth:`assign` can take."""
        return len(self._free)

    # ----------------------------------------------------------------- observe
    def observe(self, request_id: Hashable, token_ids: Any, validate: bool = True) -> None:
        """Add token ids (int, list, tensor, numpy; any shape) to the set of ``request_id``.

        ``validate`` raises ``ValueError`` for ids outside [0, V) on a CPU state (read on the host); on another device
        it checks them there, no host sync, and a call holding one observes nothing; ``validate=False`` skips them.
        Tokens without a head row (``token_to_row`` -1) are skipped. A frozen set (``observes=False``, the
        ``static`` policy) ignores the call."""
        tokens = as_token_ids(token_ids).to(self.device).reshape(1, -1)
        if validate and tokens.device.type != "cpu" and not self.observes_meet_the_ranks:
            tokens = in_range_or_nothing(tokens, self.vocab_size)
        elif validate:
            self._check_range(tokens)
        row = torch.tensor([self.row_of(request_id)], dtype=torch.int64).to(self.device, non_blocking=True)
        self._observe(row, tokens)

    def observe_rows(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Batched, sync-free observe: ``token_ids [B, n]`` (or ``[B]``; -1: padding) of batch row b join request
        row ``rows[b]`` (int [B]); the ids of several batch rows of one request are observed as one call, in batch
        order. A batch row whose row is outside ``[0, max_requests)`` (a padding row, -1) observes nothing.
        ``ValueError`` when the shapes disagree (checked on the host, from metadata only): reshaping would hand
        one request's ids to another."""
        rows = _row_indices(rows, "rows")
        tokens = as_token_ids(token_ids)
        if tokens.dim() not in (1, 2) or tokens.shape[0] != rows.numel():
            raise ValueError(f"token_ids must be [B] or [B, n] with B = {rows.numel()} (one entry of rows per batch "
                             f"row), got shape {tuple(tokens.shape)}")
        if rows.numel() or self.observes_meet_the_ranks:  # a sharded set's observe is a collective: every rank calls
            tokens = tokens.reshape(rows.numel(), tokens.shape[1] if tokens.dim() == 2 else 1)
            rows, tokens = rows.to(self.device), tokens.to(self.device)
            real = (rows >= 0) & (rows < self.max_requests)  # padding rows: nothing joins any request
            self._observe(torch.where(real, rows, torch.zeros_like(rows)),
                          torch.where(real[:, None], tokens, torch.full_like(tokens, -1)))

    @holding_state_lock
    def _observe(self, rows: torch.Tensor, tokens: torch.Tensor, seeding: bool = False) -> None:
        if not (self.observes or seeding):
            return
        self.refresh_if_stale()
        with torch.no_grad():
            ops.observe(token_ids=self._rows_of_tokens(tokens), weight=self.weight, bias=self.bias,
                        **dict(zip(STATE, self.tensors())), num_pinned=self.num_pinned, rows=rows)

    # ----------------------------------------------------------------- head
    def compact_logits(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[..., capacity]: row i's logits over its request's slots (slot order), -inf past that request's count.
        ``rows``: the shape of x's leading dims; a row outside ``[0, max_requests)`` (padding) is all -inf."""
        self._before_head()
        return ops.compact_logits(x=x, cache_w=self.cache_w, cache_b=self._cache_b(), cursor=self.cursor,
                                  rows=self._rows(rows, x))

    def scatter(self, compact: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Compact logits [..., capacity] -> [..., vocab_size], -inf at every token its request does not hold."""
        rows = self._rows(rows, compact)
        return ops.scatter_logits(compact=compact, ids=self.ids, cursor=self.cursor, vocab_size=self.rows, rows=rows)

    def logits(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """[..., vocab_size]: the head's logits of row i at its request's active tokens, exactly -inf elsewhere (all
        -inf for a padding row, outside ``[0, max_requests)``)."""
        self._before_head()
        return ops.head_logits(x=x, cache_w=self.cache_w, cache_b=self._cache_b(), ids=self.ids, cursor=self.cursor,
                               vocab_size=self.rows, rows=self._rows(rows, x))

    def topk_compact(self, compact: torch.Tensor, rows: torch.Tensor, k: int, largest: bool = True):
        """Top-k of compact logits over each row's request's set -> (values [..., k], head rows [..., k])."""
        return ops.compact_topk(compact=compact, ids=self.ids, cursor=self.cursor, k=k, largest=largest,
                                rows=self._rows(rows, compact))

    def topk(self, x: torch.Tensor, rows: torch.Tensor, k: int, largest: bool = True):
        """Top-k of the head over each row's request's set, never building [..., V]. Ties: smaller id first;
        fewer than k active: padded with the smallest inactive ids and value -inf (+inf if not ``largest``); a padding
        row (outside ``[0, max_requests)``) is an empty set: head rows 0..k-1."""
        return self.topk_compact(self.compact_logits(x, rows), rows, k, largest)

    def argmax(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """int64 [...]: the head row of the largest active logit of each row (ties: smaller; 0 for an empty set and
        for a padding row, outside ``[0, max_requests)``)."""
        compact = self.compact_logits(x, rows)
        return ops.compact_argmax(compact=compact, ids=self.ids, cursor=self.cursor, rows=self._rows(rows, compact))

    # ----------------------------------------------------------------- inspection (host reads)
    @property
    def head_rows(self) -> torch.Tensor:
        """The head weight as [rows, H] (what the cache holds rows of)."""
        return self.weight

    @holding_state_lock
    def active_count(self, request_id: Hashable) -> int:
        """How many tokens ``request_id`` holds (reads the count on the host)."""
        return int(self.count[self.row_of(request_id)])

    @holding_state_lock
    def token_ids(self, request_id: Hashable) -> torch.Tensor:
        """The active token ids of ``request_id`` in slot order (1-D int64; reads the count on the host)."""
        row = self.row_of(request_id)
        return self._tokens_of(self.ids[row, : int(self.count[row])])

    @holding_state_lock
    def contains(self, request_id: Hashable, token_ids: Any) -> torch.Tensor:
        """Bool tensor: which of ``token_ids`` the set of ``request_id`` holds (out-of-range ids: False)."""
        return self._holds(self.slot_of[self.row_of(request_id)], as_token_ids(token_ids).to(self.device))

    def __repr__(self) -> str:
        return (f"RequestVocabs(requests={len(self._row_of)}/{self.max_requests}, capacity={self.capacity}, "
                f"rows={self.rows}, hidden={self.hidden_size}, policy={self.policy!r}, "
                f"num_pinned={self.num_pinned}, device={self.device})")

    # ----------------------------------------------------------------- internals
    def _before_head(self) -> None:
        self.refresh_if_stale()
        self.head_calls += 1

    def _cache_b(self) -> torch.Tensor | None:
        return self.cache_b if self.bias is not None else None

    def _rows(self, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        rows = _row_indices(rows, "rows", flat=False).to(x.device)
        if tuple(rows.shape) != tuple(x.shape[:-1]):
            raise ValueError(f"rows must have the shape of x's leading dims {tuple(x.shape[:-1])}, got "
                             f"{tuple(rows.shape)}")
        return rows

    def _rows_of_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.rows_of(tokens)

    def _check_range(self, tokens: torch.Tensor) -> None:
        check_token_range(tokens, self.vocab_size)

    def _clear_row(self, row: int) -> None:
        with torch.no_grad():
            self.ids[row].fill_(-1)
            self.slot_of[row].fill_(-1)
            self.cursor[row] = 0

    def _reset_row(self, row: int) -> None:
        self._clear_row(row)
        if self.seed_ids is not None:
            self._observe(torch.tensor([row], dtype=torch.int64).to(self.device), self.seed_ids.reshape(1, -1), True)


def _row_indices(rows: Any, name: str, flat: bool = True) -> torch.Tensor:
    """``rows`` as int64 (1-D when ``flat``); ``TypeError`` for floats or bools (truncating them would pick
    another request's row) and ``ValueError`` for a 1-D argument of another rank: metadata checks, no sync."""
    rows = torch.as_tensor(rows)
    if rows.dtype == torch.bool or rows.is_floating_point() or rows.is_complex():
        raise TypeError(f"{name} must be integer request rows, got dtype {rows.dtype}")
    if flat and rows.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B] (one request row per batch row), got shape {tuple(rows.shape)}")
    return rows.to(torch.int64)
