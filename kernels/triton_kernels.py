"""The Triton implementations of the nanospec ops (same signatures as :mod:`nanospec_fx.kernels.reference`).

Importing this module needs triton; :mod:`nanospec_fx.kernels.dispatch` falls back to the reference when
it cannot be imported.
"""
from .triton_head import compact_logits, head_logits, scatter_logits
from .triton_observe import observe
from .triton_select import compact_argmax, compact_topk

__all__ = ["observe", "compact_logits", "scatter_logits", "head_logits", "compact_topk", "compact_argmax"]
