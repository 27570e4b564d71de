"""Plain-torch reference implementations of the nanospec ops.

These run on every device and define what the Triton kernels must compute. None of them
synchronises with the host or produces a tensor whose shape depends on the active set:
every op works over the full capacity and masks by the device-side ``cursor``.

State layout (owned by :class:`nanospec_fx.ActiveVocab`)::

    ids      int64 [C]      slot -> token id, -1 for a slot never filled
    slot_of  int32 [V]      token id -> slot, -1 for an inactive token (the membership map)
    cursor   int64 [1]      how many tokens were ever inserted; count = min(cursor, C)
    cache_w  [C, H]         head rows of the active tokens, in slot order
    cache_b  [C]            bias entries of the active tokens (unused without a bias)

Slots [0, num_pinned) are filled first and never evicted; the rest form a ring that
evicts the oldest insertion first (FIFO by first insertion: observing an active token again
does not refresh it; measured against LRU in docs/kernels.md "Eviction order"). The names,
order and dtypes of these tensors are declared once, in :mod:`kernels.schema`.

Selection on compact logits (:func:`compact_topk`, :func:`compact_argmax`) follows one tie
rule, that of a *stable* sort of the full-vocabulary logits restricted to the active set:
values in order (NaN above +inf, as ``torch.sort`` / ``torch.topk`` order it), and among equal
values the smaller token id first. ``torch.topk`` itself leaves the order of ties unspecified
(on CPU it differs with size and k), so this is the rule eager code gets from
``torch.sort(..., stable=True)``; ``torch.argmax`` documents the same rule (first maximum).

With ``rows`` (a per-request state, :mod:`kernels.request_rows`) each op is, by definition, the shared-set op
applied to batch row b with the state of request ``rows[b]`` (an empty set for a padding row); this module
computes exactly that, one batch row at a time (a Python loop over the static batch size: no host sync, no
data-dependent shape). ``observe`` with repeated rows observes the ids of all batch rows of one request as one
call, concatenated in batch order.

Masked writes redirect masked-off entries to repeat a masked-on write (same index, same
value), so duplicate indices never race and no op needs a data-dependent shape.
"""
from __future__ import annotations

import torch

from . import request_rows as RR
from .schema import check_num_pinned


def slot_for_insertion(k: torch.Tensor, capacity: int, num_pinned: int) -> torch.Tensor:
    """Slot of the k-th insertion (0-based): fill 0..C-1, then cycle over [num_pinned, C)."""
    ring = capacity - num_pinned
    return torch.where(k < capacity, k, num_pinned + (k - num_pinned) % ring)


def _first_occurrence(x: torch.Tensor) -> torch.Tensor:
    """Bool mask, True at the first occurrence of each value along the last dim of ``x``."""
    if x.numel() == 0:
        return torch.zeros_like(x, dtype=torch.bool)
    sorted_x, perm = torch.sort(x, dim=-1, stable=True)
    first_sorted = torch.ones_like(sorted_x, dtype=torch.bool)
    first_sorted[..., 1:] = sorted_x[..., 1:] != sorted_x[..., :-1]
    return torch.empty_like(first_sorted).scatter_(-1, perm, first_sorted)


def _redirect_masked(
    index: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, fallback_value: torch.Tensor, dim: int = 0
):
    """Index/value pairs where masked-off entries repeat the first masked-on one.

    Every write to a position then carries the same value, so duplicate indices are harmless
    on any device (deterministic), and nothing has a data-dependent shape. With no masked-on
    entry, everything goes to position 0 with ``fallback_value`` (its current content).
    """
    first = torch.argmax(mask.to(torch.int32)).view(1)  # first masked-on entry (0 when none)
    any_on = mask.any()
    first_index = index.index_select(0, first)
    tgt_index = torch.where(any_on, first_index, torch.zeros_like(first_index))
    tgt_value = torch.where(any_on, value.index_select(dim, first), fallback_value.unsqueeze(dim))
    shape = [1] * value.dim()
    shape[dim] = -1
    return torch.where(mask, index, tgt_index), torch.where(mask.view(shape), value, tgt_value)


