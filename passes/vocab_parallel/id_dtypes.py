"""Which dtypes hold token ids and candidate values exactly: the exchange may cast them on the way.

Ids may travel cast to the values' floating dtype (one collective for both): exact only while every id
``0 .. V - 1`` is an integer of that dtype. Values may be widened (bfloat16 -> float32), which keeps their order and
ties; anything else could change the pick.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from .. import patterns
from ..graph import node_name

CASTS = {"to", "type", "type_as", "float", "double", "half", "bfloat16", "long", "int", "short"}


WIDENING = {(torch.bfloat16, torch.float32), (torch.bfloat16, torch.float64), (torch.float16, torch.float32),
            (torch.float16, torch.float64), (torch.float32, torch.float64)}


def cast_to(n: fx.Node) -> torch.dtype | None:
    """The dtype ``n`` casts its input to (``.to(dtype)``, ``.float()``, ``.type_as(x)``...), same shape and device."""
    if node_name(n) not in CASTS or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    src, out = patterns.example_value(n.args[0]), patterns.example_value(n)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor) or src.shape != out.shape \
            or src.device != out.device:
        return None
    return out.dtype


def widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every ``src`` value is a ``dst`` value (so order and ties are kept)."""
    return src == dst or (src, dst) in WIDENING


def exact_integers(dtype: torch.dtype) -> int:
    """Every integer of magnitude up to this is exact in the floating ``dtype`` (2**24 for float32)."""
    return 2 ** (round(-math.log2(torch.finfo(dtype).eps)) + 1)


def ids_round_trip(vocab: int, dtype: torch.dtype) -> bool:
    """Ids ``0 .. vocab - 1`` cast to the floating ``dtype`` and back are unchanged."""
    return dtype.is_floating_point and vocab - 1 <= exact_integers(dtype)


def holds_ids(dtype: torch.dtype, vocab: int) -> bool:
    """An integer dtype that holds ids ``0 .. vocab - 1``."""
    return not dtype.is_floating_point and dtype != torch.bool and torch.iinfo(dtype).max >= vocab - 1
