"""Vocabulary-parallel heads read through a sharded selection: local top-k, exchange of (value, id), global pick.

Instead of gathering ``[..., V]`` logits, a tensor-parallel drafter may select on its own slice and exchange
only the candidates (Megatron-style sampling, DTensor ``ColwiseParallel()`` with its default ``Shard(-1)``
output)::

    local = linear(h, W_shard)                          # [..., V / tp]
    v, i = local.topk(k, dim=-1)                        # or local.max(-1): k = 1, first maximum
    i = i + rank * V / tp                               # global ids (a constant, a buffer, an arange lookup)
    av, ai = all_gather(v), all_gather(i)               # one collective each, any gather form
    cv, ci = cat(av.chunk(tp), -1), cat(ai.chunk(tp), -1)   # [..., tp * k], rank-major (or a rank axis)
    best, pos = cv.topk(k2, dim=-1)                     # k2 <= k (or argmax/max over the rank axis when k = 1)
    ids = ci.gather(-1, pos)

Values and ids may also travel in one tensor (``torch.stack([v, i.to(v.dtype)])`` or a ``cat``, one collective,
taken apart after it): followed only where every id ``0 .. V - 1`` is an exact integer of that dtype
(:func:`ids_round_trip`), so the ids cast back are the ids sent.

Every token of the global top-k2 is in its shard's top-k, so ``best`` and ``ids`` are ``topk(z, k2)`` of the
full logits ``z = cat(slices)``. :func:`match_exchange` proves the form by following what every value holds
(local values, local ids, global ids, their gathered layouts, the selected positions) and refuses anything
else with a reason; :func:`collapse_exchange` replaces it by ``topk(linear(h, W_shard), k2)`` over ``[..., V]``,
which ``rewrite_head`` turns into the compact head plus ``compact_topk``: no collective left.

Ties: a pick over ranks (``argmax``/``max`` of the k = 1 candidates) returns the first rank's candidate, and
``max`` returns a shard's first maximum, so the id is the smallest id among the maxima: what ``argmax`` of the
full logits returns, and what the compact head's ``compact_topk`` returns (ties to the smaller id). A local
``topk(1)`` does not promise its first maximum, so an argmax over such candidates is refused. A top-k2 over
top-k candidates has the values of the full top-k2; among tied values the order of ids is torch.topk's, which
torch leaves unspecified (the compact head orders them by id).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from . import patterns
from .patterns import _arg
from .vocab_parallel import (
    CAT_FUNCTIONS, FRESH_BUFFERS, _elementwise_prefix, erase_local_slice, _in_graph_order, _is_c10d, _name, _same, _step,
)

ADD = {operator.add, torch.add}
GATHER_FUNCTIONS = {torch.gather, torch.take_along_dim}


SHAPE_READS = {"size", "dim", "sym_size", "numel"}
SELECTED_VIEWS = {"squeeze", "unsqueeze", "view", "reshape", "contiguous", "flatten"}


@dataclass
class Exchange:
    """A selection over this rank's slice whose candidates are exchanged and picked from: the nodes to erase and
    the ones read after it, each ``topk(full, k).values`` or ``.indices`` in the row-major order of ``[..., k]``."""

    local: fx.Node
    prefix: list[fx.Node]
    world_size: int
    group_name: str
    k: int
    finals: dict[fx.Node, int]  # node read outside the pattern -> 0 (selected values) / 1 (their ids)
    nodes: list[fx.Node] = field(default_factory=list)
    dtensor_input: fx.Node | None = None  # a DTensor head's ``DTensor.from_local(x, mesh, (Replicate(),))``
    proj: fx.Node | None = None  # a DTensor head's projection (``local`` is its ``to_local()``)
    head_nodes: list[fx.Node] = field(default_factory=list)  # between them: redistribute, to_local


def match_exchange(local: fx.Node, example_of: dict | None = None, sharded=None) -> Exchange | str | None:
    """How ``local`` (this rank's ``[..., V / tp]`` slice) is selected from across ranks: an :class:`Exchange`,
    a reason (str) when the form cannot be proven equal to a selection over the full logits, or None when the
    slice is read by no local selection. ``example_of``: placeholders' real values (an offset buffer's);
    ``sharded``: the :class:`vocab_parallel.ShardedOutput` whose ``to_local()`` is ``local`` (a DTensor head)."""
    prefix = _elementwise_prefix(local)
    sliced = prefix[-1] if prefix else local
    shape = patterns.tensor_shape(sliced)
    if not shape:
        return None
    found = _local_selection(sliced, len(shape))
    if found is None or isinstance(found, str):
        return found
    sel, k, keep = found
    first_max = _name(sel) == "max"
    rows, lead = shape[-1], tuple(shape[:-1])
    cand = lead + ((k,) if keep else ())  # one rank's candidates
    values: dict[fx.Node, tuple] = {}
    pattern, offsets = [sel], []
    for user in sel.users:
        if user.target is not operator.getitem or user.args[1] not in (0, 1):
            return f"{user.name} reads {sel.name} other than as (values, indices)"
        values[user] = ("lval",) if user.args[1] == 0 else ("lidx",)
        pattern.append(user)
    nodes = list(local.graph.nodes)
    fresh = {n for n in nodes if _name(n) in FRESH_BUFFERS}
    world = group = None
    picks: list[fx.Node] = []
    for n in nodes[nodes.index(sel) + 1:]:
        inputs = [a for a in n.all_input_nodes if a in values]
        if not inputs or n.op == "output":  # what the output reads is checked below
            continue
        if n in fresh:  # ``torch.empty_like(candidates)``: reads only its shape
            pattern.append(n)
            continue
        tensors = [a for a in inputs if values[a][0] != "shape"]
        if not tensors or _name(n) in SHAPE_READS:  # a size, or arithmetic on sizes (dynamic shapes)
            pattern.append(n)
            values[n] = ("shape",)
            continue
        held = values[tensors[0]]
        tag = held[0]
        value: tuple | str | None = None
        if n.op == "call_function" and n.target in PACKS and tag in ("lval", "fid"):
            value = _pack(n, values, cand)
        elif tag == "lval" and _cast_to(n) is not None:
            value = held if _widens(patterns.example_value(tensors[0]).dtype, _cast_to(n)) else \
                f"{n.name} casts the local values to {_cast_to(n)}, which does not hold every value exactly"
        elif tag == "gidx" and _cast_to(n) is not None and _cast_to(n).is_floating_point:
            value = ("fid",)  # the global ids as floats, to travel with the values (checked at the exchange)
        elif tag == "lidx":
            offset = _offset(n, values, rows, example_of or {})
            if isinstance(offset, tuple):
                offsets.append((n, offset[0]))
                pattern += offset[1]
                value = ("gidx",)
            elif offset is None and _is_c10d(n, "all_gather_into_tensor"):
                value = f"{n.name} exchanges the local ids (0..{rows - 1}) without this rank's first row added"
            else:
                value = offset or f"{n.name} ({_name(n)}) reads the local ids other than to offset them"
        elif tag in ("lval", "gidx", "packed"):
            expected = held[4] if tag == "packed" else cand
            if not _is_c10d(n, "all_gather_into_tensor") or n.args[0] is not inputs[0]:
                value = f"{n.name} ({_name(n)}) reads the local candidates other than by exchanging them"
            elif not isinstance(n.args[1], int) or world not in (None, n.args[1]) or group not in (None, n.args[2]):
                value = f"{n.name} exchanges the candidates over a group unlike the other's, or not static"
            elif not _same(patterns.tensor_shape(inputs[0]), expected):
                value = f"{n.name} gathers candidates of an unexpected shape"
            elif tag == "packed" and not ids_round_trip(n.args[1] * rows, patterns.example_value(n).dtype):
                dtype = patterns.example_value(n).dtype
                value = (f"{n.name} exchanges ids up to {n.args[1] * rows - 1} cast to {dtype}, which holds every "
                         f"integer exactly only up to {exact_integers(dtype)}: they would not round-trip")
            else:
                world, group = n.args[1], n.args[2]
                value = ("gp", held[1:], ("stack",)) if tag == "packed" else \
                    ("g", "val" if tag == "lval" else "id", ("stack",))
        elif tag == "gp":  # values and ids in one gathered tensor: their layout, or one of them taken out
            value = _unpack(n, held, cand)
            if value is None:
                layouts = {a: v[2] for a, v in values.items() if v[0] == "gp"}
                pshape = held[1][3]
                value = _step(n, layouts, fresh, world, pshape[0], pshape)
                value = None if isinstance(value, str) else ("gp", held[1], value)
        elif tag == "parts" and n.target is operator.getitem and isinstance(n.args[1], int):
            value = ("g", _part(held[1], n.args[1]), held[2])
        elif tag == "g" and held[1] == "id" and _cast_to(n) is not None:
            value = held if _holds_ids(_cast_to(n), world * rows) else None
        elif tag == "g" and held[1] == "val" and _name(n) in ("topk", "argmax", "max"):
            value = _pick(n, held[2], keep, first_max, k)
            picks.append(n)
            if len(picks) > 1:  # values of one pick with ids of another could disagree on ties
                value = f"{n.name} picks from the exchanged candidates a second time ({picks[0].name} did)"
        elif tag == "g" and held[1] == "id" and (n.target in GATHER_FUNCTIONS or _name(n) == "gather"):
            value = _lookup(n, values)
        elif tag == "g":
            layouts = {a: v[2] for a, v in values.items() if v[0] == "g" and v[1] == held[1]}
            value = _step(n, layouts, fresh, world, cand[0] if cand else 1, cand)
            value = None if isinstance(value, str) else ("g", held[1], value)  # None: the reason below
        elif tag == "pick" and n.target is operator.getitem and held[1] in ("topk", "max"):
            value = ("sel", 0, held[2]) if n.args[1] == 0 else ("pos",) + held[2:]
        elif tag == "pos" and _name(n) == "unsqueeze" and not held[-1] \
                and _arg(n, 0, "dim") % len(patterns.tensor_shape(n)) == held[3]:
            value = held[:-1] + (True,)
        elif tag == "sel" and _name(n) in SELECTED_VIEWS:
            value = held  # the selection's row-major order is kept (its other axes are 1 or the lead's)
        elif tag == "sel" and held[1] == 1 and _cast_to(n) is not None and _holds_ids(_cast_to(n), world * rows):
            value = held  # ids exchanged as floats, cast back (exact: they round-trip)
        if value is None:
            value = f"{n.name} ({_name(n)}) uses the exchanged candidates in a way nanospec does not follow"
        if isinstance(value, str):  # before any exchange: a plain local selection, no vocabulary-parallel head
            return value if world is not None or _is_c10d(n, "all_gather_into_tensor") else None
        pattern.append(n)
        values[n] = value
        if _name(n) == "copy_":  # the buffer holds the copied value from here on
            values[n.args[0]] = value
            pattern.append(n.args[0])
    if world is None:
        return None
    rank = group_rank(group)
    for n, offset in offsets:
        if offset != rank * rows:
            return f"{n.name} offsets the local ids by {offset}, not this rank's first row {rank} * {rows}"
    if not offsets:
        return "the exchanged ids are local ids (no offset by this rank's first row)"
    inside = set(pattern) | {local, *prefix}
    finals: dict[fx.Node, int] = {}
    for n in pattern:
        outside = [u for u in n.users if u not in inside]
        if not outside:
            continue
        state = values.get(n)
        if state is None or state[0] != "sel":
            what = "a size" if state == ("shape",) else "a value"
            return f"{outside[0].name} reads {n.name}, {what} of the exchange other than the selected values or ids"
        k2, out = state[2], patterns.tensor_shape(n)
        if not (_same(out, lead + (k2,)) or k2 == 1 and _same(out, lead)):
            return f"{n.name} holds the selection in a shape nanospec does not follow"
        finals[n] = state[1]
    if 1 not in finals.values():
        return "the exchanged ids are never read"
    stray = [u for n in (local, *prefix) for u in n.users if u not in inside and _name(u) not in FRESH_BUFFERS]
    if stray:
        return f"{stray[0].name} reads this rank's slice of the logits ({local.name}) itself"
    k2 = {values[n][2] for n in finals}
    if sharded is not None and (sharded.world_size, sharded.group_name) != (world, group):
        return "the candidates are exchanged over another group than the DTensor head's mesh"
    exchange = Exchange(local, prefix, world, group, k2.pop(), finals, _in_graph_order(pattern))
    if sharded is not None:
        exchange.proj, exchange.head_nodes, exchange.dtensor_input = sharded.proj, sharded.nodes, sharded.dtensor_input
    return exchange


PACKS = {torch.stack, *CAT_FUNCTIONS}
CASTS = {"to", "type", "type_as", "float", "double", "half", "bfloat16", "long", "int", "short"}
WIDENING = {(torch.bfloat16, torch.float32), (torch.bfloat16, torch.float64), (torch.float16, torch.float32),
            (torch.float16, torch.float64), (torch.float32, torch.float64)}


def group_rank(group_name: str) -> int:
    """This process's rank in the group a functional collective names."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return torch.distributed.get_rank(_resolve_process_group(group_name))


