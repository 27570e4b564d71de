"""Plain-torch reference of the per-request ops: every request row is a shared-set state.

The per-request state is the shared-set state of :mod:`kernels.reference` with one row per request
(``ids [R, C]``, ``slot_of [R, V]``, ``cursor [R]``, ``cache_w [R, C, H]``, ``cache_b [R, C]``), and
``rows [B]`` maps each batch row to its request row. Each op is, by definition, the shared-set op applied
to batch row b with the state of request ``rows[b]``; this module computes exactly that, one batch row
at a time (a Python loop over the static batch size: no host sync, no data-dependent shape).

``observe_per_request`` with repeated rows: the ids of all batch rows of one request are observed as one
call, concatenated in batch order (:func:`grouped_token_ids`), so the result does not depend on how a
request's ids are split across batch rows.
"""
from __future__ import annotations

import torch

from . import reference
from .schema import check_num_pinned


def flat_rows(x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` and ``rows [...]`` as ``[B, D]`` and ``[B]`` (int64)."""
    if tuple(rows.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"rows must have the shape of x's leading dims {tuple(x.shape[:-1])}, got {tuple(rows.shape)}")
    return x.reshape(-1, x.shape[-1]), rows.reshape(-1).to(torch.int64)


def lead_rows(rows: torch.Tensor) -> torch.Tensor:
    """Bool [B]: batch row b is the first batch row of its request."""
    b = torch.arange(rows.numel(), device=rows.device)
    earlier_same = (rows[:, None] == rows[None, :]) & (b[None, :] < b[:, None])
    return ~earlier_same.any(1)


def grouped_token_ids(token_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """int64 [B, B * n]: for the first batch row of each request, the ids of all its batch rows in batch
    order; -1 (ignored by observe) everywhere else. ``token_ids``: [B, n] (or [B] for one id per row)."""
    tok = token_ids.reshape(rows.numel(), -1).to(device=rows.device, dtype=torch.int64)
    same = (rows[:, None] == rows[None, :]) & lead_rows(rows)[:, None]  # [B (lead), B (member)]
    grouped = torch.where(same[:, :, None], tok[None, :, :], torch.full_like(tok[None], -1))
    return grouped.reshape(rows.numel(), -1)


def _row(t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """A copy of row ``r`` ([1] int64 device tensor) of ``t`` (``cursor [R]`` keeps its [1] shape)."""
    got = t.index_select(0, r)
    return got if t.dim() == 1 else got.squeeze(0)


def observe_per_request(
    token_ids: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    slot_of: torch.Tensor,
    cursor: torch.Tensor,
    cache_w: torch.Tensor,
    cache_b: torch.Tensor,
    num_pinned: int,
) -> None:
    """Add ``token_ids [B, n]`` (-1 and other out-of-range ids ignored) of batch row b to request ``rows[b]``."""
    check_num_pinned(num_pinned, ids.shape[1])
    rows = rows.reshape(-1).to(device=ids.device, dtype=torch.int64)
    if rows.numel() == 0:
        return
    grouped = grouped_token_ids(token_ids, rows)
    state = (ids, slot_of, cursor, cache_w, cache_b)
    for b in range(rows.numel()):  # a later batch row of the same request sees the earlier one's write back
        r = rows[b:b + 1]
        mine = [_row(t, r) for t in state]
        reference.observe(grouped[b], weight, bias, *mine, num_pinned)
        for t, m in zip(state, mine):
            t.index_copy_(0, r, m if t.dim() == 1 else m.unsqueeze(0))


def compact_logits_per_request(
    x: torch.Tensor, rows: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, cursor: torch.Tensor
) -> torch.Tensor:
    """Row b: ``x[b] @ cache_w[rows[b]].T (+ cache_b[rows[b]])`` -> [..., C]; -inf past that request's count."""
    x2, r = flat_rows(x, rows)
    out = []
    for b in range(r.numel()):
        q = r[b:b + 1]
        bias = None if cache_b is None else _row(cache_b, q)
        out.append(reference.compact_logits(x2[b], _row(cache_w, q), bias, _row(cursor, q)))
    return _stack(out, x.shape[:-1], cache_w.shape[1], x)


def scatter_logits_per_request(
    compact: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Row b: compact logits placed at the token ids of request ``rows[b]`` in a row of -inf -> [..., V]."""
    c2, r = flat_rows(compact, rows)
    out = [reference.scatter_logits(c2[b], _row(ids, r[b:b + 1]), _row(cursor, r[b:b + 1]), vocab_size)
           for b in range(r.numel())]
    return _stack(out, compact.shape[:-1], vocab_size, compact)


def head_logits_per_request(
    x: torch.Tensor, rows: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, ids: torch.Tensor,
    cursor: torch.Tensor, vocab_size: int,
) -> torch.Tensor:
    """``scatter_logits_per_request(compact_logits_per_request(...))``: [..., V]."""
    compact = compact_logits_per_request(x, rows, cache_w, cache_b, cursor)
    return scatter_logits_per_request(compact, rows, ids, cursor, vocab_size)


def compact_topk_per_request(
    compact: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, k: int, largest: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row b: :func:`kernels.reference.compact_topk` over request ``rows[b]``'s slots (same ties and padding)."""
    if k < 0:
        raise ValueError(f"k={k} must be >= 0")
    c2, r = flat_rows(compact, rows)
    picks = [reference.compact_topk(c2[b], _row(ids, r[b:b + 1]), _row(cursor, r[b:b + 1]), k, largest)
             for b in range(r.numel())]
    values = _stack([v for v, _ in picks], compact.shape[:-1], k, compact)
    tokens = _stack([t for _, t in picks], compact.shape[:-1], k, compact, torch.int64)
    return values, tokens


def compact_argmax_per_request(
    compact: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor
) -> torch.Tensor:
    """Row b: the token id of the largest active logit of request ``rows[b]`` (ties: smaller id; 0 if none)."""
    return compact_topk_per_request(compact, rows, ids, cursor, 1, True)[1].squeeze(-1)


def _stack(parts: list, lead: torch.Size, width: int, like: torch.Tensor, dtype: torch.dtype | None = None
           ) -> torch.Tensor:
    if not parts:
        return like.new_empty((*lead, width), dtype=dtype or like.dtype)
    return torch.stack(parts).reshape(*lead, width)


def _first_occurrence_rows(x: torch.Tensor) -> torch.Tensor:
    """Bool [B, L]: True at the first occurrence of each value within its row."""
    if x.numel() == 0:
        return torch.zeros_like(x, dtype=torch.bool)
    sorted_x, perm = torch.sort(x, dim=1, stable=True)
    first_sorted = torch.ones_like(sorted_x, dtype=torch.bool)
    first_sorted[:, 1:] = sorted_x[:, 1:] != sorted_x[:, :-1]
    return torch.empty_like(first_sorted).scatter_(1, perm, first_sorted)


def renew_fed_ids_per_request(
    grouped: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, slot_of: torch.Tensor, cursor: torch.Tensor,
    num_pinned: int,
) -> None:
    """:func:`kernels.reference.renew_fed_ids` of every batch row's ``grouped`` ids (:func:`grouped_token_ids`) on
    its request row, for all rows at once (the Triton path's form: fixed shapes, no sync). Only first rows of a
    request hold ids, so the rows write disjoint state rows."""
    requests, capacity = ids.shape
    vocab = slot_of.shape[1]
    ring = capacity - num_pinned
    if grouped.numel() == 0 or ring <= 0:
        return
    in_range = (grouped >= 0) & (grouped < vocab)
    x = torch.where(in_range, grouped, torch.zeros_like(grouped))
    r = rows[:, None]
    slot = slot_of[r, x].to(torch.int64)
    first = _first_occurrence_rows(torch.where(in_range, x, torch.full_like(x, -1)))
    n_new = (in_range & first & (slot < 0)).sum(1, keepdim=True)
    held = torch.where(in_range & (slot >= 0), slot, torch.full_like(slot, capacity))
    protected = torch.zeros(rows.numel(), capacity + 1, dtype=torch.bool, device=ids.device)
    protected.scatter_(1, held, torch.ones_like(held, dtype=torch.bool))
    k = cursor.index_select(0, rows)[:, None] + torch.arange(ring, device=ids.device)
    position = reference.slot_for_insertion(k, capacity, num_pinned)
    at = ids.index_select(0, rows).gather(1, position)
    guarded = protected.gather(1, position) & (at >= 0)
    free = (~guarded).to(torch.int64)
    endangered = guarded & (torch.cumsum(free, 1) - free < n_new)
    endangered = endangered & (n_new + endangered.sum(1, keepdim=True) <= ring)
    mask = endangered.reshape(-1)
    victims = (r * vocab + torch.clamp(at, min=0)).reshape(-1)
    reference._masked_set(slot_of.view(-1), victims, torch.full_like(victims, -1, dtype=slot_of.dtype), mask)
    places = (r * capacity + position).reshape(-1)
    reference._masked_set(ids.view(-1), places, torch.full_like(places, -1), mask)
