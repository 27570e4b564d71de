"""Triton ``observe``: device-side de-duplication, slot allocation and row copy.

Two launches, no host sync, and a launch grid that depends only on a bucket of the input
length (the next power of two >= 16): ids past the real length read as -1 (ignored), and the
length itself is not a specialisation key (``do_not_specialize``), so a changing number of
observed ids reuses the same compiled kernels and the same grid:

1. ``_observe_alloc_kernel`` (one program). It first *claims* each new token in the
   membership map itself: an inactive token's ``slot_of`` entry (-1) is lowered with
   ``atomic_min`` to a negative code ``i - n - 1`` of the position ``i`` observing it, so the
   smallest position - the first occurrence - wins, whatever the atomics' order. After a
   barrier it walks the positions in blocks, keeps a running count of the winners (a prefix
   sum), and gives the r-th winner insertion number ``cursor + r``: exactly the reference's
   order of first occurrence, so the final state is deterministic and equals the reference.
   It evicts what the slot held, writes ids / slot_of, and stores each position's slot (or -1)
   in a scratch array; finally it advances the cursor. The pass that counts the winners first
   (needed only when a call can bring more new ids than the ring holds) is skipped otherwise,
   so the usual call makes two passes over the ids, not three.
2. ``_observe_copy_kernel`` copies the head row and bias entry of every inserted token into its
   cache slot on a 2-D grid (position x chunk of H), so a 4,096-wide row is copied by many
   programs at once instead of one program looping over it.

Every slot is claimed at most once per call (the reference drops the earliest ring insertions
of an overflowing call), so no store races with another. Loads of ``slot_of`` after the
claims are volatile: they must see the atomics' results, not a stale L1 line.

With ``rows`` (a per-request state): the fed-id renewal in plain torch for all rows at once, then
``_observe_alloc_rows_kernel`` (one program per batch row; only the first batch row of each request works, so no
two programs touch one request row) - the same allocation (``_allocate``) on that request's row of the state - and
the same copy kernel over flat ``[R * C, H]`` slot indices. Padding rows' ids are dropped on the device
(:func:`kernels.request_rows.grouped_token_ids`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from torch.library import wrap_triton

from . import reference
from . import request_rows as RR
from .schema import check_num_pinned
from .triton_util import contiguous_rows, device_guard

_BLOCK = 1024  # ids per step of the allocation program (the interpreter runs the same size)
_BLOCK_H = 256  # row elements per copy program
_MIN_IDS = 16  # the grid covers max(16, next power of two >= n) positions


def padded_length(n: int) -> int:
    """Positions the launch grid covers for ``n`` ids: one grid (and no recompile) per bucket."""
    return max(_MIN_IDS, triton.next_power_of_2(max(n, 1)))


@triton.jit
def _looked_up(tok_ptr, slot_of_ptr, offs, n, V, VOLATILE: tl.constexpr):
    """Token ids at ``offs``, their safe indices, which are in range, their ``slot_of`` entries, their claim codes."""
    inb = offs < n
    x = tl.load(tok_ptr + offs, mask=inb, other=-1).to(tl.int64)
    ok = inb & (x >= 0) & (x < V)
    xs = tl.where(ok, x, 0)
    cur = tl.load(slot_of_ptr + xs, mask=ok, other=0, volatile=VOLATILE)
    code = (offs.to(tl.int64) - n - 1).to(tl.int32)
    return x, xs, ok, cur, code


@triton.jit
def _claimed(tok_ptr, slot_of_ptr, offs, n, V):
    """Token ids at ``offs``, their safe indices, and which positions won their token's claim."""
    x, xs, ok, cur, code = _looked_up(tok_ptr, slot_of_ptr, offs, n, V, True)
    return x, xs, ok & (cur == code)


