"""The ops an exchange of candidates is made of, one recogniser each.

The local selection (``topk``/``max`` over this rank's slice), the offset that makes local ids global (``+ c``, an
``arange`` lookup), the packing of values and ids in one tensor and its unpacking after the collective, the pick
over the gathered candidates and the lookup of the picked ids. Each returns what the op holds, a reason when it is
such an op in a form not proven exact, or None when it is not one; :mod:`.exchange` strings them together.
"""
from __future__ import annotations

import operator
from typing import NamedTuple

import torch
import torch.fx as fx

from .. import patterns
from ..graph import call_arg, node_name
from .exchange_values import FloatIds, Gathered, GatheredPacked, LocalValues, Packed, Parts, Pick, Positions, Selected
from .layouts import Block, Full, Layout, Ranked, Stacked
from .slices import FRESH_BUFFERS, same_shape

ADD = {operator.add, torch.add}


def pack(n: fx.Node, values: dict, cand: tuple) -> Packed | str:
    """A :class:`Packed` when ``n`` puts one rank's values and its global ids (cast to the values' dtype) into one
    tensor: ``stack`` along ``axis`` (size 2), or ``cat`` along it (values, then ids, or the other way round)."""
    parts, dim = n.args[0] if n.args else n.kwargs.get("tensors"), call_arg(n, 1, "dim", 0)
    kinds = [type(values.get(p)) for p in parts] if isinstance(parts, (list, tuple)) else []
    if len(kinds) != 2 or set(kinds) != {FloatIds, LocalValues} or not isinstance(dim, int):
        return f"{n.name} ({node_name(n)}) packs the candidates with something else than their values and global ids"
    dtypes = {patterns.example_value(p).dtype for p in (*parts, n)}
    if len(dtypes) != 1:
        return f"{n.name} packs values and ids of different dtypes ({sorted(map(str, dtypes))})"
    shape = patterns.tensor_shape(n)
    axis = dim % len(shape)
    if n.target is torch.stack and not same_shape(shape, cand[:axis] + (2,) + cand[axis:]):
        return f"{n.name} stacks candidates of an unexpected shape"
    if n.target is not torch.stack and not (axis < len(cand) and same_shape(
            shape, cand[:axis] + (2 * cand[axis],) + cand[axis + 1:]) and isinstance(cand[axis], int)):
        return f"{n.name} concatenates candidates of an unexpected shape"
    return Packed("stack" if n.target is torch.stack else "cat", axis, kinds.index(LocalValues), shape)


def which_part(first: int, which: int) -> str:
    return "val" if which == first else "id"


def unpack(n: fx.Node, held: GatheredPacked, cand: tuple) -> Gathered | Parts | None:
    """:class:`Gathered` when ``n`` takes the values or the ids out of the gathered packed tensor (``g[:, 0]``,
    ``select``, ``g[..., :k]``, ``narrow``), :class:`Parts` when it splits it in two (``unbind``, ``chunk(2)``,
    ``split(k)``); None when it does neither."""
    kind, axis, first, layout = held.pack.kind, held.pack.axis, held.pack.first, held.layout
    ndim = len(held.pack.shape)
    if isinstance(layout, Stacked) and axis != 0 or isinstance(layout, Block) \
            or isinstance(layout, Full) and axis != ndim - 1:
        where, out = axis, layout  # the pack axis is where it was in one rank's tensor
    elif isinstance(layout, Ranked):
        where = axis if axis < layout.axis else axis + 1
        out = Ranked(layout.axis - 1 if kind == "stack" and where < layout.axis else layout.axis)
        ndim += 1
    else:
        return None
    size = cand[axis] if kind == "cat" else 1
    name, args = node_name(n), list(n.args[1:])
    if n.target is operator.getitem:
        at = _index_at(n.args[1], ndim)
        if at is None or at.axis != where:
            return None
        which = _which(kind, at.entry, size)
    elif name == "select" and len(args) == 2 and kind == "stack" and _dim(args[0], ndim) == where:
        which = _which(kind, args[1], size)
    elif name == "narrow" and len(args) == 3 and kind == "cat" and _dim(args[0], ndim) == where \
            and args[2] == size:
        which = _which(kind, slice(args[1], args[1] + size), size)
    elif name == "unbind" and kind == "stack" and _dim(call_arg(n, 1, "dim", 0), ndim) == where:
        return Parts(out, first)
    elif name in ("chunk", "split") and kind == "cat" and _dim(call_arg(n, 2, "dim", 0), ndim) == where \
            and (name == "chunk" and args[0] == 2 or name == "split" and args[0] in (size, [size, size], (size, size))):
        return Parts(out, first)
    else:
        return None
    return None if which is None else Gathered(out, which_part(first, which))


