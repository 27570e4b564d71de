"""Triton ``observe``: the whole op in two launches, no torch op around them, no host sync.

The launch grid depends only on a bucket of the input length (the next power of two >= 16) and the
length itself is not a specialisation key (``do_not_specialize``), so a changing number of observed ids
reuses the same compiled kernels and the same grid; ids past the real length, or -1, are ignored:

1. ``_observe_alloc_kernel`` (one program) runs :func:`_allocate`: the fed-id renewal
   (:func:`nanospec_fx.kernels.reference.renew_fed_ids`, the definition) and the allocation, in phases
   separated by barriers:

   a. *claim*: an inactive token's ``slot_of`` entry (-1) is lowered with ``atomic_min`` to a negative
      code ``i - n - 1`` of the position ``i`` observing it, so the smallest position - the first
      occurrence - wins, whatever the atomics' order;
   b. *count* the winners (``n_new``: the call's distinct new ids) and the positions holding an active
      ring id (``held``);
   c. *renew* (only when both are non-zero): mark the ring slots held by the call's ids in ``ids`` itself
      (``-2 - token``, never a real entry), scan the ring positions the insertions will claim
      (``cursor + q``, at most ``n_new + held`` of them) with a running count of free positions: a marked
      position with fewer than ``n_new`` free ones before it is endangered; if ``n_new`` plus the endangered
      fit in the ring, those slots are freed (``ids`` -1, ``slot_of`` -1) and their ids claimed again like
      new ones (step a), else every mark is restored;
   d. *allocate* in order of first occurrence: the r-th winner gets insertion number ``cursor + r``
      (a running prefix sum over blocks of positions): exactly the reference's order, so the final state
      is deterministic and equals the reference. It evicts what the slot held, writes ids / slot_of, stores
      each position's slot (or -1) in a scratch array and advances the cursor. A call bringing more new
      ids than the ring holds drops its earliest ring insertions, as the reference does.
2. ``_observe_copy_kernel`` copies the head row and bias entry of every inserted token into its
   cache slot on a 2-D grid (position x chunk of H), so a 4,096-wide row is copied by many
   programs at once instead of one program looping over it.

Every slot is claimed at most once per call, so no store races with another. Loads of state that an
earlier phase wrote (``slot_of`` after the claims, ``ids`` after the marks) are volatile: they must see
those writes, not a stale L1 line.

With ``rows`` (a per-request state) the same two kernels: ``_observe_alloc_rows_kernel`` runs one program per
batch row; the first batch row of each request (its *lead*, found by the program itself) observes the ids of every
batch row of that request, in batch order, into that request's row of the state (:func:`_allocate` reading the
``[B, n]`` ids through the rows: the grouping of :func:`kernels.request_rows.grouped_token_ids`, done in the
kernel); the others do nothing. So no two programs touch one request row, and padding rows (outside ``[0, R)``,
clamped to row 0 as the reference clamps them) contribute no id. The copy kernel then runs over flat ``[R * C, H]``
slot indices.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch.library import wrap_triton

from .schema import check_num_pinned
from .triton_util import contiguous_rows, device_guard

_BLOCK = 1024  # ids per step of the allocation program (the interpreter runs the same size)
_BLOCK_H = 256  # row elements per copy program
_MIN_IDS = 16  # the grid covers max(16, next power of two >= n) positions
#: The fed-id renewal (a constexpr of the allocation kernel); False only in the test that proves the renewal
#: check fails without it.
RENEW = True


def padded_length(n: int) -> int:
    """Positions the launch grid covers for ``n`` ids: one grid (and no recompile) per bucket."""
    return max(_MIN_IDS, triton.next_power_of_2(max(n, 1)))


@triton.jit
def _looked_up(tok_ptr, slot_of_ptr, offs, n, V, rows_ptr, n_row, R, r, GROUPED: tl.constexpr,
               VOLATILE: tl.constexpr):
    """Token ids at ``offs``, their safe indices, which are in range, their ``slot_of`` entries, their claim codes.

    ``GROUPED``: ``tok`` is ``[B, n_row]`` and position p is id ``p % n_row`` of batch row ``p // n_row``, which
    counts only when that row's request (clamped into ``[0, R)``) is ``r`` and is a real row (-1 otherwise)."""
    inb = offs < n
    if GROUPED:
        rq = tl.load(rows_ptr + offs // n_row, mask=inb, other=-1)
        real = (rq >= 0) & (rq < R)
        inb = inb & real & (rq == r)
    x = tl.load(tok_ptr + offs, mask=inb, other=-1).to(tl.int64)
    ok = inb & (x >= 0) & (x < V)
    xs = tl.where(ok, x, 0)
    cur = tl.load(slot_of_ptr + xs, mask=ok, other=0, volatile=VOLATILE)
    code = (offs.to(tl.int64) - n - 1).to(tl.int32)
    return x, xs, ok, cur, code


@triton.jit
def _claim(tok_ptr, slot_of_ptr, n, n_mine, V, rows_ptr, n_row, R, r, GROUPED: tl.constexpr, BLOCK: tl.constexpr):
    """``atomic_min`` each in-range position's code into its token's ``slot_of`` entry where that entry is -1
    (inactive; codes are < -1 and active entries >= 0, so a claim never touches them)."""
    for start in range(0, n_mine, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, xs, ok, cur, code = _looked_up(tok_ptr, slot_of_ptr, offs, n, V, rows_ptr, n_row, R, r, GROUPED, True)
        tl.atomic_min(slot_of_ptr + xs, code, mask=ok & (cur == -1))


@triton.jit
def _allocate(tok_ptr, n, n_mine, ids_ptr, slot_of_ptr, cursor_ptr, dest_ptr, dest_base, V, C, P,
              rows_ptr, n_row, R, r, GROUPED: tl.constexpr, RENEW_IDS: tl.constexpr, BLOCK: tl.constexpr):
    """Observe ``tok[:n]`` into one shared-set state (``ids [C]``, ``slot_of [V]``, ``cursor``): claim, count, renew,
    allocate (the module docstring); ``dest[i]`` gets ``dest_base`` + the slot position i inserted into, or -1 (for
    every i < n that is this program's: all of them, or with ``GROUPED`` those of request ``r``). Returns the new
    cursor (the caller stores it). ``n_mine``: n, or 0 for a program with nothing to do (every loop runs zero
    times)."""
    cursor0 = tl.load(cursor_ptr)
    ring = C - P
    head = tl.where(cursor0 < C, cursor0, P + (cursor0 - P) % ring)  # ring position 0: the next insertion's slot

    # a. claim the inactive tokens
    _claim(tok_ptr, slot_of_ptr, n, n_mine, V, rows_ptr, n_row, R, r, GROUPED, BLOCK)
    tl.debug_barrier()

    # b. count the winners (distinct new ids) and the positions holding an active ring id
    n_new = tl.zeros((), dtype=tl.int64)
    n_held = tl.zeros((), dtype=tl.int64)
    for start in range(0, n_mine, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, xs, ok, cur, code = _looked_up(tok_ptr, slot_of_ptr, offs, n, V, rows_ptr, n_row, R, r, GROUPED, True)
        n_new += tl.sum((ok & (cur == code)).to(tl.int64), axis=0)
        n_held += tl.sum((ok & (cur >= P)).to(tl.int64), axis=0)

    # c. renew the call's active ids that its new ids would evict (reference.renew_fed_ids)
    n_renewed = tl.zeros((), dtype=tl.int64)
    if RENEW_IDS:
        renewing = tl.where((n_new > 0) & (n_held > 0), n_mine, 0)
        for start in range(0, renewing, BLOCK):  # mark: ids[slot] = -2 - token for every held ring slot
            offs = start + tl.arange(0, BLOCK)
            x, xs, ok, cur, code = _looked_up(tok_ptr, slot_of_ptr, offs, n, V, rows_ptr, n_row, R, r, GROUPED,
                                              True)
            held = ok & (cur >= P)
            tl.store(ids_ptr + tl.where(held, cur, 0), -2 - x, mask=held)
        tl.debug_barrier()
        # scan the ring positions the insertions claim: endangered = marked with < n_new free positions before
        scan_end = tl.where(renewing > 0, tl.minimum(n_new + n_held, ring), 0)
        free_seen = tl.zeros((), dtype=tl.int64)
        for start in range(0, scan_end, BLOCK):
            q = start + tl.arange(0, BLOCK).to(tl.int64)
            inq = q < scan_end
            k = cursor0 + q
            pos = tl.where(k < C, k, P + (k - P) % ring)
            at = tl.load(ids_ptr + tl.where(inq, pos, 0), mask=inq, other=-1, volatile=True)
            guarded = inq & (at <= -2)
            free = (inq & (at > -2)).to(tl.int64)
            free_before = free_seen + tl.cumsum(free, axis=0) - free
            n_renewed += tl.sum((guarded & (free_before < n_new)).to(tl.int64), axis=0)
            free_seen += tl.sum(free, axis=0)
        # the endangered are the marked positions among the first n_new + n_renewed; renewed only if all fit
        fits = n_new + n_renewed <= ring
        n_renewed = tl.where(fits, n_renewed, 0)
        limit = tl.where(fits, n_new + n_renewed, 0)
        for start in range(0, renewing, BLOCK):  # free the endangered slots, restore every other mark
            offs = start + tl.arange(0, BLOCK)
            x, xs, ok, cur, code = _looked_up(tok_ptr, slot_of_ptr, offs, n, V, rows_ptr, n_row, R, r, GROUPED,
                                              True)
            held = ok & (cur >= P)
            d = cur.to(tl.int64) - head
            q = tl.where(d < 0, d + ring, d)
            renewed = held & (q < limit)
            tl.store(ids_ptr + tl.where(held, cur, 0), tl.where(renewed, -1, x), mask=held)
            tl.store(slot_of_ptr + xs, tl.full((BLOCK,), -1, tl.int32), mask=renewed)
        tl.debug_barrier()
        # a renewed id is inactive now (-1): claimed again, first occurrence first, among the new ones
        _claim(tok_ptr, slot_of_ptr, n, tl.where(n_renewed > 0, n_mine, 0), V, rows_ptr, n_row, R, r, GROUPED, BLOCK)
    tl.debug_barrier()

    # d. allocate in order of first occurrence. A winner's entry is written only by its own lane; evicted
    # tokens were active before the call (or renewed and so winners themselves: their slot is free).
    n_pinned_new = tl.maximum(P - cursor0, 0)
    n_dropped = tl.maximum(n_new + n_renewed - n_pinned_new - ring, 0)
    done = tl.zeros((), dtype=tl.int64)
    for start in range(0, n_mine, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, xs, ok, cur, code = _looked_up(tok_ptr, slot_of_ptr, offs, n, V, rows_ptr, n_row, R, r, GROUPED, True)
        first = ok & (cur == code)
        f = first.to(tl.int64)
        rank = done + tl.cumsum(f, axis=0) - 1
        k = cursor0 + rank
        keep = first & ((k < P) | (rank >= n_pinned_new + n_dropped))
        slot = tl.where(k < C, k, P + (k - P) % ring)
        slot = tl.where(keep, slot, 0)
        old = tl.load(ids_ptr + slot, mask=keep, other=-1, volatile=True)
        evict = keep & (old >= 0)
        tl.store(slot_of_ptr + tl.where(evict, old, 0), tl.full((BLOCK,), -1, tl.int32), mask=evict)
        tl.store(ids_ptr + slot, x, mask=keep)
        tl.store(slot_of_ptr + xs, slot.to(tl.int32), mask=keep)
        tl.store(slot_of_ptr + xs, tl.full((BLOCK,), -1, tl.int32), mask=first & ~keep)
        if GROUPED:  # only this request's positions: another program writes the others
            rq = tl.load(rows_ptr + offs // n_row, mask=offs < n, other=-1)
            mine = (offs < n) & (tl.where((rq >= 0) & (rq < R), rq, 0) == r)
        else:
            mine = offs < n
        tl.store(dest_ptr + offs, tl.where(keep, dest_base + slot, -1), mask=mine)
        done += tl.sum(f, axis=0)
    return cursor0 + done


@triton.jit(do_not_specialize=["n"])
def _observe_alloc_kernel(
    tok_ptr, n, ids_ptr, slot_of_ptr, cursor_ptr, dest_ptr, V, C, P, RENEW_IDS: tl.constexpr, BLOCK: tl.constexpr,
):
    new_cursor = _allocate(tok_ptr, n, n, ids_ptr, slot_of_ptr, cursor_ptr, dest_ptr, 0, V, C, P,
                           tok_ptr, 1, 1, 0, False, RENEW_IDS, BLOCK)
    tl.store(cursor_ptr, new_cursor)


@triton.jit(do_not_specialize=["n", "n_row", "B"])
def _observe_alloc_rows_kernel(
    tok_ptr, rows_ptr, B, n_row, ids_ptr, slot_of_ptr, cursor_ptr, dest_ptr, R, V, C, P,
    RENEW_IDS: tl.constexpr, BLOCK: tl.constexpr,
):
    # Program b: batch row b. Its request row r (clamped into [0, R), as the reference clamps a padding row); the
    # lead (no earlier batch row of r) observes the ids of every batch row of r, in batch order; the others: nothing.
    b = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + b).to(tl.int64)
    r = tl.where((r >= 0) & (r < R), r, 0)
    earlier = tl.zeros((), dtype=tl.int64)
    for start in range(0, b, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ro = tl.load(rows_ptr + offs, mask=offs < b, other=-1)
        ro = tl.where((ro >= 0) & (ro < R), ro, 0)
        earlier += tl.sum(((offs < b) & (ro == r)).to(tl.int64), axis=0)
    lead = earlier == 0
    n = B.to(tl.int64) * n_row  # int64: the check of compile_check (B x n ids can pass 2^31 in principle)
    new_cursor = _allocate(tok_ptr, n, tl.where(lead, n, 0), ids_ptr + r * C, slot_of_ptr + r * V, cursor_ptr + r,
                           dest_ptr, r * C, V, C, P, rows_ptr, n_row, R, r, True, RENEW_IDS, BLOCK)
    tl.store(cursor_ptr + r, new_cursor, mask=lead)


@triton.jit(do_not_specialize=["n"])
def _observe_copy_kernel(
    tok_ptr, dest_ptr, n, w_ptr, b_ptr, cw_ptr, cb_ptr, H, stride_wv, stride_b, stride_cw,
    HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # Program (i, j) copies elements [j * BLOCK_H, (j + 1) * BLOCK_H) of position i's row;
    # positions past n (the grid's padding) and positions that inserted nothing do nothing.
    i = tl.program_id(0)
    j = tl.program_id(1)
    inb = i < n
    slot = tl.load(dest_ptr + i, mask=inb, other=-1)
    keep = slot >= 0
    x = tl.load(tok_ptr + i, mask=keep, other=0).to(tl.int64)
    slot = tl.where(keep, slot, 0)
    offs = j.to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = offs < tl.where(keep, H, 0)  # nothing to copy: an empty mask
    row = tl.load(w_ptr + x * stride_wv + offs, mask=m)
    tl.store(cw_ptr + slot * stride_cw + offs, row.to(cw_ptr.dtype.element_ty), mask=m)
    if HAS_BIAS:
        first = keep & (j == 0)
        b = tl.load(b_ptr + x * stride_b, mask=first)
        tl.store(cb_ptr + slot, b.to(cb_ptr.dtype.element_ty), mask=first)


def _token_ids(token_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``token_ids`` as the kernels read them: int32 or int64, contiguous, on ``device`` (no copy when it is)."""
    tok = token_ids.to(device)
    if tok.dtype not in (torch.int32, torch.int64):
        tok = tok.to(torch.int64)
    return tok.contiguous()


def observe(
    token_ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, slot_of: torch.Tensor,
    cursor: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor, num_pinned: int,
    rows: torch.Tensor | None = None,
) -> None:
    """Same contract as :func:`nanospec_fx.kernels.reference.observe`, fed-id renewal included: two launches
    (allocation with the renewal, row copy) and no torch compute op (only the scratch ``torch.empty``)."""
    if rows is not None:
        return _observe_rows(token_ids, weight, bias, ids, slot_of, cursor, cache_w, cache_b, num_pinned, rows)
    capacity, vocab = ids.numel(), slot_of.numel()
    check_num_pinned(num_pinned, capacity)
    tok = _token_ids(token_ids.reshape(-1), ids.device)
    n = tok.numel()
    grid = padded_length(n)
    dest = torch.empty(grid, dtype=torch.int64, device=ids.device)
    with device_guard(ids):
        wrap_triton(_observe_alloc_kernel)[(1,)](
            tok, n, ids, slot_of, cursor, dest, vocab, capacity, num_pinned, RENEW_IDS=RENEW, BLOCK=_BLOCK,
        )
        for rows_of, cached in _row_slices(weight, cache_w):
            launch_copy(tok, dest, n, grid, rows_of, bias, cached, cache_b)


def _row_slices(weight: torch.Tensor, cache_w: torch.Tensor):
    """``(weight [V, H] with contiguous rows, cache_w [C, H])`` pairs the copy kernel fills: the head itself, or, for
    K heads stacked in one weight (``weight`` [V, K, H], ``cache_w`` [C, K, H]), each head's slice (one launch per
    head; a slice of the cache is [C, H] with a row stride of K * H, which the kernel takes)."""
    if weight.dim() == 2:
        return [(contiguous_rows(weight), cache_w)]  # a transposed/tied head: copied once, not read strided per call
    return [(contiguous_rows(weight[:, k]), cache_w[:, k]) for k in range(weight.shape[1])]


def _observe_rows(token_ids, weight, bias, ids, slot_of, cursor, cache_w, cache_b, num_pinned, rows) -> None:
    requests, capacity = ids.shape
    check_num_pinned(num_pinned, capacity)
    rows = _token_ids(rows.reshape(-1), ids.device)
    batch = rows.numel()
    if batch == 0 or token_ids.numel() == 0:
        return
    tok = _token_ids(token_ids.reshape(batch, -1), ids.device)  # [B, n]: batch row b's ids
    n = tok.numel()
    grid = padded_length(n)  # one copy grid (and no recompile) per bucket of ids
    dest = torch.empty(grid, dtype=torch.int64, device=ids.device)
    weight = contiguous_rows(weight)
    flat_w, flat_b = cache_w.view(-1, weight.shape[1]), cache_b.view(-1)  # dest holds flat slots of [R * C, H]
    with device_guard(ids):
        wrap_triton(_observe_alloc_rows_kernel)[(batch,)](
            tok, rows, batch, tok.shape[1], ids, slot_of, cursor, dest, requests, slot_of.shape[1], capacity,
            num_pinned, RENEW_IDS=RENEW, BLOCK=_BLOCK,
        )
        launch_copy(tok, dest, n, grid, weight, bias, flat_w, flat_b)


def launch_copy(tok, dest, n: int, rows: int, weight, bias, cache_w, cache_b) -> None:
    """Launch ``_observe_copy_kernel``: head row (and bias entry) of ``tok[i]`` into row ``dest[i]`` of ``cache_w``
    [S, H] (``cache_b`` [S]) for every i < n with ``dest[i] >= 0``, on a grid of ``rows`` positions x chunks of H.
    ``weight`` must have contiguous rows."""
    hidden = weight.shape[1]
    block_h = min(_BLOCK_H, triton.next_power_of_2(hidden))
    has_bias = bias is not None
    b = bias if has_bias else cache_b
    wrap_triton(_observe_copy_kernel)[(rows, triton.cdiv(hidden, block_h))](
        tok, dest, n, weight, b, cache_w, cache_b, hidden, weight.stride(0), b.stride(0), cache_w.stride(0),
        HAS_BIAS=has_bias, BLOCK_H=block_h,
    )
