"""CPU implementations of the nanospec ops whose cost follows the active count, not the capacity.

On a CPU there is no device to keep busy and no sync to avoid: reading ``cursor`` on the host is
free, so these ops compute only what is active instead of masking the whole capacity as the
reference does. Outputs keep the reference's static shapes and values exactly (slots past the
count are -inf, top-k pads with the smallest inactive ids); only the work inside changes:

* the head multiplies ``x`` by the first :func:`bucket` ``(count)`` cached rows, not all C (a few
  sizes per octave, so the matrix shapes repeat; ~25% at most computed past the count);
* scatter, top-k and argmax read the ``count`` active slots only; top-k and argmax select (``torch.topk``) rather
  than sort: one partial selection when no tie decides the order, else one over int64 keys that carry the tie
  rule (``k < count``; padding and float64 keep the stable sort);
* ``observe`` de-duplicates, renews and allocates in Python over the call's few ids and moves the
  data with a handful of tensor ops (the reference needs ~70 small ones to stay on the device).

With ``rows`` (a per-request state, :mod:`kernels.request_rows`) ``rows`` and the counts are read on the host too:
the head runs as one batched GEMM for the whole batch - every request's rows over its own cached head rows, padded
to one bucketed row count and masked past each request's count - with no Python loop over requests (a serving batch
holds 8-256 of them); observe plans each request's insertions in Python and writes them all in one batch of tensor
ops; top-k runs the shared-set op per request. A padding row (outside ``[0, R)``) reads as an empty set and
observes nothing, as on every path. Gathered rows per request, not a union of the sets: docs/per-request.md says
why.

:mod:`kernels.dispatch` picks these for plain CPU tensors, and the reference while a tensor is
traced (fake or under a dispatch mode): a traced body must not read data on the host.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import request_rows as RR
from .schema import check_num_pinned

_MIN_BUCKET = 16
_STEPS_PER_OCTAVE = 4


def bucket(count: int, capacity: int) -> int:
    """Rows the head computes for ``count`` active slots: ``count`` rounded up to one of
    ``_STEPS_PER_OCTAVE`` sizes per power of two (at least 16), at most the capacity; 0 for 0."""
    if count <= 0:
        return 0
    n = max(count, _MIN_BUCKET)
    step = 1 << max(n.bit_length() - 1 - (_STEPS_PER_OCTAVE.bit_length() - 1), 0)
    return min(capacity, -(-n // step) * step)


def active_count(cursor: torch.Tensor, capacity: int) -> int:
    """How many slots are active: ``min(cursor, C)``, read on the host (``cursor``: one element)."""
    return min(int(cursor.item()), capacity)


# ----------------------------------------------------------------------------- observe
def _slot(k: int, capacity: int, num_pinned: int) -> int:
    """Slot of the k-th insertion (the rule of :func:`kernels.reference.slot_for_insertion`)."""
    return k if k < capacity else num_pinned + (k - num_pinned) % (capacity - num_pinned)


def renewed_slots(slots: list[int], start: int, capacity: int, num_pinned: int) -> set[int]:
    """Slots of the call's active ids that its new ids would claim, to be inserted again as newest.

    ``slots``: the slot of each distinct fed id (-1: new). Ring position ``q`` is the ``q``-th slot the
    next insertions claim; one holding a fed id is endangered when fewer than ``n_new`` positions
    before it are free (empty, or holding an id the call does not feed). Renewed only if the new ids
    and the endangered ones all fit in the ring (else the call keeps the rule: the last ones stay).
    """
    ring = capacity - num_pinned
    n_new = sum(1 for s in slots if s < 0)
    if n_new == 0:
        return set()
    head = _slot(start, capacity, num_pinned)
    held = sorted(((s - head) % ring, s) for s in slots if s >= num_pinned)  # active ring slots, in claim order
    endangered = [s for before, (q, s) in enumerate(held) if q - before < n_new]
    return set(endangered) if endangered and n_new + len(endangered) <= ring else set()


def plan_insertions(
    fed: list[int], slots: list[int], start: int, capacity: int, num_pinned: int
) -> tuple[list[int], list[int], int] | None:
    """Where the distinct fed ids ``fed`` (their current slots ``slots``, -1: inactive) go, for a set whose
    cursor is ``start``: ``(tokens, their slots, the new cursor)``, or None when nothing is inserted.

    Pure Python over the call's few ids (the rule of :func:`nanospec_fx.kernels.reference.observe`, fed-id renewal
    included): :func:`observe` applies one plan, the per-request host path applies every request's in one batch.
    """
    renew = renewed_slots(slots, start, capacity, num_pinned)
    new = [t for t, s in zip(fed, slots) if s < 0 or s in renew]  # order of first occurrence
    if not new:
        return None
    # The k-th insertion claims _slot(k); an overflowing call drops its earliest ring insertions.
    ring = capacity - num_pinned
    skip_from = max(num_pinned - start, 0)
    skip_to = skip_from + max(len(new) - skip_from - ring, 0)
    kept = [(t, _slot(start + r, capacity, num_pinned)) for r, t in enumerate(new) if not skip_from <= r < skip_to]
    return [t for t, _ in kept], [s for _, s in kept], start + len(new)


def observe(
    token_ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, slot_of: torch.Tensor,
    cursor: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor, num_pinned: int,
    rows: torch.Tensor | None = None,
) -> None:
    """Same contract as :func:`nanospec_fx.kernels.reference.observe` (fed-id renewal included)."""
    if rows is not None:
        return _observe_rows(token_ids, weight, bias, ids, slot_of, cursor, cache_w, cache_b, num_pinned, rows)
    capacity, vocab = ids.numel(), slot_of.numel()
    check_num_pinned(num_pinned, capacity)
    given = token_ids.reshape(-1).tolist()
    fed = [t for t in dict.fromkeys(given) if 0 <= t < vocab]
    if not fed:
        return
    # The common call (a draft step's few ids, nearly all active): one gather of their slots; with no new id
    # there is nothing to insert and nothing to renew, so the call ends here.
    slots = slot_of[fed].tolist()
    if min(slots) >= 0:
        return
    start = int(cursor)
    plan = plan_insertions(fed, slots, start, capacity, num_pinned)
    if plan is None:
        return
    tokens, dests, end = plan
    tok = torch.tensor(tokens, dtype=torch.int64, device=ids.device)
    dest = torch.tensor(dests, dtype=torch.int64, device=ids.device)
    # Insertion k first fills slot k (k < C): until the ring wraps, every claimed slot is empty, nothing is
    # evicted and nothing renewed; after, the claimed slots' ids are evicted first (a renewed id may be its own
    # victim, and is then written again below).
    if end > capacity and (victims := [t for t in ids.index_select(0, dest).tolist() if t >= 0]):
        slot_of.index_fill_(0, torch.tensor(victims, dtype=torch.int64, device=ids.device), -1)
    ids.index_copy_(0, dest, tok)
    slot_of.index_copy_(0, tok, dest.to(slot_of.dtype))
    cache_w.index_copy_(0, dest, _same_dtype(weight.index_select(0, tok), cache_w))
    if bias is not None:
        cache_b.index_copy_(0, dest, _same_dtype(bias.index_select(0, tok), cache_b))
    cursor.fill_(end)


def _same_dtype(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``rows`` in ``like``'s dtype (no op call when it already is)."""
    return rows if rows.dtype == like.dtype else rows.to(like.dtype)


