"""Triton top-k / argmax over compact logits: the [rows, V] scatter is never built.

One program per row holds the row's active slots in registers as int64 keys - an
order-preserving image of the value (negated for smallest; NaN first if ``largest``, last
otherwise) in the high half, the complement of the token id in the low half - and takes k
times the maximum key. One reduction per pick yields both the best value and, among equal
values, the smaller token id: the tie rule of :mod:`nanospec_fx.kernels.reference`. k is small for
drafting (<= tens), so k reductions over a few thousand registers beat a sort, in one launch.
When fewer than k tokens are active, the rest are padded as the reference pads them: the
smallest inactive token ids, ascending, with value -inf (largest) or +inf (found by a short scan
that runs only for padded entries). With ``rows`` (a per-request state) the same kernel reads each row's
request's ids and count, gathered on the device (:func:`kernels.triton_head.row_state`; a padding row: count 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from . import reference
from .triton_head import per_row, row_state
from .triton_util import FLOAT_DTYPES, device_guard

_MAX_BLOCK = 8192  # beyond this a row no longer fits a program's registers: use the reference


@triton.jit
def _topk_kernel(
    src_ptr, ids_ptr, cursor_ptr, val_ptr, tok_ptr, C, K, stride_s, stride_ids, stride_cursor,
    LARGEST: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * stride: int64 like every other kernel
    # Per-request top-k (rows given) gives each row its own ids and cursor; shared: strides 0.
    ids_ptr += row * stride_ids
    cursor_ptr += row * stride_cursor
    count = tl.minimum(tl.load(cursor_ptr), C)
    offs = tl.arange(0, BLOCK)
    live = offs < count
    v = tl.load(src_ptr + row * stride_s + offs, mask=live, other=0.0).to(tl.float32)
    tok = tl.load(ids_ptr + offs, mask=live, other=0).to(tl.int64)
    nan = v != v
    score = v if LARGEST else -v
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 ties with +0.0, as in a sort
    # Order-preserving map of the fp32 score to [0, 2^32); NaN above everything (largest) or
    # below everything (smallest).
    b = score.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    ordered = tl.where(b < 0x80000000, b + 0x80000000, 0xFFFFFFFF - b)
    ordered = tl.where(nan, 0xFFFFFFFF if LARGEST else 0, ordered)
    # One int64 key per slot: score in the high half, (2^32 - 1 - token) in the low half, so one
    # max-reduction picks the best value and, among equal values, the smallest token id.
    dead = -9223372036854775808
    key = (ordered - 0x80000000) * 4294967296 + (0xFFFFFFFF - tok)
    key = tl.where(live, key, dead)
    pad = float("-inf") if LARGEST else float("inf")
    nxt = (row * 0).to(tl.int64)  # next padding candidate: padding ids are the smallest inactive ids
    for j in range(0, K):
        best = tl.max(key, axis=0)
        found = best != dead
        best_tok = 0xFFFFFFFF - (best & 0xFFFFFFFF)
        best_ord = (best >> 32) + 0x80000000
        bits = tl.where(best_ord >= 0x80000000, best_ord - 0x80000000, 0xFFFFFFFF - best_ord)
        best_score = bits.to(tl.int32).to(tl.float32, bitcast=True)
        val = best_score if LARGEST else -best_score
        val = tl.where(best_ord == (0xFFFFFFFF if LARGEST else 0), float("nan"), val)
        tl.store(val_ptr + row * K + j, tl.where(found, val, pad).to(val_ptr.dtype.element_ty))
        # Nothing left: pad with the smallest inactive id >= nxt (found entries all come first).
        busy = (best == dead) & (tl.sum(tl.where(live & (tok == nxt), 1, 0), axis=0) > 0)
        while busy:
            nxt += 1
            busy = tl.sum(tl.where(live & (tok == nxt), 1, 0), axis=0) > 0
        tl.store(tok_ptr + row * K + j, tl.where(found, best_tok, nxt))
        nxt = tl.where(found, nxt, nxt + 1)
        key = tl.where(key == best, dead, key)


def topk_num_warps(block: int) -> int:
    """Warps per top-k program for a row of ``block`` slots (compile_check builds the same)."""
    return 8 if block >= 4096 else 4


def compact_topk(
    compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, k: int, largest: bool = True,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`nanospec_fx.kernels.reference.compact_topk`."""
    capacity = ids.shape[-1]
    block = triton.next_power_of_2(capacity)
    if compact.dtype not in FLOAT_DTYPES or block > _MAX_BLOCK:
        return reference.compact_topk(compact, ids, cursor, k, largest, rows)
    if k < 0:
        raise ValueError(f"k={k} must be >= 0")
    src, r = per_row(compact, rows)
    values = torch.empty((*compact.shape[:-1], k), dtype=compact.dtype, device=compact.device)
    tokens = torch.empty((*compact.shape[:-1], k), dtype=torch.int64, device=compact.device)
    if values.numel():
        ids, cursor, stride_ids, stride_cursor = row_state(r, ids, cursor)
        with device_guard(compact):
            wrap_triton(_topk_kernel)[(src.shape[0],)](
                src, ids, cursor, values, tokens, capacity, k, src.stride(0), stride_ids, stride_cursor,
                LARGEST=largest, BLOCK=block, num_warps=topk_num_warps(block),
            )
    return values, tokens


def compact_argmax(compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as :func:`nanospec_fx.kernels.reference.compact_argmax`."""
    return compact_topk(compact, ids, cursor, 1, True, rows)[1].squeeze(-1)