@triton.jit
def _allocate(tok_ptr, n, n_mine, ids_ptr, slot_of_ptr, cursor_ptr, dest_ptr, dest_base, V, C, P, BLOCK: tl.constexpr):
    """Observe ``tok[:n]`` into one shared-set state (``ids [C]``, ``slot_of [V]``, ``cursor``): claim, count,
    allocate; ``dest[i]`` gets ``dest_base`` + the slot position i inserted into, or -1. Returns the new cursor
    (the caller stores it). ``n_mine``: n, or 0 for a program with nothing to do (every loop runs zero times)."""
    # Phase 1: claim. Active entries (>= 0) do not change in this phase, so a plain load
    # tells them apart; codes are < -1, so they never look active or empty.
    for start in range(0, n_mine, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, xs, ok, cur, code = _looked_up(tok_ptr, slot_of_ptr, offs, n, V, False)
        tl.atomic_min(slot_of_ptr + xs, code, mask=ok & (cur < 0))
    tl.debug_barrier()

    # Phase 2a: how many winners, needed before allocating only when the call may overflow the
    # ring (an overflowing call drops its earliest ring insertions). With n <= ring nothing is
    # ever dropped, and the pass is skipped (the usual case: a few ids per draft step).
    cursor0 = tl.load(cursor_ptr)
    ring = C - P
    n_pinned_new = tl.maximum(P - cursor0, 0)
    n_new = tl.zeros((), dtype=tl.int64)
    for start in range(0, tl.where(n_mine > ring, n_mine, 0), BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, xs, first = _claimed(tok_ptr, slot_of_ptr, offs, n, V)
        n_new += tl.sum(first.to(tl.int64), axis=0)
    n_dropped = tl.maximum(n_new - n_pinned_new - ring, 0)

    # Phase 2b: allocate in order of first occurrence. A winner's entry is written only by
    # its own lane; evicted tokens were active before the call, so never a winner.
    done = tl.zeros((), dtype=tl.int64)
    for start in range(0, n_mine, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < n
        x, xs, first = _claimed(tok_ptr, slot_of_ptr, offs, n, V)
        f = first.to(tl.int64)
        rank = done + tl.cumsum(f, axis=0) - 1
        k = cursor0 + rank
        keep = first & ((k < P) | (rank >= n_pinned_new + n_dropped))
        slot = tl.where(k < C, k, P + (k - P) % ring)
        slot = tl.where(keep, slot, 0)
        old = tl.load(ids_ptr + slot, mask=keep, other=-1)
        evict = keep & (old >= 0)
        tl.store(slot_of_ptr + tl.where(evict, old, 0), tl.full((BLOCK,), -1, tl.int32), mask=evict)
        tl.store(ids_ptr + slot, x, mask=keep)
        tl.store(slot_of_ptr + xs, slot.to(tl.int32), mask=keep)
        tl.store(slot_of_ptr + xs, tl.full((BLOCK,), -1, tl.int32), mask=first & ~keep)
        tl.store(dest_ptr + offs, tl.where(keep, dest_base + slot, -1), mask=inb)
        done += tl.sum(f, axis=0)
    return cursor0 + done


@triton.jit(do_not_specialize=["n"])
def _observe_alloc_kernel(
    tok_ptr, n, ids_ptr, slot_of_ptr, cursor_ptr, dest_ptr, V, C, P, BLOCK: tl.constexpr,
):
    tl.store(cursor_ptr, _allocate(tok_ptr, n, n, ids_ptr, slot_of_ptr, cursor_ptr, dest_ptr, 0, V, C, P, BLOCK))


@triton.jit(do_not_specialize=["n"])
def _observe_alloc_rows_kernel(
    tok_ptr, rows_ptr, lead_ptr, n, ids_ptr, slot_of_ptr, cursor_ptr, dest_ptr, V, C, P, BLOCK: tl.constexpr,
):
    # Program b allocates batch row b's grouped ids (tok[b, :n]) in request row rows[b] with the shared set's
    # allocation (_allocate, on that row of the state); a batch row that is not the first of its request has
    # nothing to do (its loops run zero times, its cursor store is masked).
    b = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + b).to(tl.int64)
    lead = tl.load(lead_ptr + b) != 0
    mine = tl.where(lead, n, 0)
    new_cursor = _allocate(tok_ptr + b * n, n, mine, ids_ptr + r * C, slot_of_ptr + r * V, cursor_ptr + r,
                           dest_ptr + b * n, r * C, V, C, P, BLOCK)  # dest: flat slots of [R * C, H]
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


def observe(
    token_ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, slot_of: torch.Tensor,
    cursor: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor, num_pinned: int, rows: torch.Tensor | None = None,
) -> None:
    """Same contract as :func:`nanospec_fx.kernels.reference.observe`, fed-id renewal included
    (:func:`~nanospec_fx.kernels.reference.renew_fed_ids`: plain torch, fixed shapes, no sync)."""
    if rows is not None:
        return _observe_rows(token_ids, weight, bias, ids, slot_of, cursor, cache_w, cache_b, num_pinned, rows)
    capacity, vocab = ids.numel(), slot_of.numel()
    check_num_pinned(num_pinned, capacity)
    reference.renew_fed_ids(token_ids, ids, slot_of, cursor, num_pinned)
    tok = token_ids.reshape(-1).to(ids.device)
    if tok.dtype not in (torch.int32, torch.int64):
        tok = tok.to(torch.int64)
    tok = tok.contiguous()
    n = tok.numel()
    rows = padded_length(n)
    dest = torch.empty(rows, dtype=torch.int64, device=ids.device)
    weight = contiguous_rows(weight)  # a transposed/tied head: copied once, not read strided per call
    with device_guard(ids):
        wrap_triton(_observe_alloc_kernel)[(1,)](
            tok, n, ids, slot_of, cursor, dest, vocab, capacity, num_pinned, BLOCK=_BLOCK,
        )
        launch_copy(tok, dest, n, rows, weight, bias, cache_w, cache_b)


def _observe_rows(token_ids, weight, bias, ids, slot_of, cursor, cache_w, cache_b, num_pinned, rows) -> None:
    requests, capacity = ids.shape
    check_num_pinned(num_pinned, capacity)
    rows = rows.reshape(-1).to(device=ids.device, dtype=torch.int64).contiguous()
    batch = rows.numel()
    if batch == 0 or token_ids.numel() == 0:
        return
    rows, grouped = RR.grouped_token_ids(token_ids, rows, requests)
    reference.renew_fed_ids(grouped, ids, slot_of, cursor, num_pinned, rows)
    n = padded_length(grouped.shape[1])  # one grid (and no recompile) per bucket of ids per row
    tok = torch.full((batch, n), -1, dtype=torch.int64, device=ids.device)
    tok[:, : grouped.shape[1]] = grouped
    lead = RR.lead_rows(rows).to(torch.int8)
    dest = torch.full((batch * n,), -1, dtype=torch.int64, device=ids.device)
    weight = contiguous_rows(weight)
    flat_w, flat_b = cache_w.view(-1, weight.shape[1]), cache_b.view(-1)  # dest holds flat slots of [R * C, H]
    with device_guard(ids):
        wrap_triton(_observe_alloc_rows_kernel)[(batch,)](
            tok, rows, lead, n, ids, slot_of, cursor, dest, slot_of.shape[1], capacity, num_pinned, BLOCK=_BLOCK,
        )
        launch_copy(tok, dest, batch * n, batch * n, weight, bias, flat_w, flat_b)


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