def _masked_set(buf: torch.Tensor, index: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> None:
    """``buf[index[i]] = value[i]`` where ``mask[i]``; indices under the mask must be unique."""
    if index.numel() == 0:
        return
    value = value.to(buf.dtype)
    idx, val = _redirect_masked(index, value, mask, buf[0])
    buf.index_put_((idx,), val)


def observe(
    token_ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, slot_of: torch.Tensor,
    cursor: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor, num_pinned: int,
    rows: torch.Tensor | None = None,
) -> None:
    """Insert every id of ``token_ids`` that is not active yet, copying its head row.

    Ids outside [0, V) are ignored (callers that want an error validate first). New ids are
    inserted in order of first occurrence; if one call brings more new ids than the ring
    holds, the last ones stay. Active ids of the call that its new ids would evict are renewed
    first (:func:`renew_fed_ids`), so a call keeps every id it feeds while they fit. With ``rows``:
    ``token_ids [B, n]`` of batch row b join request ``rows[b]`` (see the module docstring).
    """
    if rows is not None:
        return _observe_rows(token_ids, weight, bias, ids, slot_of, cursor, cache_w, cache_b, num_pinned, rows)
    capacity, vocab = ids.numel(), slot_of.numel()
    check_num_pinned(num_pinned, capacity)
    renew_fed_ids(token_ids, ids, slot_of, cursor, num_pinned)
    x = token_ids.reshape(-1).to(device=ids.device, dtype=torch.int64)
    in_range = (x >= 0) & (x < vocab)
    # Out-of-range ids share the key -1 for de-duplication, so they never shadow a real id.
    first = _first_occurrence(torch.where(in_range, x, torch.full_like(x, -1)))
    x = torch.where(in_range, x, torch.zeros_like(x))
    new = in_range & first & (slot_of[x] < 0)

    rank = torch.cumsum(new.to(torch.int64), 0) - 1
    n_new = new.sum().reshape(1)
    # Insertion k lands in slot_for_insertion(k). Pinned insertions (k < num_pinned) never
    # collide; ring insertions do once one call brings more than the ring holds. Then the
    # earliest of them count as inserted and immediately evicted: only the last `ring` stay.
    k = cursor + rank
    ring = capacity - num_pinned
    n_pinned_new = torch.clamp(num_pinned - cursor, min=0)
    n_dropped = torch.clamp(n_new - n_pinned_new - ring, min=0)
    new = new & ((k < num_pinned) | (rank >= n_pinned_new + n_dropped))
    slot = slot_for_insertion(k, capacity, num_pinned)
    slot = torch.where(new, slot, torch.zeros_like(slot))

    # Evict whatever the claimed slots held.
    old = ids[slot]
    evict = new & (old >= 0)
    old = torch.where(evict, old, torch.zeros_like(old))
    _masked_set(slot_of, old, torch.full_like(old, -1, dtype=slot_of.dtype), evict)

    _masked_set(ids, slot, x, new)
    _masked_set(slot_of, x, slot.to(slot_of.dtype), new)
    _masked_set(cache_w, slot, weight[x].to(cache_w.dtype), new)
    if bias is not None:
        _masked_set(cache_b, slot, bias[x].to(cache_b.dtype), new)
    cursor.add_(n_new)


def _observe_rows(token_ids, weight, bias, ids, slot_of, cursor, cache_w, cache_b, num_pinned, rows) -> None:
    """:func:`observe` of each request's grouped ids (:func:`kernels.request_rows.grouped_token_ids`) on its row."""
    check_num_pinned(num_pinned, ids.shape[1])
    rows = rows.reshape(-1).to(device=ids.device, dtype=torch.int64)
    if rows.numel() == 0:
        return
    rows, grouped = RR.grouped_token_ids(token_ids, rows, ids.shape[0])
    state = (ids, slot_of, cursor, cache_w, cache_b)
    for b in range(rows.numel()):  # a later batch row of the same request sees the earlier one's write back
        r = rows[b:b + 1]
        mine = [_row(t, r) for t in state]
        observe(grouped[b], weight, bias, *mine, num_pinned)
        for t, m in zip(state, mine):
            t.index_copy_(0, r, m if t.dim() == 1 else m.unsqueeze(0))


def _row(t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """A copy of row ``r`` ([1] int64 device tensor) of ``t`` (``cursor [R]`` keeps its [1] shape)."""
    got = t.index_select(0, r)
    return got if t.dim() == 1 else got.squeeze(0)


def renew_fed_ids(
    token_ids: torch.Tensor, ids: torch.Tensor, slot_of: torch.Tensor, cursor: torch.Tensor, num_pinned: int,
    rows: torch.Tensor | None = None,
) -> None:
    """Free the slots of the already-active ids of this call that its new ids would evict, so that
    :func:`observe` inserts them again, at the newest end of the ring.

    Without it a token fed again keeps its age, and the same call's new tokens can evict it: a
    call would lose a token it feeds although all its tokens fit. With it, a call whose distinct
    ids fit in the ring leaves every one of them active (a larger call keeps the rule of
    :func:`observe`: the last ones stay). :func:`observe` runs it first; the Triton allocation kernel
    computes the same in its one program (:mod:`kernels.triton_observe`), the host path over Python lists
    (:func:`kernels.host.renewed_slots`): this is the definition they are tested against. Fixed shapes, no host
    sync.

    A ring position ``q`` (insertion ``cursor + q``) is endangered when it holds an id of this call
    and fewer than ``n_new`` unprotected positions precede it: exactly the protected positions
    among the ``n_new + |endangered|`` that the insertions will claim.

    With ``rows`` (request rows, already clamped), ``token_ids [B, L]`` are each batch row's grouped ids
    (:func:`kernels.request_rows.grouped_token_ids`: only the first row of a request holds ids, so the rows write
    disjoint state rows), renewed on all rows at once; the shared set is the case of one row.
    """
    if rows is None:
        token_ids = token_ids.reshape(1, -1)
        rows = torch.zeros(1, dtype=torch.int64, device=ids.device)
        ids, slot_of, cursor = ids.unsqueeze(0), slot_of.unsqueeze(0), cursor.reshape(1)
    capacity, vocab = ids.shape[1], slot_of.shape[1]
    ring = capacity - num_pinned
    grouped = token_ids.to(device=ids.device, dtype=torch.int64)
    if grouped.numel() == 0 or ring <= 0:
        return
    in_range = (grouped >= 0) & (grouped < vocab)
    x = torch.where(in_range, grouped, torch.zeros_like(grouped))
    r = rows[:, None]
    slot = slot_of[r, x].to(torch.int64)
    first = _first_occurrence(torch.where(in_range, x, torch.full_like(x, -1)))
    n_new = (in_range & first & (slot < 0)).sum(1, keepdim=True)
    # protected[b, s]: slot s of row b's request holds an id of this call (a dump entry takes everything else)
    held = torch.where(in_range & (slot >= 0), slot, torch.full_like(slot, capacity))
    protected = torch.zeros(rows.numel(), capacity + 1, dtype=torch.bool, device=ids.device)
    protected.scatter_(1, held, torch.ones_like(held, dtype=torch.bool))
    k = cursor.index_select(0, rows)[:, None] + torch.arange(ring, device=ids.device)
    position = slot_for_insertion(k, capacity, num_pinned)
    at = ids.index_select(0, rows).gather(1, position)
    guarded = protected.gather(1, position) & (at >= 0)
    free = (~guarded).to(torch.int64)
    endangered = guarded & (torch.cumsum(free, 1) - free < n_new)
    endangered = endangered & (n_new + endangered.sum(1, keepdim=True) <= ring)
    mask = endangered.reshape(-1)
    victims = (r * vocab + torch.clamp(at, min=0)).reshape(-1)
    _masked_set(slot_of.view(-1), victims, torch.full_like(victims, -1, dtype=slot_of.dtype), mask)
    places = (r * capacity + position).reshape(-1)
    _masked_set(ids.view(-1), places, torch.full_like(places, -1), mask)


def active_mask(cursor: torch.Tensor, capacity: int) -> torch.Tensor:
    """Bool [C]: which slots hold an active token."""
    return torch.arange(capacity, device=cursor.device) < cursor


def compact_logits(
    x: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, cursor: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ cache_w.T (+ cache_b)`` -> [..., C]; slots past the count are -inf."""
    if rows is not None:
        return _each_row(x, rows, cursor, cache_w.shape[1], lambda xb, q, n: compact_logits(
            xb, _row(cache_w, q), None if cache_b is None else _row(cache_b, q), n))
    out = torch.nn.functional.linear(x, cache_w, cache_b)
    return out.masked_fill(~active_mask(cursor, cache_w.shape[0]), float("-inf"))


def scatter_logits(compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, vocab_size: int,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """Place compact logits [..., C] at their token ids in a [..., V] tensor of -inf."""
    if rows is not None:
        return _each_row(compact, rows, cursor, vocab_size, lambda cb, q, n: scatter_logits(
            cb, _row(ids, q), n, vocab_size))
    valid = active_mask(cursor, ids.numel())
    out = torch.full((*compact.shape[:-1], vocab_size), float("-inf"), dtype=compact.dtype, device=compact.device)
    fallback = torch.full_like(compact.select(-1, 0), float("-inf"))
    idx, src = _redirect_masked(ids, compact, valid, fallback, dim=compact.dim() - 1)
    # scatter_ along the last dim: ~100x faster on CPU than the equivalent out[..., idx] = src.
    return out.scatter_(-1, idx.expand(src.shape), src)


def head_logits(
    x: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, ids: torch.Tensor, cursor: torch.Tensor,
    vocab_size: int, rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scatter_logits(compact_logits(...))`` in one op: the head with no post-ops, [..., V]."""
    return scatter_logits(compact_logits(x, cache_w, cache_b, cursor, rows), ids, cursor, vocab_size, rows)


def padding_ids(ids: torch.Tensor, cursor: torch.Tensor, k: int) -> torch.Tensor:
    """The k smallest token ids that are not active, ascending, int64 [k] (entries past the
    number of inactive ids below k are unspecified and never used).

    Top-k pads with them when fewer than k tokens are active. At most ``count`` active ids
    precede them, so the ``k - count`` that are needed all lie in ``[0, k)``: valid token ids
    whenever ``k <= V``. For ``largest`` they are exactly what a stable sort of the scattered
    logits (-inf at inactive tokens) puts after the active tokens.
    """
    valid = active_mask(cursor, ids.numel())
    # hit[t] for t in [0, k): t is active. Ids >= k (and free slots) all land in a dump entry.
    where = torch.where(valid & (ids < k), ids, torch.full_like(ids, k))
    hit = torch.zeros(k + 1, dtype=torch.int8, device=ids.device).index_fill_(0, where, 1)[:k]
    return torch.argsort(hit, stable=True)  # inactive ids first, ascending


def compact_topk(
    compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, k: int, largest: bool = True,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of compact logits [..., C] over the active slots -> (values [..., k], token ids [..., k]).

    Equals a stable sort of the scattered [..., V] logits restricted to the active set, first k
    (see the tie rule above): descending with NaN first if ``largest``, else ascending with NaN
    last; ties by smaller token id. Slots past the count are ignored whatever ``compact`` holds
    there (post-ops may have turned their -inf into finite values). When fewer than k tokens
    are active (k may exceed the capacity), the missing entries hold the smallest inactive token
    ids in ascending order (:func:`padding_ids`) with value -inf if ``largest`` else +inf: valid
    ids, so a drafter may embed them. Needs ``0 <= k <= V``.
    """
    if k < 0:
        raise ValueError(f"k={k} must be >= 0")
    if rows is not None:
        return _each_row(compact, rows, cursor, k, lambda cb, q, n: compact_topk(cb, _row(ids, q), n, k, largest),
                         (None, torch.int64))
    capacity = ids.numel()
    valid = active_mask(cursor, capacity)
    # Slots in token-id order, inactive last; a stable sort by value then breaks ties by id.
    key = torch.where(valid, ids, torch.full_like(ids, torch.iinfo(torch.int64).max))
    perm = torch.argsort(key, stable=True)
    filler = float("-inf") if largest else float("nan")  # sorts after every active value
    vals = compact.masked_fill(~valid, filler).index_select(-1, perm)
    # The order from an fp32 copy (exact for 16-bit floats): CUDA's sort of bfloat16 ranks NaN below every
    # number (seen on an H200, torch 2.11), against the NaN-largest rule; the values come from ``vals`` itself.
    wide = vals.float() if vals.dtype in (torch.bfloat16, torch.float16) else vals
    order = torch.sort(wide, dim=-1, descending=largest, stable=True).indices
    sorted_vals = vals.gather(-1, order)
    kept = min(k, capacity)
    slot = perm[order[..., :kept]]
    pad = float("-inf") if largest else float("inf")
    if k > kept:  # more than the capacity: the rest is always padding
        shape = (*compact.shape[:-1], k - kept)
        slot = torch.cat([slot, torch.zeros(shape, dtype=slot.dtype, device=slot.device)], -1)
        sorted_vals = torch.cat([sorted_vals[..., :kept], sorted_vals.new_full(shape, pad)], -1)
    position = torch.arange(k, device=ids.device)
    found = position < torch.clamp(cursor, max=capacity)  # the first min(count, k) entries are real
    values = sorted_vals[..., :k].masked_fill(~found, pad)
    fill = padding_ids(ids, cursor, k)[torch.clamp(position - torch.clamp(cursor, max=capacity), min=0)]
    tokens = torch.where(found, ids[slot], fill)
    return values, tokens


def compact_argmax(compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """Token id of the largest active compact logit, [...] int64 (NaN counts as largest).

    Ties go to the smaller token id, as ``torch.argmax`` on the scattered logits returns the first
    maximum; 0 (the smallest inactive id, as :func:`compact_topk` pads) when no token is active,
    which is also what ``torch.argmax`` returns for all -inf logits.
    """
    return compact_topk(compact, ids, cursor, 1, True, rows)[1].squeeze(-1)


def _each_row(lead: torch.Tensor, rows: torch.Tensor, cursor: torch.Tensor, width: int, fn, dtypes=(None,)):
    """``fn(lead row b, request row [1], its count [1])`` for every batch row b of ``lead [..., D]``, stacked to
    ``[..., width]`` (one output per entry of ``dtypes``, None: ``lead``'s dtype). A padding row (outside
    ``[0, R)``) is computed against request row 0 with a count of 0: an empty set."""
    flat, r = RR.flat_rows(lead, rows)
    q, real = RR.real_rows(r, cursor.shape[0])
    count = cursor.index_select(0, q)
    count = torch.where(real, count, torch.zeros_like(count))
    parts = [fn(flat[b], q[b:b + 1], count[b:b + 1]) for b in range(r.numel())]
    outs = [[p] for p in parts] if len(dtypes) == 1 else parts
    stacked = tuple(
        torch.stack([o[i] for o in outs]).reshape(*lead.shape[:-1], width) if outs
        else lead.new_empty((*lead.shape[:-1], width), dtype=dtype or lead.dtype)
        for i, dtype in enumerate(dtypes))
    return stacked[0] if len(dtypes) == 1 else stacked
