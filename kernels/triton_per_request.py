"""Triton per-request ops: each batch row against the active set of its own request row.

* ``_head_rows_kernel``: one program per (batch row, block of slots); it reads ``rows[b]``, that request's
  count and cached rows, and skips every slot block past the count (cost follows |A| of the request, not the
  capacity). Rows of one batch do not share a cache, so there is no 16-row ``tl.dot`` tile: the product is a
  register FMA over H in ``BLOCK_K`` steps (the ``USE_DOT=False`` form of :mod:`kernels.triton_head`). Rows of
  one request reread the same cached rows (from L2 on a GPU). With ``SCATTER`` the logits go straight to their
  token ids in a [B, V] output pre-filled with -inf.
* scatter and top-k reuse the shared-set kernels with per-row ids/cursor strides, on ``ids[rows]`` and
  ``cursor[rows]`` gathered on the device (B x C int64: small next to the head).
* observe: the fed-id renewal in plain torch for all rows at once
  (:func:`kernels.reference_per_request.renew_fed_ids_per_request`), then ``_observe_alloc_rows_kernel`` (one
  program per batch row; only the first batch row of each request works, so no two programs touch one request
  row) - the allocation of :mod:`kernels.triton_observe` (``_allocate``) on that request's row of the state -
  and the shared copy kernel over flat ``[R * C, H]`` slot indices.

No host sync anywhere: ``rows`` and the counts are read by the kernels. Launch grids depend on B, C, H and a
power-of-two bucket of the ids per row only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from . import reference_per_request as RP
from .schema import check_num_pinned
from .triton_head import _scatter_kernel
from .triton_observe import _BLOCK, _allocate, launch_copy, padded_length
from .triton_select import _MAX_BLOCK, _topk_kernel, topk_num_warps
from .triton_util import FLOAT_DTYPES, contiguous_rows, device_guard

_BLOCK_C = 32
_BLOCK_K = 64
_SCATTER_BLOCK = 1024


@triton.jit
def _head_rows_kernel(
    x_ptr, rows_ptr, w_ptr, b_ptr, cursor_ptr, ids_ptr, out_ptr,
    C, H, V, stride_xm, stride_wr, stride_wc, stride_br, stride_ir, stride_om,
    HAS_BIAS: tl.constexpr, SCATTER: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_c = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)  # int64: m * V, r * C * H can pass 2^31
    r = tl.load(rows_ptr + m).to(tl.int64)
    count = tl.minimum(tl.load(cursor_ptr + r), C)
    offs_c = pid_c.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    live = offs_c < count
    acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
    k_end = tl.where(pid_c * BLOCK_C < count, H, 0)  # blocks past this request's count read nothing
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        a = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + r * stride_wr + offs_c[:, None] * stride_wc + offs_k[None, :],
                    mask=live[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * a[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + r * stride_br + offs_c, mask=live, other=0.0).to(tl.float32)
    acc = tl.where(live, acc, float("-inf"))
    out = acc.to(out_ptr.dtype.element_ty)
    if SCATTER:
        tok = tl.load(ids_ptr + r * stride_ir + offs_c, mask=live, other=0)
        ok = live & (tok >= 0) & (tok < V)
        tl.store(out_ptr + m * stride_om + tl.where(ok, tok, 0), out, mask=ok)
    else:
        tl.store(out_ptr + m * stride_om + offs_c, out, mask=offs_c < C)


@triton.jit(do_not_specialize=["n"])
def _observe_alloc_rows_kernel(
    tok_ptr, rows_ptr, lead_ptr, n, ids_ptr, slot_of_ptr, cursor_ptr, dest_ptr, V, C, P, BLOCK: tl.constexpr,
):
    # Program b allocates batch row b's grouped ids (tok[b, :n]) in request row rows[b] with the shared set's
    # allocation (triton_observe._allocate, on that row of the state); a batch row that is not the first of its
    # request has nothing to do (its loops run zero times, its cursor store is masked).
    b = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + b).to(tl.int64)
    lead = tl.load(lead_ptr + b) != 0
    mine = tl.where(lead, n, 0)
    new_cursor = _allocate(tok_ptr + b * n, n, mine, ids_ptr + r * C, slot_of_ptr + r * V, cursor_ptr + r,
                           dest_ptr + b * n, r * C, V, C, P, BLOCK)  # dest: flat slots of [R * C, H]
    tl.store(cursor_ptr + r, new_cursor, mask=lead)


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
    requests, capacity = ids.shape
    check_num_pinned(num_pinned, capacity)
    rows = rows.reshape(-1).to(device=ids.device, dtype=torch.int64).contiguous()
    batch = rows.numel()
    if batch == 0 or token_ids.numel() == 0:
        return
    grouped = RP.grouped_token_ids(token_ids, rows)
    RP.renew_fed_ids_per_request(grouped, rows, ids, slot_of, cursor, num_pinned)
    n = padded_length(grouped.shape[1])  # one grid (and no recompile) per bucket of ids per row
    tok = torch.full((batch, n), -1, dtype=torch.int64, device=ids.device)
    tok[:, : grouped.shape[1]] = grouped
    lead = RP.lead_rows(rows).to(torch.int8)
    dest = torch.full((batch * n,), -1, dtype=torch.int64, device=ids.device)
    weight = contiguous_rows(weight)
    flat_w, flat_b = cache_w.view(-1, weight.shape[1]), cache_b.view(-1)  # dest holds flat slots of [R * C, H]
    with device_guard(ids):
        wrap_triton(_observe_alloc_rows_kernel)[(batch,)](
            tok, rows, lead, n, ids, slot_of, cursor, dest, slot_of.shape[1], capacity, num_pinned, BLOCK=_BLOCK,
        )
        launch_copy(tok, dest, batch * n, batch * n, weight, bias, flat_w, flat_b)


def _supported(x, cache_w, cache_b) -> bool:
    return (x.dtype in FLOAT_DTYPES and cache_w.dtype == x.dtype and cache_w.is_contiguous()
            and (cache_b is None or cache_b.is_contiguous()))


def _launch_head(x2, rows, cache_w, cache_b, cursor, ids, out2, vocab_size: int, scatter: bool) -> None:
    batch, hidden = x2.shape
    requests, capacity = cache_w.shape[:2]
    has_bias = cache_b is not None
    bias = cache_b if has_bias else cache_w
    grid = (triton.cdiv(capacity, _BLOCK_C), batch)
    wrap_triton(_head_rows_kernel)[grid](
        x2, rows, cache_w, bias, cursor, ids, out2, capacity, hidden, vocab_size,
        x2.stride(0), cache_w.stride(0), cache_w.stride(1), bias.stride(0), ids.stride(0), out2.stride(0),
        HAS_BIAS=has_bias, SCATTER=scatter, BLOCK_C=_BLOCK_C, BLOCK_K=_BLOCK_K,
    )


def _flat(x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x2, r = RP.flat_rows(x, rows)
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), r.to(x.device).contiguous()


def compact_logits_per_request(
    x: torch.Tensor, rows: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, cursor: torch.Tensor
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference_per_request.compact_logits_per_request`."""
    if not _supported(x, cache_w, cache_b):
        return RP.compact_logits_per_request(x, rows, cache_w, cache_b, cursor)
    x2, r = _flat(x, rows)
    capacity = cache_w.shape[1]
    out = torch.empty((x2.shape[0], capacity), dtype=x.dtype, device=x.device)
    if out.numel():
        with device_guard(x):
            _launch_head(x2, r, cache_w, cache_b, cursor, cursor, out, 0, scatter=False)
    return out.reshape(*x.shape[:-1], capacity)


