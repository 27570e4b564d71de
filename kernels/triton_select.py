"""Triton top-k / argmax over compact logits: the [rows, V] scatter is never built.

One program per row holds the row's active slots in registers and picks k times the best
(class, score, token id): class ranks NaN first (``largest``) or last (smallest), score is the
value (negated for smallest), and among equal values the smaller token id wins - the tie rule
of :mod:`kernels.reference`. k is small for drafting (<= tens), so k passes over a few
thousand registers beat a sort, and it is one launch instead of the reference's several.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from . import reference
from .triton_util import FLOAT_DTYPES

_MAX_BLOCK = 8192  # beyond this a row no longer fits a program's registers: use the reference


@triton.jit
def _topk_kernel(
    src_ptr, ids_ptr, cursor_ptr, val_ptr, tok_ptr, C, K, stride_s,
    LARGEST: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    count = tl.minimum(tl.load(cursor_ptr), C)
    offs = tl.arange(0, BLOCK)
    live = offs < count
    v = tl.load(src_ptr + row * stride_s + offs, mask=live, other=0.0).to(tl.float32)
    tok = tl.load(ids_ptr + offs, mask=live, other=0)
    nan = v != v
    if LARGEST:
        cls = tl.where(nan, 2, 1)
        score = v
        pad = float("-inf")
    else:
        cls = tl.where(nan, 0, 1)
        score = -v
        pad = float("inf")
    cls = tl.where(live, cls, -1)  # -1: not a candidate (inactive or already taken)
    big = tl.full((BLOCK,), 9223372036854775807, tl.int64)
    for j in range(0, K):
        best_cls = tl.max(cls, axis=0)
        cand = cls == best_cls
        best_score = tl.max(tl.where(cand & (cls == 1), score, float("-inf")), axis=0)
        cand = cand & ((cls != 1) | (score == best_score))
        best_tok = tl.min(tl.where(cand, tok.to(tl.int64), big), axis=0)
        found = best_cls >= 0
        sel = cand & (tok == best_tok) & found
        val = tl.sum(tl.where(sel, v, 0.0), axis=0)
        tl.store(val_ptr + row * K + j, tl.where(found, val, pad).to(val_ptr.dtype.element_ty))
        tl.store(tok_ptr + row * K + j, tl.where(found, best_tok, -1))
        cls = tl.where(sel, -1, cls)


def compact_topk(
    compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, k: int, largest: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kernels.reference.compact_topk`."""
    capacity = ids.numel()
    block = triton.next_power_of_2(capacity)
    if compact.dtype not in FLOAT_DTYPES or block > _MAX_BLOCK:
        return reference.compact_topk(compact, ids, cursor, k, largest)
    if not 0 <= k <= capacity:
        raise ValueError(f"k={k} must be in [0, capacity={capacity}]")
    src = compact.reshape(-1, capacity)
    if src.stride(-1) != 1:
        src = src.contiguous()
    rows = src.shape[0]
    values = torch.empty((*compact.shape[:-1], k), dtype=compact.dtype, device=compact.device)
    tokens = torch.empty((*compact.shape[:-1], k), dtype=torch.int64, device=compact.device)
    wrap_triton(_topk_kernel)[(rows,)](
        src, ids, cursor, values, tokens, capacity, k, src.stride(0),
        LARGEST=largest, BLOCK=block, num_warps=8 if block >= 4096 else 4,
    )
    return values, tokens


def compact_argmax(compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`kernels.reference.compact_argmax`."""
    return compact_topk(compact, ids, cursor, 1, largest=True)[1].squeeze(-1)
