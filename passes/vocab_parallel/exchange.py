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

import operator
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from .. import patterns
from ..graph import call_arg, node_name
from .collectives import group_rank, is_c10d
from .exchange_steps import local_selection, lookup_ids, offset_ids, pack, pick, unpack, which_part
from .exchange_values import (
    Exchange, FloatIds, Gathered, GatheredPacked, GlobalIds, LocalIds, LocalValues, Packed, Parts, Pick, Positions,
    Selected, Size, Value,
)
from .id_dtypes import cast_to, exact_integers, holds_ids, ids_round_trip, widens
from .layouts import CAT_FUNCTIONS, Layout, Stacked, layout_after
from .slices import FRESH_BUFFERS, elementwise_prefix, in_graph_order, same_shape

GATHER_FUNCTIONS = {torch.gather, torch.take_along_dim}
PACKS = {torch.stack, *CAT_FUNCTIONS}
SHAPE_READS = {"size", "dim", "sym_size", "numel"}
SELECTED_VIEWS = {"squeeze", "unsqueeze", "view", "reshape", "contiguous", "flatten"}


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
        """The layout of every gathered value of ``same_as``'s kind (what :func:`layout_after` follows)."""
        return {a: v.layout for a, v in self.values.items()
                if type(v) is type(same_as) and getattr(v, "what", None) == getattr(same_as, "what", None)}


def match_exchange(local: fx.Node, example_of: dict | None = None, sharded=None) -> Exchange | str | None:
    """How ``local`` (this rank's ``[..., V / tp]`` slice) is selected from across ranks: an :class:`Exchange`,
    a reason (str) when the form cannot be proven equal to a selection over the full logits, or None when the
    slice is read by no local selection. ``example_of``: placeholders' real values (an offset buffer's);
    ``sharded``: the :class:`.gather.ShardedOutput` whose ``to_local()`` is ``local`` (a DTensor head)."""
    prefix = elementwise_prefix(local)
    sliced = prefix[-1] if prefix else local
    shape = patterns.tensor_shape(sliced)
    if not shape:
        return None
    found = local_selection(sliced, len(shape))
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
            return reason if run.world is not None or is_c10d(n, "all_gather_into_tensor") else None
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
    exchange = Exchange(local, prefix, run.world, run.group, k2.pop(), finals, in_graph_order(run.pattern))
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
        if not (same_shape(out, run.lead + (held.k2,)) or held.k2 == 1 and same_shape(out, run.lead)):
            return f"{n.name} holds the selection in a shape nanospec does not follow"
        finals[n] = held.which
    return finals


# The transfer functions: what ``n`` holds when it reads ``src`` (its first input holding a candidate), one per
# kind of value ``src`` holds; None when ``n`` is no step nanospec follows (the caller says so).