def _dim(dim, ndim: int) -> int | None:
    return dim % ndim if isinstance(dim, int) and not isinstance(dim, bool) else None


class _IndexAt(NamedTuple):
    axis: int
    entry: object


def _index_at(index, ndim: int) -> _IndexAt | None:
    """(axis, entry) for an index that is ``:`` everywhere but one axis (``...`` expanded)."""
    index = list(index) if isinstance(index, tuple) else [index]
    if index.count(Ellipsis) > 1:
        return None
    if Ellipsis in index:
        e = index.index(Ellipsis)
        index = index[:e] + [slice(None)] * (ndim - len(index) + 1) + index[e + 1:]
    picked = [(a, i) for a, i in enumerate(index) if i != slice(None)]
    return _IndexAt(*picked[0]) if len(picked) == 1 and len(index) <= ndim else None


def _which(kind: str, entry, size: int) -> int | None:
    """0 or 1: which part an int (stack) or a slice (cat, ``size`` each) takes along the pack axis."""
    if kind == "stack":
        return entry % 2 if isinstance(entry, int) and not isinstance(entry, bool) else None
    if not isinstance(entry, slice) or entry.step not in (None, 1):
        return None
    bounds = (entry.start or 0, entry.stop)
    return {(0, size): 0, (size, 2 * size): 1, (size, None): 1}.get(bounds)


def local_selection(sliced: fx.Node, ndim: int) -> tuple | str | None:
    """(node, k, keeps its k axis) for the one top-k / max reading ``sliced`` over its last axis."""
    users = [u for u in sliced.users if node_name(u) not in FRESH_BUFFERS]
    if len(users) != 1 or users[0].args[0] is not sliced:
        return None
    (sel,) = users
    if node_name(sel) == "topk":
        k, dim, largest = call_arg(sel, 1, "k"), call_arg(sel, 2, "dim", -1), call_arg(sel, 3, "largest", True)
        if not isinstance(k, int) or not isinstance(dim, int) or dim % ndim != ndim - 1 or largest is not True:
            return f"{sel.name} is not a largest top-k of this rank's slice over the vocabulary axis"
        return sel, k, True
    if node_name(sel) == "max" and len(sel.args) + len(sel.kwargs) > 1:  # max(dim): (values, first indices)
        dim, keep = call_arg(sel, 1, "dim"), call_arg(sel, 2, "keepdim", False)
        if not isinstance(dim, int) or dim % ndim != ndim - 1 or not isinstance(keep, bool):
            return f"{sel.name} is not a max of this rank's slice over the vocabulary axis"
        return sel, 1, keep
    return None


def offset_ids(n: fx.Node, values: dict, rows: int, example_of: dict) -> tuple | str | None:
    """(offset, nodes computing it) when ``n`` turns local ids into global ids: ``ids + c`` (an int, a scalar
    buffer), ``arange(c, c + rows)[ids]`` / ``(arange(rows) + c)[ids]``; a reason or None otherwise."""
    name = node_name(n)
    if (n.target in ADD or name == "add") and len(n.args) == 2 and not n.kwargs:
        other = n.args[1] if n.args[0] in values else n.args[0]
        if isinstance(other, int) and not isinstance(other, bool):
            return other, []
        real = example_of.get(other) if isinstance(other, fx.Node) else None
        if isinstance(real, torch.Tensor) and real.numel() == 1 and not real.is_floating_point() \
                and not real.is_complex():
            return int(real), []
        return f"{n.name} offsets the local ids by {other}, not an int or a scalar buffer nanospec can read"
    if (n.target is operator.getitem or n.target is torch.take) and n.args[1] in values and n.args[0] not in values:
        table = _arange_offset(n.args[0], rows)
        if table is None:
            return f"{n.name} looks the local ids up in a table that is not arange(c, c + {rows})"
        return table
    return None


