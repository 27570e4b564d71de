"""The request axis of the nanospec ops: how batch rows map to request rows of a per-request state.

Every op takes an optional ``rows``. Without it the state is one shared set (``ids [C]``, ``cursor [1]``, ...).
With it the state has a leading request axis (``ids [R, C]``, ``cursor [R]``, ``cache_w [R, C, H]``, ...;
:data:`kernels.schema.REQUEST_STATE_FIELDS`) and ``rows`` (the shape of the batch's leading dims) names the request
row of each batch row: batch row b is computed against, or observed into, the set of request ``rows[b]``.

**Padding rows** (the rule of every implementation): a batch row whose ``rows`` entry lies outside ``[0, R)``
(engines pad batches with -1) reads as an *empty* set and writes nothing. Its logits are all -inf, its top-k is
the padding of an empty set (token ids 0..k-1, value -inf, or +inf for smallest), its argmax 0 (what
``torch.argmax`` returns for all -inf logits), and observe ignores its ids. Device paths apply the rule by
clamping the row and masking its count to 0 (no host sync); it never reads another request's set.

The helpers below are plain torch on the device (no host reads), shared by the reference, host and Triton kinds.
"""
from __future__ import annotations

import torch


def flat_rows(x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` and ``rows [...]`` as ``[B, D]`` and ``[B]`` (int64, on x's device)."""
    if tuple(rows.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"rows must have the shape of x's leading dims {tuple(x.shape[:-1])}, got {tuple(rows.shape)}")
    return x.reshape(-1, x.shape[-1]), rows.reshape(-1).to(device=x.device, dtype=torch.int64)


def real_rows(rows: torch.Tensor, requests: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(clamped, real)``: each row clamped into ``[0, requests)`` (safe to index with) and whether it was a real
    request row (False: a padding row, which reads as an empty set)."""
    real = (rows >= 0) & (rows < requests)
    return torch.where(real, rows, torch.zeros_like(rows)), real


def gathered(rows: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [B, C]`` and ``cursor [B]`` of each batch row's request (``rows [B]``), on the device; a padding
    row gets a count of 0 (an empty set)."""
    r, real = real_rows(rows, ids.shape[0])
    count = cursor.index_select(0, r)
    return ids.index_select(0, r), torch.where(real, count, torch.zeros_like(count))


def lead_rows(rows: torch.Tensor) -> torch.Tensor:
    """Bool [B]: batch row b is the first batch row of its request."""
    b = torch.arange(rows.numel(), device=rows.device)
    earlier_same = (rows[:, None] == rows[None, :]) & (b[None, :] < b[:, None])
    return ~earlier_same.any(1)


def grouped_token_ids(token_ids: torch.Tensor, rows: torch.Tensor, requests: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows clamped into [0, requests), grouped ids)``: int64 [B, B * n] holding, for the first batch row of
    each request, the ids of all its batch rows in batch order; -1 (ignored by observe) everywhere else and for
    the ids of padding rows. ``token_ids``: [B, n] (or [B] for one id per row). Observing row b's grouped ids
    into request ``rows[b]`` is then one call per request, whatever the split of its ids across batch rows."""
    rows, real = real_rows(rows, requests)
    tok = token_ids.reshape(rows.numel(), -1).to(device=rows.device, dtype=torch.int64)
    tok = torch.where(real[:, None], tok, torch.full_like(tok, -1))
    same = (rows[:, None] == rows[None, :]) & lead_rows(rows)[:, None]  # [B (lead), B (member)]
    grouped = torch.where(same[:, :, None], tok[None, :, :], torch.full_like(tok[None], -1))
    return rows, grouped.reshape(rows.numel(), -1)