# ----------------------------------------------------------------------------- head and selection
def compact_logits(
    x: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, cursor: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ cache_w.T (+ cache_b)`` over the bucket of active rows -> [..., C]; -inf past the count."""
    if rows is not None:
        x2, r = RR.flat_rows(x, rows)
        capacity = cache_w.shape[1]
        out = x2.new_full((x2.shape[0], capacity), float("-inf"))
        batch = _Batch(r, cursor, capacity)
        if batch.width:
            out[:, :batch.width] = batch.gemm(x2, cache_w, cache_b)
        return out.reshape(*x.shape[:-1], capacity)
    capacity = cache_w.shape[0]
    n = active_count(cursor, capacity)
    rows = bucket(n, capacity)
    part = F.linear(x, cache_w[:rows], None if cache_b is None else cache_b[:rows])
    return F.pad(part[..., :n], (0, capacity - n), value=float("-inf"))  # one op: -inf past the count


def scatter_logits(compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, vocab_size: int,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """Place the active compact logits at their token ids in a [..., V] tensor of -inf."""
    if rows is not None:
        c2, r = RR.flat_rows(compact, rows)
        out = _Batch(r, cursor, ids.shape[1]).scatter(c2, ids, vocab_size)
        return out.reshape(*compact.shape[:-1], vocab_size)
    n = active_count(cursor, ids.numel())
    out = compact.new_full((*compact.shape[:-1], vocab_size), float("-inf"))
    src = compact[..., :n]
    return out.scatter_(-1, ids[:n].expand(src.shape), src)


def head_logits(
    x: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, ids: torch.Tensor, cursor: torch.Tensor,
    vocab_size: int, rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scatter_logits(compact_logits(...))``: the head with no post-ops, [..., V]. With ``rows``: one batched GEMM
    over every request's active rows, written straight to their token ids (no compact round trip)."""
    if rows is not None:
        x2, r = RR.flat_rows(x, rows)
        batch = _Batch(r, cursor, cache_w.shape[1])
        values = batch.gemm(x2, cache_w, cache_b) if batch.width else x2.new_empty((x2.shape[0], 0))
        return batch.scatter(values, ids, vocab_size).reshape(*x.shape[:-1], vocab_size)
    return scatter_logits(compact_logits(x, cache_w, cache_b, cursor), ids, cursor, vocab_size)


def compact_topk(
    compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, k: int, largest: bool = True,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over the active slots, with the reference's tie rule and padding
    (:func:`nanospec_fx.kernels.reference.compact_topk`): a stable sort of the active values laid out in
    token-id order, then the smallest inactive ids (value -inf, or +inf if not ``largest``)."""
    if k < 0:
        raise ValueError(f"k={k} must be >= 0")
    if rows is not None:
        return _topk_rows(compact, ids, cursor, k, largest, rows)
    n = active_count(cursor, ids.numel())
    if k < n:  # the common case (a draft loop's top-1 .. top-10): a partial selection, no sort, no padding
        picked = _topk_untied(compact[..., :n], ids[:n], k, largest)
        if picked is None and compact.dtype in _KEYED:
            picked = _topk_keyed(compact[..., :n], ids[:n], k, largest)
        if picked is not None:
            return picked
    tokens, by_id = torch.sort(ids[:n])  # active ids are distinct
    vals, order = torch.sort(compact[..., :n].index_select(-1, by_id), dim=-1, descending=largest, stable=True)
    found = min(k, n)
    vals, tokens = vals[..., :found].contiguous(), tokens[order[..., :found]]  # the fake promises contiguous
    if k > found:  # padding: the k - found smallest inactive ids, all in [0, k)
        taken = torch.zeros(k, dtype=torch.bool, device=ids.device)
        taken[tokens.new_tensor([t for t in ids[:n].tolist() if t < k])] = True
        pad = torch.nonzero(~taken).reshape(-1)[: k - found]
        shape = (*compact.shape[:-1], k - found)
        vals = torch.cat([vals, vals.new_full(shape, float("-inf") if largest else float("inf"))], -1)
        tokens = torch.cat([tokens, pad.expand(shape)], -1)
    return vals, tokens


def _topk_untied(values: torch.Tensor, tokens: torch.Tensor, k: int, largest: bool):
    """The rule's top-``k`` of the active ``values [..., n]`` (``k < n``) from one ``torch.topk`` of ``k + 1``, when
    that is exact: the ``k + 1`` picked values strictly ordered in every row (no NaN, no tie among the first ``k``
    nor with the next one, so no tie rule applies and the ``k`` are the only ones). None otherwise (a tie, a NaN,
    -0.0 beside 0.0): the caller applies the tie rule."""
    vals, slots = values.topk(k + 1, dim=-1, largest=largest)
    if vals.numel() <= _CHECK_ON_HOST:  # a draft step's few values: compared in Python, no tensor op per check
        flat = vals.reshape(-1, k + 1).tolist()
        ordered = all(a > b if largest else a < b for row in flat for a, b in zip(row, row[1:]))
    else:
        head, after = vals[..., :k], vals[..., 1:]
        ordered = bool(((head > after) if largest else (head < after)).all())
    if not ordered:
        return None
    return vals[..., :k].contiguous(), tokens[slots[..., :k]]


#: at most this many selected values are checked for ties in Python (a few us; larger selections as tensor ops)
_CHECK_ON_HOST = 64


# Floats whose order a float32 copy keeps exactly (the keyed selection's domain; float64 takes the sort).
_KEYED = (torch.float32, torch.float16, torch.bfloat16)
_LOW = (1 << 32) - 1


def _topk_keyed(values: torch.Tensor, tokens: torch.Tensor, k: int, largest: bool):
    """The rule's top-``k`` (``k < n``) with ties: one ``torch.topk`` over int64 keys that hold the value's order in
    the high half (its float32 bits made monotone; every NaN one positive NaN, above +inf; -0.0 as 0.0, equal to
    it) and the tie break in the low half (the smaller token id wins either way). Exact for 16- and 32-bit floats
    and ids below 2^32; values are read back at the picked slots (their own bits)."""
    w = values.float()
    w = torch.where(w.isnan(), float("nan"), w + 0.0)  # canonical NaN; -0.0 + 0.0 is 0.0
    bits = w.view(torch.int32).to(torch.int64)
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # sign-magnitude -> two's complement order
    key = (bits << 32) | ((_LOW - tokens) if largest else tokens)
    slots = key.topk(k, dim=-1, largest=largest).indices
    return values.gather(-1, slots), tokens[slots]


def compact_argmax(compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """Token id of the largest active compact logit (ties: smaller id; NaN largest; 0 if none). With ``rows``: one
    batched reduction over the widest request's count (no loop over requests)."""
    if rows is None:
        return compact_topk(compact, ids, cursor, 1, largest=True)[1].squeeze(-1)
    c2, r = RR.flat_rows(compact, rows)
    batch = _Batch(r, cursor, ids.shape[1], bucketed=False)
    if batch.width == 0:
        return torch.zeros(compact.shape[:-1], dtype=torch.int64, device=compact.device)
    valid = batch.valid()
    v = c2[:, :batch.width].masked_fill(~valid, float("-inf"))
    best = v.max(-1, keepdim=True).values
    hit = ((v == best) | (v.isnan() & best.isnan())) & valid
    tokens = ids[batch.r, :batch.width]
    pick = torch.where(hit, tokens, torch.full_like(tokens, torch.iinfo(torch.int64).max)).min(-1).values
    return torch.where(batch.n > 0, pick, torch.zeros_like(pick)).reshape(compact.shape[:-1])


# ----------------------------------------------------------------------------- the request axis (rows)
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


def _observe_rows(token_ids, weight, bias, ids, slot_of, cursor, cache_w, cache_b, num_pinned, rows) -> None:
    """:func:`observe` with ``rows``: each request's insertions are planned in Python (:func:`plan_insertions`, the
    shared-set rule), then every request's writes land in one batch of tensor ops: the cost of a step does not grow
    with a tensor op per request. Padding rows observe nothing."""
    capacity, vocab = ids.shape[1], slot_of.shape[1]
    check_num_pinned(num_pinned, capacity)
    rows = rows.reshape(-1).to(torch.int64)
    if rows.numel() == 0:
        return
    fed_of: dict[int, list[int]] = {}
    for r, tokens in zip(rows.tolist(), token_ids.reshape(rows.numel(), -1).to(torch.int64).tolist()):
        if 0 <= r < ids.shape[0]:  # a padding row observes nothing
            fed_of.setdefault(r, []).extend(tokens)
    fed_of = {r: fed for r, tokens in fed_of.items() if (fed := [t for t in dict.fromkeys(tokens) if 0 <= t < vocab])}
    if not fed_of:
        return
    if len(fed_of) == 1:  # one request: the shared-set op on its row
        (r, fed), = fed_of.items()
        observe(torch.tensor(fed, dtype=torch.int64), weight, bias, ids[r], slot_of[r], cursor[r:r + 1],
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
        plan = plan_insertions(fed, slots[at:at + len(fed)], starts[r], capacity, num_pinned)
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

    ``r`` [B]: each row's request row (a padding row: row 0); ``n`` [B]: each row's active count (its request's; 0
    for a padding row); ``width``: the column count of the GEMM (:func:`bucket` of the largest count, or that count
    itself unless ``bucketed``). Requests are the batch matrices: those of a contiguous span of request rows read
    the cache as a view, others are gathered.
    """

    def __init__(self, rows: torch.Tensor, cursor: torch.Tensor, capacity: int, bucketed: bool = True):
        self.r, real = RR.real_rows(rows, cursor.shape[0])
        r = self.r
        count = cursor.clamp(max=capacity)[r]
        self.n = torch.where(real, count, torch.zeros_like(count))
        top = int(self.n.max()) if r.numel() else 0
        self.width = bucket(top, capacity) if bucketed else top
        first = int(r[0]) if r.numel() else -1
        one = r.numel() and bool(((r == first) & real).all())
        self.single = first if one else None  # the one request of the batch

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


def _topk_rows(compact, ids, cursor, k: int, largest: bool, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`compact_topk` with ``rows``: the shared-set op on each request's batch rows (a padding row: on an
    empty set)."""
    c2, r = RR.flat_rows(compact, rows)
    values = c2.new_empty((c2.shape[0], k))
    tokens = c2.new_empty((c2.shape[0], k), dtype=torch.int64)
    empty = cursor.new_zeros(1)
    for q, members in _groups(r).items():
        real = 0 <= q < ids.shape[0]
        v, t = compact_topk(_take(c2, members), ids[q if real else 0], cursor[q:q + 1] if real else empty, k, largest)
        _put(values, members, k, v)
        _put(tokens, members, k, t)
    return values.reshape(*compact.shape[:-1], k), tokens.reshape(*compact.shape[:-1], k)
