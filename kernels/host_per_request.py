"""CPU host path of the per-request ops: read ``rows`` and the counts on the host and compute only active rows.

The head (compact, scatter, fused) runs as one batched GEMM for the whole batch - every request's rows over its
own cached head rows, padded to one bucketed row count and masked past each request's count - with no Python
loop over requests (a serving batch holds 8-256 of them). Observe, top-k and argmax run the shared-set host ops
(:mod:`kernels.host`) on each request's views of the state. Gathered rows per request, not a union of the sets:
docs/per-request.md says why.

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
    """Rows ``members`` of ``x2`` ([1, D] for a single row)."""
    return x2[members:members + 1] if isinstance(members, int) else x2.index_select(0, members)


def _put(out: torch.Tensor, members, width: int, values: torch.Tensor) -> None:
    """``out[members, :width] = values``."""
    if isinstance(members, int):
        out[members, :width] = values[0]
    else:
        out.index_put_((members[:, None], torch.arange(width, device=out.device)[None, :]), values)


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
    """Same contract as :func:`kernels.reference_per_request.observe_per_request`.

    Each request's insertions are planned in Python (:func:`kernels.host.plan_insertions`, the shared-set rule),
    then every request's writes land in one batch of tensor ops: the cost of a step does not grow with a tensor
    op per request."""
    capacity, vocab = ids.shape[1], slot_of.shape[1]
    check_num_pinned(num_pinned, capacity)
    rows = rows.reshape(-1).to(torch.int64)
    _check(rows, ids.shape[0])
    if rows.numel() == 0:
        return
    fed_of: dict[int, list[int]] = {}
    for r, tokens in zip(rows.tolist(), token_ids.reshape(rows.numel(), -1).to(torch.int64).tolist()):
        fed_of.setdefault(r, []).extend(tokens)
    fed_of = {r: fed for r, tokens in fed_of.items() if (fed := [t for t in dict.fromkeys(tokens) if 0 <= t < vocab])}
    if not fed_of:
        return
    if len(fed_of) == 1:  # one request: the shared-set op on its row
        (r, fed), = fed_of.items()
        host.observe(torch.tensor(fed, dtype=torch.int64), weight, bias, ids[r], slot_of[r], cursor[r:r + 1],
                     cache_w[r], cache_b[r], num_pinned)
        return
    dev = ids.device
    req = [r for r, fed in fed_of.items() for _ in fed]
    flat = [t for fed in fed_of.values() for t in fed]
    slots = slot_of[torch.tensor(req, device=dev), torch.tensor(flat, device=dev)].tolist()
    starts = cursor.tolist()
    plan_r, plan_t, plan_s, ends = [], [], [], {}
    at = 0
    for r, fed in fed_of.items():
        plan = host.plan_insertions(fed, slots[at:at + len(fed)], starts[r], capacity, num_pinned)
        at += len(fed)
        if plan is not None:
            plan_r += [r] * len(plan[0])
            plan_t += plan[0]
            plan_s += plan[1]
            ends[r] = plan[2]
    if not ends:
        return
    r_, tok, dest = (torch.tensor(v, dtype=torch.int64, device=dev) for v in (plan_r, plan_t, plan_s))
    victims = ids[r_, dest]
    old = victims >= 0
    # first: a renewed id may be its own victim, and is then written again below
    slot_of[r_[old], victims[old]] = -1
    ids[r_, dest] = tok
    slot_of[r_, tok] = dest.to(slot_of.dtype)
    cache_w[r_, dest] = weight.index_select(0, tok).to(cache_w.dtype)
    if bias is not None:
        cache_b[r_, dest] = bias.index_select(0, tok).to(cache_b.dtype)
    cursor[torch.tensor(list(ends), dtype=torch.int64, device=dev)] = torch.tensor(
        list(ends.values()), dtype=cursor.dtype, device=dev)


class _Batch:
    """The batch's rows laid out per request for one batched GEMM.

    ``n`` [B]: each row's active count (its request's); ``width``: the bucketed column count of the GEMM
    (:func:`kernels.host.bucket` of the largest count). Requests are the batch matrices: those of a contiguous span
    of request rows read the cache as a view, others are gathered.
    """

    def __init__(self, r: torch.Tensor, cursor: torch.Tensor, capacity: int):
        self.r = r
        self.n = cursor.clamp(max=capacity)[r] if r.numel() else r
        self.width = host.bucket(int(self.n.max()), capacity) if r.numel() else 0
        first = int(r[0]) if r.numel() else -1
        self.single = first if r.numel() and bool((r == first).all()) else None  # the one request of the batch

    def valid(self) -> torch.Tensor:
        """Bool [B, width]: column j of row b is one of its request's active slots."""
        return torch.arange(self.width, device=self.r.device)[None, :] < self.n[:, None]

    def gemm(self, x2: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None) -> torch.Tensor:
        """[B, width]: each row against the first ``width`` cached rows of its request (-inf past its count)."""
        r, width, q = self.r, self.width, self.single
        if q is not None:  # one request: one plain GEMM, no padding
            part = F.linear(x2, cache_w[q, :width], None if cache_b is None else cache_b[q, :width])
            part[:, int(self.n[0]):] = float("-inf")
            return part
        uniq, inv = torch.unique(r, return_inverse=True)
        sizes = torch.bincount(inv, minlength=uniq.numel())
        order = torch.argsort(inv, stable=True)
        pos = torch.empty_like(r)
        pos[order] = torch.arange(r.numel(), device=r.device) - (torch.cumsum(sizes, 0) - sizes)[inv[order]]
        lo, hi = int(uniq[0]), int(uniq[-1])
        if hi - lo + 1 <= 2 * uniq.numel():  # a dense span of request rows: the cache as a view
            group, w = r - lo, cache_w[lo:hi + 1, :width]
            b = None if cache_b is None else cache_b[lo:hi + 1, :width]
        else:
            group, w = inv, cache_w[uniq, :width]
            b = None if cache_b is None else cache_b[uniq, :width]
        x3 = x2.new_zeros(w.shape[0], int(sizes.max()), x2.shape[1])
        x3[group, pos] = x2
        out3 = torch.bmm(x3, w.transpose(1, 2)) if b is None else torch.baddbmm(b[:, None, :], x3, w.transpose(1, 2))
        part = out3[group, pos]
        return part.masked_fill(~self.valid(), float("-inf"))

    def scatter(self, values: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[B, vocab_size]: ``values`` [B, >= width] of the active slots written at their token ids, -inf elsewhere."""
        out = values.new_full((self.r.numel(), vocab_size), float("-inf"))
        if self.width and self.single is not None:  # one request: its active ids as columns
            n = int(self.n[0])
            return out.scatter_(1, ids[self.single, :n].expand(out.shape[0], n), values[:, :n])
        if self.width:
            valid = self.valid()
            tokens = ids[self.r, :self.width]
            flat = torch.arange(self.r.numel(), device=out.device)[:, None] * vocab_size + tokens
            out.view(-1)[flat[valid]] = values[:, :self.width][valid]
        return out


def compact_logits_per_request(
    x: torch.Tensor, rows: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, cursor: torch.Tensor
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference_per_request.compact_logits_per_request`."""
    x2, r = flat_rows(x, rows)
    _check(r, cache_w.shape[0])
    capacity = cache_w.shape[1]
    out = x2.new_full((x2.shape[0], capacity), float("-inf"))
    batch = _Batch(r, cursor, capacity)
    if batch.width:
        out[:, :batch.width] = batch.gemm(x2, cache_w, cache_b)
    return out.reshape(*x.shape[:-1], capacity)


def scatter_logits_per_request(
    compact: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference_per_request.scatter_logits_per_request`."""
    c2, r = flat_rows(compact, rows)
    _check(r, ids.shape[0])
    out = _Batch(r, cursor, ids.shape[1]).scatter(c2, ids, vocab_size)
    return out.reshape(*compact.shape[:-1], vocab_size)


def head_logits_per_request(
    x: torch.Tensor, rows: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, ids: torch.Tensor,
    cursor: torch.Tensor, vocab_size: int,
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference_per_request.head_logits_per_request`: one batched GEMM over
    every request's active rows, written straight to their token ids (no compact round trip)."""
    x2, r = flat_rows(x, rows)
    _check(r, cache_w.shape[0])
    batch = _Batch(r, cursor, cache_w.shape[1])
    values = batch.gemm(x2, cache_w, cache_b) if batch.width else x2.new_empty((x2.shape[0], 0))
    return batch.scatter(values, ids, vocab_size).reshape(*x.shape[:-1], vocab_size)


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
        _put(values, members, k, v)
        _put(tokens, members, k, t)
    return values.reshape(*compact.shape[:-1], k), tokens.reshape(*compact.shape[:-1], k)


def compact_argmax_per_request(
    compact: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference_per_request.compact_argmax_per_request`: per request, the
    smallest token id among its largest active values (NaN largest); 0 for a request with no active token.
    One batched reduction over the widest request's count (no loop over requests)."""
    c2, r = flat_rows(compact, rows)
    _check(r, ids.shape[0])
    n = cursor.clamp(max=ids.shape[1])[r]
    width = int(n.max()) if r.numel() else 0
    if width == 0:
        return torch.zeros(compact.shape[:-1], dtype=torch.int64, device=compact.device)
    valid = torch.arange(width, device=c2.device)[None, :] < n[:, None]
    v = c2[:, :width].masked_fill(~valid, float("-inf"))
    best = v.max(-1, keepdim=True).values
    hit = ((v == best) | (v.isnan() & best.isnan())) & valid
    tokens = ids[r, :width]
    pick = torch.where(hit, tokens, torch.full_like(tokens, torch.iinfo(torch.int64).max)).min(-1).values
    return torch.where(n > 0, pick, torch.zeros_like(pick)).reshape(compact.shape[:-1])
