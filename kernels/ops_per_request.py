"""The per-request nanospec ops (``torch.ops.nanospec.*_per_request``): one state row per request.

:class:`nanospec_fx.request_vocab.RequestVocabs` calls them eagerly (a serving engine computes the drafter's
logits outside any graph the backend sees). Registered like the shared-set ops (:func:`kernels.ops._register`,
schemas in :data:`kernels.schema.REQUEST_SCHEMAS`); each body picks the reference
(:mod:`kernels.reference_per_request`), the CPU host path (:mod:`kernels.host_per_request`) or the Triton
kernels (:mod:`kernels.triton_per_request`) per call, as :mod:`kernels.dispatch` decides. No autograd: these
are inference ops (a drafter is trained through the shared-set ops).
"""
from __future__ import annotations

from torch import Tensor

from .dispatch import implementation_for
from . import ops
from .ops import _register
from .schema import check_num_pinned


def _observe_per_request(
    token_ids: Tensor, rows: Tensor, weight: Tensor, bias: Tensor | None, ids: Tensor, slot_of: Tensor, cursor: Tensor,
    cache_w: Tensor, cache_b: Tensor, num_pinned: int,
) -> None:
    """Add ``token_ids [B, n]`` (-1 ignored) of batch row b to request row ``rows[b]`` (in place)."""
    check_num_pinned(num_pinned, ids.shape[1])
    implementation_for("observe_per_request", cache_w)(
        token_ids, rows, weight, bias, ids, slot_of, cursor, cache_w, cache_b, num_pinned)


def _compact_logits_per_request(x: Tensor, rows: Tensor, cache_w: Tensor, cache_b: Tensor | None, cursor: Tensor
                                ) -> Tensor:
    """Logits of each row's request's slots, [..., C]; slots past that request's count are -inf."""
    return implementation_for("compact_logits_per_request", x)(x, rows, cache_w, cache_b, cursor)


def _scatter_logits_per_request(compact: Tensor, rows: Tensor, ids: Tensor, cursor: Tensor, vocab_size: int) -> Tensor:
    """Compact logits [..., C] -> [..., V], each row at its request's token ids, -inf elsewhere."""
    return implementation_for("scatter_logits_per_request", compact)(compact, rows, ids, cursor, vocab_size)


def _head_logits_per_request(
    x: Tensor, rows: Tensor, cache_w: Tensor, cache_b: Tensor | None, ids: Tensor, cursor: Tensor, vocab_size: int
) -> Tensor:
    """compact_logits_per_request then scatter_logits_per_request in one op, [..., V]."""
    return implementation_for("head_logits_per_request", x)(x, rows, cache_w, cache_b, ids, cursor, vocab_size)


def _compact_topk_per_request(
    compact: Tensor, rows: Tensor, ids: Tensor, cursor: Tensor, k: int, largest: bool = True
) -> tuple[Tensor, Tensor]:
    """Top-k over each row's request's active slots -> (values, token ids); ties: smaller id first."""
    return implementation_for("compact_topk_per_request", compact)(compact, rows, ids, cursor, k, largest)


def _compact_argmax_per_request(compact: Tensor, rows: Tensor, ids: Tensor, cursor: Tensor) -> Tensor:
    """Token id of the largest active logit of each row's request (ties: smaller id; 0 if none)."""
    return implementation_for("compact_argmax_per_request", compact)(compact, rows, ids, cursor)


def _observe_fake(token_ids, rows, weight, bias, ids, slot_of, cursor, cache_w, cache_b, num_pinned):
    check_num_pinned(num_pinned, ids.shape[1])
    return None


def _compact_logits_fake(x, rows, cache_w, cache_b, cursor):
    return x.new_empty((*x.shape[:-1], cache_w.shape[1]))


# ``rows`` only picks each batch row's state, so these outputs have the shared-set op's shapes: its fake says them
# (compact_logits and observe read C from the [R, C] state: their own fakes above).
def _scatter_logits_fake(compact, rows, ids, cursor, vocab_size):
    return ops._scatter_logits_fake(compact, ids, cursor, vocab_size)


def _head_logits_fake(x, rows, cache_w, cache_b, ids, cursor, vocab_size):
    return ops._head_logits_fake(x, cache_w, cache_b, ids, cursor, vocab_size)


def _compact_topk_fake(compact, rows, ids, cursor, k, largest=True):
    return ops._compact_topk_fake(compact, ids, cursor, k, largest)


def _compact_argmax_fake(compact, rows, ids, cursor):
    return ops._compact_argmax_fake(compact, ids, cursor)


observe_per_request = _register("observe_per_request", _observe_per_request, _observe_fake)
compact_logits_per_request = _register("compact_logits_per_request", _compact_logits_per_request, _compact_logits_fake)
scatter_logits_per_request = _register("scatter_logits_per_request", _scatter_logits_per_request, _scatter_logits_fake)
head_logits_per_request = _register("head_logits_per_request", _head_logits_per_request, _head_logits_fake)
compact_topk_per_request = _register("compact_topk_per_request", _compact_topk_per_request, _compact_topk_fake)
compact_argmax_per_request = _register("compact_argmax_per_request", _compact_argmax_per_request, _compact_argmax_fake)

__all__ = [
    "observe_per_request", "compact_logits_per_request", "scatter_logits_per_request", "head_logits_per_request",
    "compact_topk_per_request", "compact_argmax_per_request",
]