def _cast_to(n: fx.Node) -> torch.dtype | None:
    """The dtype ``n`` casts its input to (``.to(dtype)``, ``.float()``, ``.type_as(x)``...), same shape and device."""
    if _name(n) not in CASTS or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    src, out = patterns.example_value(n.args[0]), patterns.example_value(n)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor) or src.shape != out.shape \
            or src.device != out.device:
        return None
    return out.dtype


def _widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Every ``src`` value is a ``dst`` value (so order and ties are kept)."""
    return src == dst or (src, dst) in WIDENING


def exact_integers(dtype: torch.dtype) -> int:
    """Every integer of magnitude up to this is exact in the floating ``dtype`` (2**24 for float32)."""
    return 2 ** (round(-math.log2(torch.finfo(dtype).eps)) + 1)


def ids_round_trip(vocab: int, dtype: torch.dtype) -> bool:
    """Ids ``0 .. vocab - 1`` cast to the floating ``dtype`` and back are unchanged."""
    return dtype.is_floating_point and vocab - 1 <= exact_integers(dtype)


def _holds_ids(dtype: torch.dtype, vocab: int) -> bool:
    """An integer dtype that holds ids ``0 .. vocab - 1``."""
    return not dtype.is_floating_point and dtype != torch.bool and torch.iinfo(dtype).max >= vocab - 1


def _pack(n: fx.Node, values: dict, cand: tuple) -> tuple | str:
    """``("packed", kind, axis, first, shape)`` when ``n`` puts one rank's values and its global ids (cast to the
    values' dtype) into one tensor: ``stack`` along ``axis`` (size 2), or ``cat`` along it (values, then ids, or
    the other way round); ``first``: 0 when the values come first."""
    parts, dim = n.args[0] if n.args else n.kwargs.get("tensors"), _arg(n, 0, "dim", 0)
    tags = [values.get(p, ("",))[0] for p in parts] if isinstance(parts, (list, tuple)) else []
    if sorted(tags) != ["fid", "lval"] or not isinstance(dim, int):
        return f"{n.name} ({_name(n)}) packs the candidates with something else than their values and global ids"
    dtypes = {patterns.example_value(p).dtype for p in (*parts, n)}
    if len(dtypes) != 1:
        return f"{n.name} packs values and ids of different dtypes ({sorted(map(str, dtypes))})"
    shape = patterns.tensor_shape(n)
    axis = dim % len(shape)
    if n.target is torch.stack and not _same(shape, cand[:axis] + (2,) + cand[axis:]):
        return f"{n.name} stacks candidates of an unexpected shape"
    if n.target is not torch.stack and not (axis < len(cand) and _same(
            shape, cand[:axis] + (2 * cand[axis],) + cand[axis + 1:]) and isinstance(cand[axis], int)):
        return f"{n.name} concatenates candidates of an unexpected shape"
    return ("packed", "stack" if n.target is torch.stack else "cat", axis, tags.index("lval"), shape)


def _part(first: int, which: int) -> str:
    return "val" if which == first else "id"


def _unpack(n: fx.Node, held: tuple, cand: tuple) -> tuple | None:
    """``("g", "val"|"id", layout)`` when ``n`` takes the values or the ids out of the gathered packed tensor
    (``g[:, 0]``, ``select``, ``g[..., :k]``, ``narrow``), ``("parts", first, layout)`` when it splits it in two
    (``unbind``, ``chunk(2)``, ``split(k)``); None when it does neither."""
    (kind, axis, first, shape), layout = held[1], held[2]
    ndim = len(shape)
    if layout == ("stack",) and axis != 0 or layout[0] == "block" or layout == ("full",) and axis != ndim - 1:
        where, out = axis, layout  # the pack axis is where it was in one rank's tensor
    elif layout[0] == "ranked":
        where = axis if axis < layout[1] else axis + 1
        out = ("ranked", layout[1] - 1 if kind == "stack" and where < layout[1] else layout[1])
        ndim += 1
    else:
        return None
    size = cand[axis] if kind == "cat" else 1
    name, args = _name(n), list(n.args[1:])
    if n.target is operator.getitem:
        at = _index_at(n.args[1], ndim)
        if at is None or at[0] != where:
            return None
        which = _which(kind, at[1], size)
    elif name == "select" and len(args) == 2 and kind == "stack" and _dim(args[0], ndim) == where:
        which = _which(kind, args[1], size)
    elif name == "narrow" and len(args) == 3 and kind == "cat" and _dim(args[0], ndim) == where \
            and args[2] == size:
        which = _which(kind, slice(args[1], args[1] + size), size)
    elif name == "unbind" and kind == "stack" and _dim(_arg(n, 0, "dim", 0), ndim) == where:
        return ("parts", first, out)
    elif name in ("chunk", "split") and kind == "cat" and _dim(_arg(n, 1, "dim", 0), ndim) == where \
            and (name == "chunk" and args[0] == 2 or name == "split" and args[0] in (size, [size, size], (size, size))):
        return ("parts", first, out)
    else:
        return None
    return None if which is None else ("g", _part(first, which), out)


def _dim(dim, ndim: int) -> int | None:
    return dim % ndim if isinstance(dim, int) and not isinstance(dim, bool) else None


def _index_at(index, ndim: int) -> tuple | None:
    """(axis, entry) for an index that is ``:`` everywhere but one axis (``...`` expanded)."""
    index = list(index) if isinstance(index, tuple) else [index]
    if index.count(Ellipsis) > 1:
        return None
    if Ellipsis in index:
        e = index.index(Ellipsis)
        index = index[:e] + [slice(None)] * (ndim - len(index) + 1) + index[e + 1:]
    picked = [(a, i) for a, i in enumerate(index) if i != slice(None)]
    return picked[0] if len(picked) == 1 and len(index) <= ndim else None


def _which(kind: str, entry, size: int) -> int | None:
    """0 or 1: which part an int (stack) or a slice (cat, ``size`` each) takes along the pack axis."""
    if kind == "stack":
        return entry % 2 if isinstance(entry, int) and not isinstance(entry, bool) else None
    if not isinstance(entry, slice) or entry.step not in (None, 1):
        return None
    bounds = (entry.start or 0, entry.stop)
    return {(0, size): 0, (size, 2 * size): 1, (size, None): 1}.get(bounds)


def _local_selection(sliced: fx.Node, ndim: int) -> tuple | str | None:
    """(node, k, keeps its k axis) for the one top-k / max reading ``sliced`` over its last axis."""
    users = [u for u in sliced.users if _name(u) not in FRESH_BUFFERS]
    if len(users) != 1 or users[0].args[0] is not sliced:
        return None
    (sel,) = users
    if _name(sel) == "topk":
        k, dim, largest = _arg(sel, 0, "k"), _arg(sel, 1, "dim", -1), _arg(sel, 2, "largest", True)
        if not isinstance(k, int) or not isinstance(dim, int) or dim % ndim != ndim - 1 or largest is not True:
            return f"{sel.name} is not a largest top-k of this rank's slice over the vocabulary axis"
        return sel, k, True
    if _name(sel) == "max" and len(sel.args) + len(sel.kwargs) > 1:  # max(dim): (values, first indices)
        dim, keep = _arg(sel, 0, "dim"), _arg(sel, 1, "keepdim", False)
        if not isinstance(dim, int) or dim % ndim != ndim - 1 or not isinstance(keep, bool):
            return f"{sel.name} is not a max of this rank's slice over the vocabulary axis"
        return sel, 1, keep
    return None


def _offset(n: fx.Node, values: dict, rows: int, example_of: dict) -> tuple | str | None:
    """(offset, nodes computing it) when ``n`` turns local ids into global ids: ``ids + c`` (an int, a scalar
    buffer), ``arange(c, c + rows)[ids]`` / ``(arange(rows) + c)[ids]``; a reason or None otherwise."""
    name = _name(n)
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
    if (node.target in ADD or _name(node) == "add") and len(node.args) == 2 and not node.kwargs:
        base, c = node.args
        inner = _arange_offset(base, rows)
        if inner is not None and isinstance(c, int) and not isinstance(c, bool):
            return inner[0] + c, inner[1] + [node]
    return None


def _pick(n: fx.Node, layout: tuple, keep: bool, first_max: bool, k: int) -> tuple | str:
    """``("pick", kind, k2, layout, dim, kept)`` when ``n`` selects over the exchanged values' candidate axis."""
    ndim = len(patterns.tensor_shape(n.args[0]))
    if layout == ("full",) and keep:  # [..., tp * k]: rank-major along the last axis
        axis = ndim - 1
    elif layout[0] == "ranked" and k == 1:  # a rank axis next to one candidate per rank
        axis = layout[1]
    else:
        return f"{n.name} picks from candidates laid out in a way nanospec does not follow"
    name = _name(n)
    if name == "topk":
        k2, dim = _arg(n, 0, "k"), _arg(n, 1, "dim", -1)
        largest, ordered = _arg(n, 2, "largest", True), _arg(n, 3, "sorted", True)
        if not isinstance(k2, int) or not isinstance(dim, int) or dim % ndim != axis or largest is not True \
                or ordered is not True:
            return f"{n.name} is not a sorted largest top-k over the exchanged candidates"
        if k2 > k:
            return f"{n.name} takes the top {k2} of each rank's top {k}: not the top {k2} of the vocabulary"
        return ("pick", "topk", k2, layout, axis, True)
    dim, keepdim = _arg(n, 0, "dim"), _arg(n, 1, "keepdim", False)
    if not isinstance(dim, int) or dim % ndim != axis or not isinstance(keepdim, bool):
        return f"{n.name} picks over another axis than the exchanged candidates'"
    if not first_max:
        return (f"{n.name} takes the first maximum of top-{k} candidates: a local topk does not promise its "
                "shard's first maximum, so ties could pick another id than argmax of the logits (use max(-1))")
    if name == "argmax":
        return ("pos", 1, layout, axis, keepdim)
    return ("pick", "max", 1, layout, axis, keepdim)


