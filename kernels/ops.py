"""The nanospec custom ops: the boundary between the FX rewrite and the kernels.

The rewritten graph calls these ops (``torch.ops.nanospec.*``). Each has a fake
implementation for tracing and one real implementation that picks the kernel set:
the plain-torch reference (``kernels/reference.py``) or, when available, Triton
(see :func:`kernels.dispatch.implementation_for`). Shapes never depend on the active
set, so the ops trace, compile and capture into CUDA graphs as they are.
"""
from __future__ import annotations

import torch

from . import reference
from .dispatch import implementation_for


@torch.library.custom_op("nanospec::observe", mutates_args=("ids", "slot_of", "cursor", "cache_w", "cache_b"))
def observe(
    token_ids: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    slot_of: torch.Tensor,
    cursor: torch.Tensor,
    cache_w: torch.Tensor,
    cache_b: torch.Tensor,
    num_pinned: int,
) -> None:
    """Add ``token_ids`` to the active vocabulary held in the state tensors (in place)."""
    implementation_for("observe", cache_w)(token_ids, weight, bias, ids, slot_of, cursor, cache_w, cache_b, num_pinned)


@observe.register_fake
def _(token_ids, weight, bias, ids, slot_of, cursor, cache_w, cache_b, num_pinned):
    return None


@torch.library.custom_op("nanospec::compact_logits", mutates_args=())
def compact_logits(x: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, cursor: torch.Tensor) -> torch.Tensor:
    """Logits of the active slots, [..., C]; slots past the count are -inf."""
    return implementation_for("compact_logits", x)(x, cache_w, cache_b, cursor)


@compact_logits.register_fake
def _(x, cache_w, cache_b, cursor):
    return x.new_empty((*x.shape[:-1], cache_w.shape[0]))


@torch.library.custom_op("nanospec::scatter_logits", mutates_args=())
def scatter_logits(compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Compact logits [..., C] -> full-vocabulary logits [..., V], -inf for inactive tokens."""
    return implementation_for("scatter_logits", compact)(compact, ids, cursor, vocab_size)


@scatter_logits.register_fake
def _(compact, ids, cursor, vocab_size):
    return compact.new_empty((*compact.shape[:-1], vocab_size))


__all__ = ["observe", "compact_logits", "scatter_logits", "reference"]