def _exchange(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | str:
    """``n`` gathers one rank's candidates (values, global ids, or both packed) from every rank."""
    held = run.values[src]
    if not is_c10d(n, "all_gather_into_tensor") or n.args[0] is not src:
        return f"{n.name} ({node_name(n)}) reads the local candidates other than by exchanging them"
    world, group = n.args[1], n.args[2]
    if not isinstance(world, int) or run.world not in (None, world) or run.group not in (None, group):
        return f"{n.name} exchanges the candidates over a group unlike the other's, or not static"
    if not same_shape(patterns.tensor_shape(src), held.shape if isinstance(held, Packed) else run.cand):
        return f"{n.name} gathers candidates of an unexpected shape"
    if isinstance(held, Packed) and not ids_round_trip(world * run.rows, patterns.example_value(n).dtype):
        dtype = patterns.example_value(n).dtype
        return (f"{n.name} exchanges ids up to {world * run.rows - 1} cast to {dtype}, which holds every "
                f"integer exactly only up to {exact_integers(dtype)}: they would not round-trip")
    run.world, run.group = world, group
    if isinstance(held, Packed):
        return GatheredPacked(Stacked(), held)
    return Gathered(Stacked(), "val" if isinstance(held, LocalValues) else "id")


def _from_local_values(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | str:
    if n.op == "call_function" and n.target in PACKS:
        return pack(n, run.values, run.cand)
    to = cast_to(n)
    if to is not None:
        return run.values[src] if widens(patterns.example_value(src).dtype, to) else \
            f"{n.name} casts the local values to {to}, which does not hold every value exactly"
    return _exchange(run, n, src)


def _from_local_ids(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | str:
    offset = offset_ids(n, run.values, run.rows, run.example_of)
    if isinstance(offset, tuple):
        by, computing = offset
        run.offsets.append((n, by))
        run.pattern += computing
        return GlobalIds()
    if offset is None and is_c10d(n, "all_gather_into_tensor"):
        return f"{n.name} exchanges the local ids (0..{run.rows - 1}) without this rank's first row added"
    return offset or f"{n.name} ({node_name(n)}) reads the local ids other than to offset them"


def _from_global_ids(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | str:
    to = cast_to(n)
    if to is not None and to.is_floating_point:
        return FloatIds()
    return _exchange(run, n, src)


def _from_float_ids(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | str | None:
    return pack(n, run.values, run.cand) if n.op == "call_function" and n.target in PACKS else None


def _from_packed(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | str:
    return _exchange(run, n, src)


def _from_gathered_packed(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | None:
    """Values and ids in one gathered tensor: one of them taken out, or the tensor's layout changed."""
    held = run.values[src]
    value = unpack(n, held, run.cand)
    if value is not None:
        return value
    shape = held.pack.shape
    layout = layout_after(n, run.layouts(held), run.fresh, run.world, shape[0], shape)
    return None if isinstance(layout, str) else GatheredPacked(layout, held.pack)


def _from_parts(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | None:
    held = run.values[src]
    if n.target is operator.getitem and isinstance(n.args[1], int):
        return Gathered(held.layout, which_part(held.first, n.args[1]))
    return None


def _from_gathered(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | str | None:
    """Every rank's values or ids: ids cast, values picked from, ids looked up at the picked positions, or either
    laid out anew."""
    held = run.values[src]
    to = cast_to(n)
    if held.what == "id" and to is not None:
        return held if holds_ids(to, run.world * run.rows) else None
    if held.what == "val" and node_name(n) in ("topk", "argmax", "max"):
        run.picks.append(n)
        if len(run.picks) > 1:  # values of one pick with ids of another could disagree on ties
            return f"{n.name} picks from the exchanged candidates a second time ({run.picks[0].name} did)"
        return pick(n, held.layout, run.keep, run.first_max, run.k)
    if held.what == "id" and (n.target in GATHER_FUNCTIONS or node_name(n) == "gather"):
        return lookup_ids(n, run.values)
    cand = run.cand
    layout = layout_after(n, run.layouts(held), run.fresh, run.world, cand[0] if cand else 1, cand)
    return None if isinstance(layout, str) else Gathered(layout, held.what)


def _from_pick(run: _Interpretation, n: fx.Node, src: fx.Node) -> Value | None:
    held = run.values[src]
    if n.target is not operator.getitem:
        return None
    return Selected(0, held.k2) if n.args[1] == 0 else Positions(held.layout, held.k2, held.axis, held.kept)


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
    to = cast_to(n)
    if held.which == 1 and to is not None and holds_ids(to, run.world * run.rows):
        return held  # ids exchanged as floats, cast back (exact: they round-trip)
    return None


TRANSFER = {
    LocalValues: _from_local_values, LocalIds: _from_local_ids, GlobalIds: _from_global_ids,
    FloatIds: _from_float_ids, Packed: _from_packed, GatheredPacked: _from_gathered_packed, Parts: _from_parts,
    Gathered: _from_gathered, Pick: _from_pick, Positions: _from_positions, Selected: _from_selected,
}  # no entry for Size: a node reading only sizes is a Size (``visit``)