def _lookup(n: fx.Node, values: dict) -> tuple | str:
    """``ids.gather(dim, pos)`` / ``torch.take_along_dim(ids, pos, dim)`` at the picked positions (kept axis)."""
    if n.target is torch.take_along_dim:
        ids, pos, dim = n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("indices"), _arg(n, 1, "dim")
    else:
        ids, dim, pos = n.args[0], _arg(n, 0, "dim"), _arg(n, 1, "index")
    held, where = values.get(ids), values.get(pos)
    if held is None or held[0] != "g" or where is None or where[0] != "pos" or not isinstance(dim, int):
        return f"{n.name} looks up exchanged ids at positions nanospec did not follow"
    _, k2, layout, axis, kept = where
    if held[2] != layout or dim % len(patterns.tensor_shape(ids)) != axis or not kept:
        return f"{n.name} looks up the ids along another axis or layout than the values were picked from"
    return ("sel", 1, k2)


def remapped(exchange: Exchange, node_map: dict[fx.Node, fx.Node]) -> Exchange:
    """``exchange`` (found in Dynamo's graph) in the backend's copy of it."""
    m = node_map
    return Exchange(m[exchange.local], [m[n] for n in exchange.prefix], exchange.world_size, exchange.group_name,
                    exchange.k, {m[n]: which for n, which in exchange.finals.items()}, [m[n] for n in exchange.nodes],
                    m.get(exchange.dtensor_input), m.get(exchange.proj), [m[n] for n in exchange.head_nodes])


