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
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
import torch.fx as fx

from . import patterns
from .graph import call_arg, node_name
from .vocab_parallel import (
    CAT_FUNCTIONS, FRESH_BUFFERS, Block, Full, Layout, Ranked, Stacked, _elementwise_prefix, erase_local_slice,
    _in_graph_order, _is_c10d, _same, _step,
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


# The abstract values: what a node between the local selection and the final pick holds, one class each.


@dataclass(frozen=True)
class Size:
    """A size, or arithmetic on sizes (dynamic shapes): reads no candidate."""


@dataclass(frozen=True)
class LocalValues:
    """This rank's candidate values (the local selection's ``[0]``, or a widening cast of it)."""


@dataclass(frozen=True)
class LocalIds:
    """This rank's candidate positions in its slice, ``0 .. V / tp - 1`` (the local selection's ``[1]``)."""


@dataclass(frozen=True)
class GlobalIds:
    """The local ids offset by this rank's first row: ids in ``0 .. V - 1``."""


@dataclass(frozen=True)
class FloatIds:
    """The global ids cast to a floating dtype, to travel in one tensor with the values (checked at the exchange)."""


@dataclass(frozen=True)
class Packed:
    """One rank's values and global ids in one tensor: ``stack`` (size 2) or ``cat`` along ``axis``; ``first``: 0
    when the values come first; ``shape``: the packed tensor's."""

    kind: str  # "stack" | "cat"
    axis: int
    first: int
    shape: tuple


@dataclass(frozen=True)
class GatheredPacked:
    """Every rank's packed tensor, gathered and laid out as ``layout``."""

    pack: Packed
    layout: Layout


@dataclass(frozen=True)
class Parts:
    """The gathered packed tensor split in two (``unbind``, ``chunk(2)``, ``split(k)``); part ``first`` holds the
    values."""

    first: int
    layout: Layout


@dataclass(frozen=True)
class Gathered:
    """Every rank's candidate values (``what == "val"``) or global ids (``"id"``), laid out as ``layout``."""

    what: str
    layout: Layout


@dataclass(frozen=True)
class _Picked:
    """A selection of ``k2`` along axis ``axis`` of candidates laid out as ``layout``; ``kept``: that axis is kept."""

    k2: int
    layout: Layout
    axis: int
    kept: bool


@dataclass(frozen=True)
class Pick(_Picked):
    """A ``topk(k2)`` or ``max`` (k2 = 1) over the gathered values: a (values, positions) pair."""


@dataclass(frozen=True)
class Positions(_Picked):
    """The positions picked (an ``argmax``, or a pick's ``[1]``)."""


@dataclass(frozen=True)
class Selected:
    """``topk(full logits, k2)``'s values (``which == 0``) or ids (``which == 1``): what the pattern may give out."""

    which: int
    k2: int


Value = Size | LocalValues | LocalIds | GlobalIds | FloatIds | Packed | GatheredPacked | Parts | Gathered | Pick \
    | Positions | Selected


@dataclass
class _Interpretation:
    """What is known while following one local selection forward: every node's abstract value, the nodes of the
    pattern, the id offsets to check against this rank's first row, the exchange's group once seen."""

    sel: fx.Node  # the local top-k / max
    k: int  # candidates per rank
    keep: bool  # the local selection keeps its k axis
    rows: int  # V / tp
    lead: tuple  # the slice's shape but its last axis
    example_of: dict
    fresh: set[fx.Node]
    values: dict[fx.Node, Value] = field(default_factory=dict)
    pattern: list[fx.Node] = field(default_factory=list)
    offsets: list[tuple[fx.Node, int]] = field(default_factory=list)
    picks: list[fx.Node] = field(default_factory=list)
    world: int | None = None
    group: str | None = None

    @property
    def cand(self) -> tuple:
        """One rank's candidates' shape."""
        return self.lead + ((self.k,) if self.keep else ())

    @property
    def first_max(self) -> bool:
        """The local selection returns its slice's first maximum (``max``; a ``topk(1)`` does not promise it)."""
        return node_name(self.sel) == "max"

    def visit(self, n: fx.Node) -> str | None:
        """Record what ``n`` holds; a reason when it reads the candidates in a way not followed."""
        inputs = [a for a in n.all_input_nodes if a in self.values]
        if not inputs or n.op == "output":  # what the output reads is checked by :func:`_finals`
            return None
        if n in self.fresh:  # ``torch.empty_like(candidates)``: reads only its shape
            self.pattern.append(n)
            return None
        tensors = [a for a in inputs if not isinstance(self.values[a], Size)]
        if not tensors or node_name(n) in SHAPE_READS:  # a size, or arithmetic on sizes (dynamic shapes)
            self.pattern.append(n)
            self.values[n] = Size()
            return None
        transfer = TRANSFER.get(type(self.values[tensors[0]]))
        value = transfer(self, n, tensors[0]) if transfer is not None else None
        if value is None:
            value = f"{n.name} ({node_name(n)}) uses the exchanged candidates in a way nanospec does not follow"
        if isinstance(value, str):
            return value
        self.pattern.append(n)
        self.values[n] = value
        if node_name(n) == "copy_":  # the buffer holds the copied value from here on
            self.values[n.args[0]] = value
            self.pattern.append(n.args[0])
        return None

    def layouts(self, same_as: Value) -> dict[fx.Node, Layout]:
        """The layout of every gathered value of ``same_as``'s kind (what :func:`vocab_parallel._step` follows)."""
        return {a: v.layout for a, v in self.values.items()
                if type(v) is type(same_as) and getattr(v, "what", None) == getattr(same_as, "what", None)}


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
    nodes = list(local.graph.nodes)
    run = _Interpretation(sel, k, keep, shape[-1], tuple(shape[:-1]), example_of or {},
                          {n for n in nodes if node_name(n) in FRESH_BUFFERS}, pattern=[sel])
    for user in sel.users:
        if user.target is not operator.getitem or user.args[1] not in (0, 1):
            return f"{user.name} reads {sel.name} other than as (values, indices)"
        run.values[user] = LocalValues() if user.args[1] == 0 else LocalIds()
        run.pattern.append(user)
    for n in nodes[nodes.index(sel) + 1:]:
        reason = run.visit(n)
        if reason is not None:  # before any exchange: a plain local selection, no vocabulary-parallel head
            return reason if run.world is not None or _is_c10d(n, "all_gather_into_tensor") else None
    if run.world is None:
        return None
    return _conclude(run, local, prefix, sharded)


def _conclude(run: _Interpretation, local: fx.Node, prefix: list[fx.Node], sharded) -> Exchange | str:
    """The :class:`Exchange` once every node is followed, if the offsets are this rank's and only selected values
    and ids are read outside the pattern; a reason otherwise."""
    rank = group_rank(run.group)
    for n, offset in run.offsets:
        if offset != rank * run.rows:
            return f"{n.name} offsets the local ids by {offset}, not this rank's first row {rank} * {run.rows}"
    if not run.offsets:
        return "the exchanged ids are local ids (no offset by this rank's first row)"
    inside = set(run.pattern) | {local, *prefix}
    finals = _finals(run, inside)
    if isinstance(finals, str):
        return finals
    if 1 not in finals.values():
        return "the exchanged ids are never read"
    stray = [u for n in (local, *prefix) for u in n.users if u not in inside and node_name(u) not in FRESH_BUFFERS]
    if stray:
        return f"{stray[0].name} reads this rank's slice of the logits ({local.name}) itself"
    k2 = {run.values[n].k2 for n in finals}
    if sharded is not None and (sharded.world_size, sharded.group_name) != (run.world, run.group):
        return "the candidates are exchanged over another group than the DTensor head's mesh"
    exchange = Exchange(local, prefix, run.world, run.group, k2.pop(), finals, _in_graph_order(run.pattern))
    if sharded is not None:
        exchange.proj, exchange.head_nodes, exchange.dtensor_input = sharded.proj, sharded.nodes, sharded.dtensor_input
    return exchange


def _finals(run: _Interpretation, inside: set[fx.Node]) -> dict[fx.Node, int] | str:
    """The pattern's nodes read from outside it -> 0 (selected values) / 1 (their ids); a reason when something
    else is read from outside, or a selection in a shape not followed."""
    finals: dict[fx.Node, int] = {}
    for n in run.pattern:
        outside = [u for u in n.users if u not in inside]
        if not outside:
            continue
        held = run.values.get(n)
        if not isinstance(held, Selected):
            what = "a size" if isinstance(held, Size) else "a value"
            return f"{outside[0].name} reads {n.name}, {what} of the exchange other than the selected values or ids"
        out = patterns.tensor_shape(n)
        if not (_same(out, run.lead + (held.k2,)) or held.k2 == 1 and _same(out, run.lead)):
            return f"{n.name} holds the selection in a shape nanospec does not follow"
        finals[n] = held.which
    return finals


# The transfer functions: what ``n`` holds when it reads ``src`` (its first input holding a candidate), one per
# kind of value ``src`` holds; None when ``n`` is no step nanospec follows (the caller says so).


def _exchange(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | str:
    """``n`` gathers one rank's candidates (values, global ids, or both packed) from every rank."""
    held = run.values[src]
    if not _is_c10d(n, "all_gather_into_tensor") or n.args[0] is not src:
        return f"{n.name} ({node_name(n)}) reads the local candidates other than by exchanging them"
    world, group = n.args[1], n.args[2]
    if not isinstance(world, int) or run.world not in (None, world) or run.group not in (None, group):
        return f"{n.name} exchanges the candidates over a group unlike the other's, or not static"
    if not _same(patterns.tensor_shape(src), held.shape if isinstance(held, Packed) else run.cand):
        return f"{n.name} gathers candidates of an unexpected shape"
    if isinstance(held, Packed) and not ids_round_trip(world * run.rows, patterns.example_value(n).dtype):
        dtype = patterns.example_value(n).dtype
        return (f"{n.name} exchanges ids up to {world * run.rows - 1} cast to {dtype}, which holds every "
                f"integer exactly only up to {exact_integers(dtype)}: they would not round-trip")
    run.world, run.group = world, group
    if isinstance(held, Packed):
        return GatheredPacked(held, Stacked())
    return Gathered("val" if isinstance(held, LocalValues) else "id", Stacked())


def _from_local_values(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | str:
    if n.op == "call_function" and n.target in PACKS:
        return _pack(n, run.values, run.cand)
    to = _cast_to(n)
    if to is not None:
        return run.values[src] if _widens(patterns.example_value(src).dtype, to) else \
            f"{n.name} casts the local values to {to}, which does not hold every value exactly"
    return _exchange(run, n, src)


def _from_local_ids(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | str:
    offset = _offset(n, run.values, run.rows, run.example_of)
    if isinstance(offset, tuple):
        by, computing = offset
        run.offsets.append((n, by))
        run.pattern += computing
        return GlobalIds()
    if offset is None and _is_c10d(n, "all_gather_into_tensor"):
        return f"{n.name} exchanges the local ids (0..{run.rows - 1}) without this rank's first row added"
    return offset or f"{n.name} ({node_name(n)}) reads the local ids other than to offset them"


def _from_global_ids(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | str:
    to = _cast_to(n)
    if to is not None and to.is_floating_point:
        return FloatIds()
    return _exchange(run, n, src)


def _from_float_ids(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | str | None:
    return _pack(n, run.values, run.cand) if n.op == "call_function" and n.target in PACKS else None


def _from_packed(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | str:
    return _exchange(run, n, src)


def _from_gathered_packed(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | None:
    """Values and ids in one gathered tensor: one of them taken out, or the tensor's layout changed."""
    held = run.values[src]
    value = _unpack(n, held, run.cand)
    if value is not None:
        return value
    shape = held.pack.shape
    layout = _step(n, run.layouts(held), run.fresh, run.world, shape[0], shape)
    return None if isinstance(layout, str) else GatheredPacked(held.pack, layout)


def _from_parts(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | None:
    held = run.values[src]
    if n.target is operator.getitem and isinstance(n.args[1], int):
        return Gathered(_part(held.first, n.args[1]), held.layout)
    return None


def _from_gathered(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | str | None:
    """Every rank's values or ids: ids cast, values picked from, ids looked up at the picked positions, or either
    laid out anew."""
    held = run.values[src]
    to = _cast_to(n)
    if held.what == "id" and to is not None:
        return held if _holds_ids(to, run.world * run.rows) else None
    if held.what == "val" and node_name(n) in ("topk", "argmax", "max"):
        run.picks.append(n)
        if len(run.picks) > 1:  # values of one pick with ids of another could disagree on ties
            return f"{n.name} picks from the exchanged candidates a second time ({run.picks[0].name} did)"
        return _pick(n, held.layout, run.keep, run.first_max, run.k)
    if held.what == "id" and (n.target in GATHER_FUNCTIONS or node_name(n) == "gather"):
        return _lookup(n, run.values)
    cand = run.cand
    layout = _step(n, run.layouts(held), run.fresh, run.world, cand[0] if cand else 1, cand)
    return None if isinstance(layout, str) else Gathered(held.what, layout)


def _from_pick(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | None:
    held = run.values[src]
    if n.target is not operator.getitem:
        return None
    return Selected(0, held.k2) if n.args[1] == 0 else Positions(held.k2, held.layout, held.axis, held.kept)


def _from_positions(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | None:
    held = run.values[src]
    if node_name(n) == "unsqueeze" and not held.kept \
            and call_arg(n, 1, "dim") % len(patterns.tensor_shape(n)) == held.axis:
        return replace(held, kept=True)
    return None


def _from_selected(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | None:
    held = run.values[src]
    if node_name(n) in SELECTED_VIEWS:
        return held  # the selection's row-major order is kept (its other axes are 1 or the lead's)
    to = _cast_to(n)
    if held.which == 1 and to is not None and _holds_ids(to, run.world * run.rows):
        return held  # ids exchanged as floats, cast back (exact: they round-trip)
    return None


TRANSFER = {
    LocalValues: _from_local_values, LocalIds: _from_local_ids, GlobalIds: _from_global_ids,
    FloatIds: _from_float_ids, Packed: _from_packed, GatheredPacked: _from_gathered_packed, Parts: _from_parts,
    Gathered: _from_gathered, Pick: _from_pick, Positions: _from_positions, Selected: _from_selected,
}  # no entry for Size: a node reading only sizes is a Size (``visit``)


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
    if node_name(n) not in CASTS or not n.args or not isinstance(n.args[0], fx.Node):
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


def _pack(n: fx.Node, values: dict, cand: tuple) -> Packed | str:
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
    if n.target is torch.stack and not _same(shape, cand[:axis] + (2,) + cand[axis:]):
        return f"{n.name} stacks candidates of an unexpected shape"
    if n.target is not torch.stack and not (axis < len(cand) and _same(
            shape, cand[:axis] + (2 * cand[axis],) + cand[axis + 1:]) and isinstance(cand[axis], int)):
        return f"{n.name} concatenates candidates of an unexpected shape"
    return Packed("stack" if n.target is torch.stack else "cat", axis, kinds.index(LocalValues), shape)


def _part(first: int, which: int) -> str:
    return "val" if which == first else "id"


def _unpack(n: fx.Node, held: GatheredPacked, cand: tuple) -> Gathered | Parts | None:
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
        return Parts(first, out)
    elif name in ("chunk", "split") and kind == "cat" and _dim(call_arg(n, 2, "dim", 0), ndim) == where \
            and (name == "chunk" and args[0] == 2 or name == "split" and args[0] in (size, [size, size], (size, size))):
        return Parts(first, out)
    else:
        return None
    return None if which is None else Gathered(_part(first, which), out)


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


def _local_selection(sliced: fx.Node, ndim: int) -> tuple | str | None:
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


def _offset(n: fx.Node, values: dict, rows: int, example_of: dict) -> tuple | str | None:
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


def _pick(n: fx.Node, layout: Layout, keep: bool, first_max: bool, k: int) -> Pick | Positions | str:
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
        return Pick(k2, layout, axis, True)
    dim, keepdim = call_arg(n, 1, "dim"), call_arg(n, 2, "keepdim", False)
    if not isinstance(dim, int) or dim % ndim != axis or not isinstance(keepdim, bool):
        return f"{n.name} picks over another axis than the exchanged candidates'"
    if not first_max:
        return (f"{n.name} takes the first maximum of top-{k} candidates: a local topk does not promise its "
                "shard's first maximum, so ties could pick another id than argmax of the logits (use max(-1))")
    if name == "argmax":
        return Positions(1, layout, axis, keepdim)
    return Pick(1, layout, axis, keepdim)


def _lookup(n: fx.Node, values: dict) -> Selected | str:
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
