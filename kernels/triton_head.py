"""Triton head: logits against the compact cache, and their scatter to the vocabulary.

``_head_kernel`` tiles [rows, capacity] and streams the cache rows once per row block, with
an fp32 accumulator. It reads the device count and skips every tile past it (no load, no
FLOP), so its cost follows |A|, not the capacity, while every shape stays static. Rows are
padded to 16 because ``tl.dot`` needs >= 16 on every dim. The same kernel either writes the
compact [rows, C] logits (-inf past the count) or, with ``SCATTER``, stores each active
slot's logit straight at its token id in a [rows, V] output pre-filled with -inf
(``head_logits``: the head with no post-ops, one pass and no compact round trip).

For fp32 heads with a few rows (<= 4, drafting one token) ``tl.dot`` would pad the rows to 16
and run IEEE-exact FMAs on 15 rows of zeros; there the kernel multiplies and sums in registers
instead (``USE_DOT=False``, ``BLOCK_M`` = the row count rounded up to a power of two).

Offsets are int64 wherever an index is multiplied by a stride: rows x V, C x H or H x V can pass
2^31 elements (8,192 rows at V = 262,144), and an int32 product would wrap and store out of
bounds without an error.

Tile settings come from :data:`HEAD_CONFIGS` (``use_kernels(head_config=...)`` picks one per call;
``benchmarks/gpu_bench.py`` sweeps them). There is no run-time autotuning: it would sync with the
host and cannot run inside a CUDA graph.

``_scatter_kernel`` places compact logits at their token ids. Active ids are unique, so the
stores never collide and the result is deterministic.

With ``rows`` (a per-request state, :mod:`kernels.request_rows`), ``_head_rows_kernel`` runs one program per
(batch row, block of slots): it reads ``rows[b]``, that request's count and cached rows, and skips every slot block
past the count (cost follows |A| of the request, not the capacity). Rows of one batch do not share a cache, so there
is no 16-row ``tl.dot`` tile: the product is a register FMA over H in ``BLOCK_K`` steps (the ``USE_DOT=False`` form
above). Rows of one request reread the same cached rows (from L2 on a GPU). A padding row (outside ``[0, R)``)
reads request row 0 with a count of 0: every block is skipped and its logits stay -inf. The scatter reuses
``_scatter_kernel`` with per-row id/count strides, on ``ids[rows]`` and ``cursor[rows]`` gathered on the device.
No host sync anywhere.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from . import reference
from . import request_rows as RR
from .selection import HEAD_CONFIGS, current_config
from .triton_util import FLOAT_DTYPES, INTERPRET, device_guard

_BLOCK_M = 16  # rows per tile (padded): tl.dot needs >= 16
_SCATTER_BLOCK = 1024
_FMA_MAX_ROWS = 4  # fp32 heads with at most this many rows skip tl.dot
_FMA_BLOCK_K = 64  # [rows, 64, BLOCK_C] products in registers

def head_config(device_type: str = "cuda") -> dict:
    """The tile settings for a call on ``device_type``: ``HEAD_CONFIGS[name]`` for the ``head_config`` in
    effect there (``use_kernels(head_config=...)``; process default ``NANOSPEC_HEAD_CONFIG``, read once)."""
    return HEAD_CONFIGS[current_config(device_type).head_config]


@triton.jit
def _head_kernel(
    x_ptr, w_ptr, b_ptr, cursor_ptr, ids_ptr, out_ptr,
    M, C, H, V, stride_xm, stride_wc, stride_om,
    HAS_BIAS: tl.constexpr, SCATTER: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_c = tl.program_id(0)
    pid_m = tl.program_id(1)
    count = tl.minimum(tl.load(cursor_ptr), C)
    # int64: offs * stride can pass 2^31 (rows x V, C x H)
    offs_c = pid_c.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = offs_c < count
    row_ok = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    k_end = tl.where(pid_c * BLOCK_C < count, H, 0)  # tiles past the count read nothing
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + offs_c[None, :] * stride_wc + offs_k[:, None],
                    mask=live[None, :] & k_ok[:, None], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if not USE_DOT:
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_c, mask=live, other=0.0).to(tl.float32)[None, :]
    acc = tl.where(live[None, :], acc, float("-inf"))
    out = acc.to(out_ptr.dtype.element_ty)
    if SCATTER:
        tok = tl.load(ids_ptr + offs_c, mask=live, other=0)
        ok = live & (tok >= 0) & (tok < V)
        tok = tl.where(ok, tok, 0)
        tl.store(out_ptr + offs_m[:, None] * stride_om + tok[None, :], out, mask=row_ok[:, None] & ok[None, :])
    else:
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_c[None, :], out,
                 mask=row_ok[:, None] & (offs_c < C)[None, :])


@triton.jit
def _scatter_kernel(
    src_ptr, ids_ptr, cursor_ptr, out_ptr, C, V, stride_sm, stride_om, stride_ids, stride_cursor, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * V can pass 2^31
    # Per-request scatter (rows given) gives each row its own ids and cursor; shared: strides 0.
    ids_ptr += row * stride_ids
    cursor_ptr += row * stride_cursor
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    count = tl.minimum(tl.load(cursor_ptr), C)
    live = offs < count
    tok = tl.load(ids_ptr + offs, mask=live, other=0)
    ok = live & (tok >= 0) & (tok < V)
    v = tl.load(src_ptr + row * stride_sm + offs, mask=ok)
    tl.store(out_ptr + row * stride_om + tl.where(ok, tok, 0), v, mask=ok)


_ROWS_BLOCK_C = 32
_ROWS_BLOCK_K = 64


@triton.jit
def _head_rows_kernel(
    x_ptr, rows_ptr, w_ptr, b_ptr, cursor_ptr, ids_ptr, out_ptr,
    R, C, H, V, stride_xm, stride_wr, stride_wc, stride_br, stride_ir, stride_om,
    HAS_BIAS: tl.constexpr, SCATTER: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_c = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)  # int64: m * V, r * C * H can pass 2^31
    r = tl.load(rows_ptr + m).to(tl.int64)
    real = (r >= 0) & (r < R)  # a padding row: an empty set, never another request's
    r = tl.where(real, r, 0)
    count = tl.where(real, tl.minimum(tl.load(cursor_ptr + r), C), 0)
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


def _launch_head_rows(x2, rows, cache_w, cache_b, cursor, ids, out2, vocab_size: int, scatter: bool) -> None:
    batch, hidden = x2.shape
    requests, capacity = cache_w.shape[:2]
    has_bias = cache_b is not None
    bias = cache_b if has_bias else cache_w
    grid = (triton.cdiv(capacity, _ROWS_BLOCK_C), batch)
    wrap_triton(_head_rows_kernel)[grid](
        x2, rows, cache_w, bias, cursor, ids, out2, requests, capacity, hidden, vocab_size,
        x2.stride(0), cache_w.stride(0), cache_w.stride(1), bias.stride(0), ids.stride(0), out2.stride(0),
        HAS_BIAS=has_bias, SCATTER=scatter, BLOCK_C=_ROWS_BLOCK_C, BLOCK_K=_ROWS_BLOCK_K,
    )


def per_row(lead: torch.Tensor, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``lead [..., D]`` as ``[B, D]`` with unit stride along D, and ``rows`` as int64 [B] on its device (None
    stays None)."""
    if rows is None:
        return _rows(lead), None
    x2, r = RR.flat_rows(lead, rows)
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), r.contiguous()


