"""CPU host path of the per-request ops: read ``rows`` on the host, group batch rows by request, and run the
shared-set host ops (:mod:`kernels.host`) on each request's views of the state - one GEMM per request over its
active rows only (gathered rows per request: docs/per-request.md says why not a union).

Same values and shapes as :mod:`kernels.reference_per_request`; only the work inside changes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import host
from .reference_per_request import flat_rows
from .schema import check_num_pinned


def _groups(rows: torch.Tensor) -> dict[int, torch.Tensor | int]:
    """Request row -> the batch rows mapped to it (ascending; a plain int for a single row: cheaper to index)."""
    groups: dict[int, list[int]] = {}
    for b, r in enumerate(rows.tolist()):
        groups.setdefault(r, []).append(b)
    return {r: bs[0] if len(bs) == 1 else torch.tensor(bs, dtype=torch.int64, device=rows.device)
            for r, bs in groups.items()}


def _take(x2: torch.Tensor, members) -> torch.Tensor:
    """Rows ``members`` of ``x2`` ([1, D] for a single row; all of them for None)."""
    if members is None:
        return x2
    return x2[members:members + 1] if isinstance(members, int) else x2.index_select(0, members)


def _put(out: torch.Tensor, members, columns, values: torch.Tensor) -> None:
    """``out[members][:, columns] = values`` (``columns``: a slice or distinct int64 ids)."""
    if isinstance(members, int):
        out[members, columns] = values[0]
    elif isinstance(columns, slice):
        if members is None:
            out[:, columns] = values
        else:
            out.index_put_((members[:, None], torch.arange(columns.stop, device=out.device)[None, :]), values)
    elif members is None:
        out.scatter_(1, columns.expand(values.shape), values)
    else:
        out.index_put_((members[:, None], columns[None, :]), values)


def _check(rows: torch.Tensor, requests: int) -> None:
    if rows.numel() and not (0 <= int(rows.min()) and int(rows.max()) < requests):
        raise IndexError(f"rows must be in [0, {requests}), got {rows.tolist()}")


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
    """Same contract as :func:`kernels.reference_per_request.observe_per_request`."""
    check_num_pinned(num_pinned, ids.shape[1])
    rows = rows.reshape(-1).to(torch.int64)
    _check(rows, ids.shape[0])
    if rows.numel() == 0:
        return
    tok = token_ids.reshape(rows.numel(), -1)
    for r, members in _groups(rows).items():
        host.observe(_take(tok, members).reshape(-1), weight, bias,
                     ids[r], slot_of[r], cursor[r:r + 1], cache_w[r], cache_b[r], num_pinned)


def _plan(rows: torch.Tensor, cursor: torch.Tensor, capacity: int):
    """(request row, its batch rows or None when it has them all, active count) per request in the batch."""
    counts = cursor.tolist()
    groups = _groups(rows)
    whole = len(groups) == 1
    return [(q, None if whole else members, min(counts[q], capacity)) for q, members in groups.items()]


def _gemm(x2, members, cache_w, cache_b, q: int, n: int) -> torch.Tensor:
    """Logits of the request's rows over its first ``n`` slots (a bucket of rows computed, as the host head does)."""
    rows = host.bucket(n, cache_w.shape[1])
    part = F.linear(_take(x2, members), cache_w[q, :rows], None if cache_b is None else cache_b[q, :rows])
    return part[:, :n]


def compact_logits_per_request(
    x: torch.Tensor, rows: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, cursor: torch.Tensor
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference_per_request.compact_logits_per_request`."""
    x2, r = flat_rows(x, rows)
    _check(r, cache_w.shape[0])
    capacity = cache_w.shape[1]
    out = x2.new_full((x2.shape[0], capacity), float("-inf"))
    for q, members, n in _plan(r, cursor, capacity):
        if n:
            _put(out, members, slice(0, n), _gemm(x2, members, cache_w, cache_b, q, n))
    return out.reshape(*x.shape[:-1], capacity)


def scatter_logits_per_request(
    compact: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference_per_request.scatter_logits_per_request`."""
    c2, r = flat_rows(compact, rows)
    _check(r, ids.shape[0])
    out = c2.new_full((c2.shape[0], vocab_size), float("-inf"))
    for q, members, n in _plan(r, cursor, ids.shape[1]):
        if n:
            _put(out, members, ids[q, :n], _take(c2, members)[:, :n])
    return out.reshape(*compact.shape[:-1], vocab_size)


def head_logits_per_request(
    x: torch.Tensor, rows: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, ids: torch.Tensor,
    cursor: torch.Tensor, vocab_size: int,
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference_per_request.head_logits_per_request`: one GEMM per request over
    its active rows, written straight to their token ids (no compact round trip)."""
    x2, r = flat_rows(x, rows)
    _check(r, cache_w.shape[0])
    out = x2.new_full((x2.shape[0], vocab_size), float("-inf"))
    for q, members, n in _plan(r, cursor, cache_w.shape[1]):
        if n:
            _put(out, members, ids[q, :n], _gemm(x2, members, cache_w, cache_b, q, n))
    return out.reshape(*x.shape[:-1], vocab_size)


def compact_topk_per_request(
    compact: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, k: int, largest: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kernels.reference_per_request.compact_topk_per_request`."""
    if k < 0:
        raise ValueError(f"k={k} must be >= 0")
    c2, r = flat_rows(compact, rows)
    _check(r, ids.shape[0])
    values = c2.new_empty((c2.shape[0], k))
    tokens = c2.new_empty((c2.shape[0], k), dtype=torch.int64)
    for q, members in _groups(r).items():
        v, t = host.compact_topk(_take(c2, members), ids[q], cursor[q:q + 1], k, largest)
        _put(values, members, slice(0, k), v)
        _put(tokens, members, slice(0, k), t)
    return values.reshape(*compact.shape[:-1], k), tokens.reshape(*compact.shape[:-1], k)


def compact_argmax_per_request(
    compact: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference_per_request.compact_argmax_per_request`: per request, the
    smallest token id among its largest active values (NaN largest); 0 for a request with no active token."""
    c2, r = flat_rows(compact, rows)
    _check(r, ids.shape[0])
    out = torch.zeros(c2.shape[0], dtype=torch.int64, device=c2.device)
    for q, members, n in _plan(r, cursor, ids.shape[1]):
        if not n:
            continue
        v = _take(c2, members)[:, :n]
        best = v.max(-1, keepdim=True).values
        hit = (v == best) | (v.isnan() & best.isnan())
        tokens = ids[q, :n].expand(v.shape)
        pick = torch.where(hit, tokens, torch.full_like(tokens, torch.iinfo(torch.int64).max)).min(-1).values
        _put(out[:, None], members, slice(0, 1), pick[:, None])
    return out.reshape(compact.shape[:-1])