def head_logits_per_request(
    x: torch.Tensor, rows: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, ids: torch.Tensor,
    cursor: torch.Tensor, vocab_size: int,
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference_per_request.head_logits_per_request`."""
    if not _supported(x, cache_w, cache_b) or not ids.is_contiguous():
        return RP.head_logits_per_request(x, rows, cache_w, cache_b, ids, cursor, vocab_size)
    x2, r = _flat(x, rows)
    out = torch.full((x2.shape[0], vocab_size), float("-inf"), dtype=x.dtype, device=x.device)
    if out.numel():
        with device_guard(x):
            _launch_head(x2, r, cache_w, cache_b, cursor, ids, out, vocab_size, scatter=True)
    return out.reshape(*x.shape[:-1], vocab_size)


def _gathered(rows: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids[rows]`` [B, C] and ``cursor[rows]`` [B] on the device: the shared-set kernels' per-row ids and count."""
    return ids.index_select(0, rows), cursor.index_select(0, rows)


def scatter_logits_per_request(
    compact: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference_per_request.scatter_logits_per_request`."""
    src, r = _flat(compact, rows)
    capacity = ids.shape[1]
    out = torch.full((src.shape[0], vocab_size), float("-inf"), dtype=compact.dtype, device=compact.device)
    if out.numel():
        ids_r, cursor_r = _gathered(r, ids, cursor)
        with device_guard(compact):
            wrap_triton(_scatter_kernel)[(src.shape[0], triton.cdiv(capacity, _SCATTER_BLOCK))](
                src, ids_r, cursor_r, out, capacity, vocab_size, src.stride(0), out.stride(0),
                ids_r.stride(0), cursor_r.stride(0), BLOCK=_SCATTER_BLOCK,
            )
    return out.reshape(*compact.shape[:-1], vocab_size)


def compact_topk_per_request(
    compact: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, k: int, largest: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kernels.reference_per_request.compact_topk_per_request`."""
    capacity = ids.shape[1]
    block = triton.next_power_of_2(capacity)
    if compact.dtype not in FLOAT_DTYPES or block > _MAX_BLOCK:
        return RP.compact_topk_per_request(compact, rows, ids, cursor, k, largest)
    if k < 0:
        raise ValueError(f"k={k} must be >= 0")
    src, r = _flat(compact, rows)
    batch = src.shape[0]
    values = torch.empty((batch, k), dtype=compact.dtype, device=compact.device)
    tokens = torch.empty((batch, k), dtype=torch.int64, device=compact.device)
    if values.numel():
        ids_r, cursor_r = _gathered(r, ids, cursor)
        with device_guard(compact):
            wrap_triton(_topk_kernel)[(batch,)](
                src, ids_r, cursor_r, values, tokens, capacity, k, src.stride(0), ids_r.stride(0), cursor_r.stride(0),
                LARGEST=largest, BLOCK=block, num_warps=topk_num_warps(block),
            )
    return values.reshape(*compact.shape[:-1], k), tokens.reshape(*compact.shape[:-1], k)


def compact_argmax_per_request(
    compact: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference_per_request.compact_argmax_per_request`."""
    return compact_topk_per_request(compact, rows, ids, cursor, 1, True)[1].squeeze(-1)