def row_state(rows: torch.Tensor | None, ids: torch.Tensor, cursor: torch.Tensor):
    """``(ids, cursor, ids row stride, cursor row stride)`` for the kernels that read one set per batch row: the
    shared set with strides 0, or each row's request gathered on the device (:func:`kernels.request_rows.gathered`)."""
    if rows is None:
        return ids, cursor, 0, 0
    ids_r, cursor_r = RR.gathered(rows, ids, cursor)
    return ids_r, cursor_r, ids_r.stride(0), cursor_r.stride(0)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _supported(x, cache_w, cache_b, rows=None) -> bool:
    if rows is not None:  # the per-request kernel indexes [R, C, H] by computed strides: contiguous state
        return (x.dtype in FLOAT_DTYPES and cache_w.dtype == x.dtype and cache_w.is_contiguous()
                and (cache_b is None or cache_b.is_contiguous()))
    return (
        x.dtype in FLOAT_DTYPES
        and cache_w.dtype == x.dtype
        and cache_w.stride(-1) == 1
        and (cache_b is None or cache_b.stride(0) == 1)
    )


def _launch_head(x, cache_w, cache_b, cursor, ids, out2, vocab_size: int, scatter: bool) -> None:
    x2 = _rows(x)
    m, hidden = x2.shape
    capacity = cache_w.shape[0]
    has_bias = cache_b is not None
    cfg = head_config(x.device.type)
    use_dot, block_m, block_k = _tiles(x.dtype, m, cfg)
    grid = (triton.cdiv(capacity, cfg["BLOCK_C"]), triton.cdiv(m, block_m))
    wrap_triton(_head_kernel)[grid](
        x2, cache_w, cache_b if has_bias else cache_w, cursor, ids, out2,
        m, capacity, hidden, vocab_size, x2.stride(0), cache_w.stride(0), out2.stride(0),
        HAS_BIAS=has_bias, SCATTER=scatter, UPCAST=INTERPRET,
        IEEE=INTERPRET or x.dtype == torch.float32, USE_DOT=use_dot,
        BLOCK_M=block_m, BLOCK_C=cfg["BLOCK_C"], BLOCK_K=block_k,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def _tiles(dtype: torch.dtype, rows: int, cfg: dict) -> tuple[bool, int, int]:
    """(USE_DOT, BLOCK_M, BLOCK_K): tl.dot with 16-row tiles, or register FMAs for a few fp32 rows (for a few rows
    of any dtype with a configuration that names ``FMA_ROWS``: ``by_rows``)."""
    if rows <= cfg.get("FMA_ROWS", 0):
        return False, triton.next_power_of_2(max(rows, 1)), cfg["FMA_BLOCK_K"]
    if dtype == torch.float32 and rows <= _FMA_MAX_ROWS:
        return False, triton.next_power_of_2(max(rows, 1)), _FMA_BLOCK_K
    return True, _BLOCK_M, cfg["BLOCK_K"]


def compact_logits(
    x: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, cursor: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`nanospec_fx.kernels.reference.compact_logits`."""
    if not _supported(x, cache_w, cache_b, rows):
        return reference.compact_logits(x, cache_w, cache_b, cursor, rows)
    if rows is not None:
        x2, r = per_row(x, rows)
        capacity = cache_w.shape[1]
        out = torch.empty((x2.shape[0], capacity), dtype=x.dtype, device=x.device)
        if out.numel():
            with device_guard(x):
                _launch_head_rows(x2, r, cache_w, cache_b, cursor, cursor, out, 0, scatter=False)
        return out.reshape(*x.shape[:-1], capacity)
    capacity = cache_w.shape[0]
    out = torch.empty((*x.shape[:-1], capacity), dtype=x.dtype, device=x.device)
    with device_guard(x):
        _launch_head(x, cache_w, cache_b, cursor, cursor, out.view(-1, capacity), 0, scatter=False)
    return out


def head_logits(
    x: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, ids: torch.Tensor, cursor: torch.Tensor,
    vocab_size: int, rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`nanospec_fx.kernels.reference.head_logits`."""
    if not _supported(x, cache_w, cache_b, rows) or (rows is not None and not ids.is_contiguous()):
        return reference.head_logits(x, cache_w, cache_b, ids, cursor, vocab_size, rows)
    out = torch.full((*x.shape[:-1], vocab_size), float("-inf"), dtype=x.dtype, device=x.device)
    if out.numel():
        with device_guard(x):
            if rows is None:
                _launch_head(x, cache_w, cache_b, cursor, ids, out.view(-1, vocab_size), vocab_size, scatter=True)
            else:
                x2, r = per_row(x, rows)
                _launch_head_rows(x2, r, cache_w, cache_b, cursor, ids, out.view(-1, vocab_size), vocab_size, True)
    return out


def scatter_logits(compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, vocab_size: int,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as :func:`nanospec_fx.kernels.reference.scatter_logits`."""
    capacity = ids.shape[-1]
    out = torch.full((*compact.shape[:-1], vocab_size), float("-inf"), dtype=compact.dtype, device=compact.device)
    src, r = per_row(compact, rows)
    m = src.shape[0]
    if out.numel():
        ids, cursor, stride_ids, stride_cursor = row_state(r, ids, cursor)
        with device_guard(compact):
            wrap_triton(_scatter_kernel)[(m, triton.cdiv(capacity, _SCATTER_BLOCK))](
                src, ids, cursor, out.view(-1, vocab_size), capacity, vocab_size, src.stride(0), vocab_size,
                stride_ids, stride_cursor, BLOCK=_SCATTER_BLOCK,
            )
    return out
