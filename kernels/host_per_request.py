"""CPU host path of the per-request ops: read ``rows`` on the host, group batch rows by request, and run the
shared-set host ops (:mod:`kernels.host`) on each request's views of the state - one GEMM per request over its
active rows only (gathered rows per request: docs/per-request.md says why not a union).

Same values and shapes as :mod:`kernels.reference_per_request`; only the work inside changes.
"""
from __future__ import annotations

import torch

from . import host
from .reference_per_request import flat_rows
from .schema import check_num_pinned


def _groups(rows: torch.Tensor) -> dict[int, torch.Tensor]:
    """Request row -> the batch rows mapped to it (ascending), in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for b, r in enumerate(rows.tolist()):
        groups.setdefault(r, []).append(b)
    return {r: torch.tensor(bs, dtype=torch.int64, device=rows.device) for r, bs in groups.items()}


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
    tok = token_ids.reshape(rows.numel(), -1)
    for r, members in _groups(rows).items():
        host.observe(tok.index_select(0, members.to(tok.device)).reshape(-1), weight, bias,
                     ids[r], slot_of[r], cursor[r:r + 1], cache_w[r], cache_b[r], num_pinned)


def _per_group(x2: torch.Tensor, rows: torch.Tensor, width: int, fn, dtype=None) -> torch.Tensor:
    out = x2.new_empty((x2.shape[0], width), dtype=dtype or x2.dtype)
    for r, members in _groups(rows).items():
        out.index_copy_(0, members, fn(r, x2.index_select(0, members)))
    return out


def compact_logits_per_request(
    x: torch.Tensor, rows: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, cursor: torch.Tensor
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference_per_request.compact_logits_per_request`."""
    x2, r = flat_rows(x, rows)
    _check(r, cache_w.shape[0])
    out = _per_group(x2, r, cache_w.shape[1], lambda q, xs: host.compact_logits(
        xs, cache_w[q], None if cache_b is None else cache_b[q], cursor[q:q + 1]))
    return out.reshape(*x.shape[:-1], cache_w.shape[1])


def scatter_logits_per_request(
    compact: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference_per_request.scatter_logits_per_request`."""
    c2, r = flat_rows(compact, rows)
    _check(r, ids.shape[0])
    out = _per_group(c2, r, vocab_size, lambda q, cs: host.scatter_logits(cs, ids[q], cursor[q:q + 1], vocab_size))
    return out.reshape(*compact.shape[:-1], vocab_size)


def head_logits_per_request(
    x: torch.Tensor, rows: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, ids: torch.Tensor,
    cursor: torch.Tensor, vocab_size: int,
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference_per_request.head_logits_per_request`."""
    x2, r = flat_rows(x, rows)
    _check(r, cache_w.shape[0])
    out = _per_group(x2, r, vocab_size, lambda q, xs: host.head_logits(
        xs, cache_w[q], None if cache_b is None else cache_b[q], ids[q], cursor[q:q + 1], vocab_size))
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
        v, t = host.compact_topk(c2.index_select(0, members), ids[q], cursor[q:q + 1], k, largest)
        values.index_copy_(0, members, v)
        tokens.index_copy_(0, members, t)
    return values.reshape(*compact.shape[:-1], k), tokens.reshape(*compact.shape[:-1], k)


def compact_argmax_per_request(compact: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`kernels.reference_per_request.compact_argmax_per_request`."""
    return compact_topk_per_request(compact, rows, ids, cursor, 1, True)[1].squeeze(-1)