def _arange_offset(node, rows: int) -> tuple | None:
    """(c, nodes) when ``node`` holds ``c, c + 1, ..., c + rows - 1``."""
    if not isinstance(node, fx.Node):
        return None
    if node.target is torch.arange and not any(isinstance(a, fx.Node) for a in node.args):
        args = list(node.args) + [node.kwargs[k] for k in ("start", "end", "step") if k in node.kwargs]
        start, end, step = (0, args[0], 1) if len(args) == 1 else (tuple(args) + (1,))[:3]
        if all(isinstance(a, int) for a in (start, end, step)) and step == 1 and end - start == rows:
            return start, [node]
    if (node.target in ADD or node_name(node) == "add") and len(node.args) == 2 and not node.kwargs:
        base, c = node.args
        inner = _arange_offset(base, rows)
        if inner is not None and isinstance(c, int) and not isinstance(c, bool):
            return inner[0] + c, inner[1] + [node]
    return None


def pick(n: fx.Node, layout: Layout, keep: bool, first_max: bool, k: int) -> Pick | Positions | str:
    """A :class:`Pick` (or the :class:`Positions` of an ``argmax``) when ``n`` selects over the exchanged values'
    candidate axis."""
    ndim = len(patterns.tensor_shape(n.args[0]))
    if isinstance(layout, Full) and keep:  # [..., tp * k]: rank-major along the last axis
        axis = ndim - 1
    elif isinstance(layout, Ranked) and k == 1:  # a rank axis next to one candidate per rank
        axis = layout.axis
    else:
        return f"{n.name} picks from candidates laid out in a way nanospec does not follow"
    name = node_name(n)
    if name == "topk":
        k2, dim = call_arg(n, 1, "k"), call_arg(n, 2, "dim", -1)
        largest, ordered = call_arg(n, 3, "largest", True), call_arg(n, 4, "sorted", True)
        if not isinstance(k2, int) or not isinstance(dim, int) or dim % ndim != axis or largest is not True \
                or ordered is not True:
            return f"{n.name} is not a sorted largest top-k over the exchanged candidates"
        if k2 > k:
            return f"{n.name} takes the top {k2} of each rank's top {k}: not the top {k2} of the vocabulary"
        return Pick(layout, k2, axis, True)
    dim, keepdim = call_arg(n, 1, "dim"), call_arg(n, 2, "keepdim", False)
    if not isinstance(dim, int) or dim % ndim != axis or not isinstance(keepdim, bool):
        return f"{n.name} picks over another axis than the exchanged candidates'"
    if not first_max:
        return (f"{n.name} takes the first maximum of top-{k} candidates: a local topk does not promise its "
                "shard's first maximum, so ties could pick another id than argmax of the logits (use max(-1))")
    if name == "argmax":
        return Positions(layout, 1, axis, keepdim)
    return Pick(layout, 1, axis, keepdim)


def lookup_ids(n: fx.Node, values: dict) -> Selected | str:
    """``ids.gather(dim, pos)`` / ``torch.take_along_dim(ids, pos, dim)`` at the picked positions (kept axis)."""
    if n.target is torch.take_along_dim:
        ids, pos, dim = n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("indices"), call_arg(n, 2, "dim")
    else:
        ids, dim, pos = n.args[0], call_arg(n, 1, "dim"), call_arg(n, 2, "index")
    held, where = values.get(ids), values.get(pos)
    if not isinstance(held, Gathered) or not isinstance(where, Positions) or not isinstance(dim, int):
        return f"{n.name} looks up exchanged ids at positions nanospec did not follow"
    if held.layout != where.layout or dim % len(patterns.tensor_shape(ids)) != where.axis or not where.kept:
        return f"{n.name} looks up the ids along another axis or layout than the values were picked from"
    return Selected(1, where.k2)