def collapse_exchange(graph: fx.Graph, exchange: Exchange) -> fx.Node:
    """Replace the exchange by ``topk(linear(x, W_shard, b), k, dim=-1)`` over ``[..., V]`` (the projection's value
    is the full logits: a placeholder for ``rewrite_head``, which makes it the compact head); erase the local
    selection, the offsets, both collectives and the pick. Returns the new projection."""
    local = exchange.local
    head = exchange.proj or local
    x, w, b = patterns.match_projection(head)
    anchor = exchange.prefix[-1] if exchange.prefix else local
    fake = patterns.example_value(local)
    with fake.fake_mode:
        full = fake.new_empty(tuple(fake.shape[:-1]) + (exchange.world_size * fake.shape[-1],))
    if exchange.dtensor_input is not None:
        from .vocab_parallel import local_shards

        x, w, b = exchange.dtensor_input.args[0], *local_shards(graph, head, exchange.world_size, fake)
    with graph.inserting_before(anchor.next):
        proj = graph.call_function(torch._C._nn.linear, (x, w, b))
        value = proj
        for op in exchange.prefix:  # the casts and scalings of the slice, now on [..., V]
            value = graph.create_node(op.op, op.target, (value,) + tuple(op.args[1:]), dict(op.kwargs))
        top = graph.call_method("topk", (value, exchange.k), {"dim": -1})
        picked = [graph.call_function(operator.getitem, (top, i)) for i in (0, 1)]
        squeezed = [graph.call_method("squeeze", (p, -1)) for p in picked] if exchange.k == 1 else picked
    proj.meta.update(
        {k: v for k, v in head.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
    proj.meta["example_value"] = proj.meta["val"] = full
    node = proj.next
    while node is not squeezed[-1].next:
        node.meta["example_value"] = node.meta["val"] = patterns.fake_value(node)
        node = node.next
    for final, which in exchange.finals.items():
        ndim = len(patterns.tensor_shape(final))
        new = picked[which] if ndim == len(fake.shape) else squeezed[which]
        dtype = patterns.example_value(final).dtype
        if (patterns.example_value(anchor).dtype, torch.int64)[which] != dtype:  # ids sent as floats, widened values
            with graph.inserting_after(new):
                new = graph.call_method("to", (new, dtype))
            patterns.set_example_value(new)
        final.replace_all_uses_with(new)
    for node in reversed(exchange.nodes):
        graph.erase_node(node)
    erase_local_slice(graph, local, exchange.prefix)
    for node in reversed([head] + exchange.head_nodes[:-1] if exchange.proj is not None else []):
        graph.erase_node(node)  # a DTensor head: redistribute, its projection (to_local is ``local``)
    if exchange.dtensor_input is not None and not exchange.dtensor_input.users:
        graph.erase_node(exchange.dtensor_input)
    for node in dict.fromkeys(squeezed + picked):  # the squeezes first: they read the picks
        if not node.users:
            graph.erase_node(node)
    return proj
