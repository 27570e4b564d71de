"""How the gathered slices of the logits are laid out, followed op by op from the collective.

``all_gather_into_tensor`` stacks the slices of ranks 0..tp-1 along dim 0; ``chunk``/``split``/slices take one
rank's slice out, ``view``/``movedim``/``stack`` give them a rank axis, and a ``cat`` in rank order along the
vocabulary axis puts them side by side. :func:`layout_after` says what one op makes of its input's layout (or why
it is no such step): the gather (:mod:`.gather`) and the exchange of candidates (:mod:`.exchange`) both follow it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx

from .. import patterns
from ..graph import call_arg, node_name
from .collectives import is_c10d
from .slices import same_shape

CAT_FUNCTIONS = {torch.cat, torch.concat, torch.concatenate}


@dataclass(frozen=True)
class Placement:
    """A layout with no parameter: equal to another of its class only (the frozen dataclass compares classes)."""


class Stacked(Placement):
    """The slices of ranks 0..tp-1 stacked along dim 0 (what ``all_gather_into_tensor`` returns)."""


class Pieces(Placement):
    """A list of the slices in rank order (``chunk(tp)`` / ``split(rows)`` of the stacked slices)."""


@dataclass(frozen=True)
class Block:
    """Rank ``rank``'s slice."""

    rank: int


@dataclass(frozen=True)
class Ranked:
    """The slices stacked along a new axis ``axis`` of the slice's shape (``view(tp, B, ...)``, ``movedim``)."""

    axis: int


class Full(Placement):
    """The slices side by side along the last axis in rank order: ``[..., V]``."""


# how gathered slices are laid out (what :func:`layout_after` follows)
Layout = Stacked | Pieces | Block | Ranked | Full


def layout_after(n: fx.Node, values: dict[fx.Node, Layout], fresh: set, world: int, rows: int,
                 local: tuple) -> Layout | str:
    """The :data:`Layout` ``n`` holds, given its inputs' (a reason when it is not a step of the gather)."""
    name = node_name(n)
    src = n.args[0] if n.args else None
    held = values.get(src)
    last = len(local) - 1
    out = patterns.tensor_shape(n)
    if is_c10d(n, "wait_tensor") and isinstance(held, Stacked):
        return held
    if name == "contiguous" and held is not None:
        return held
    stacked = isinstance(held, Stacked)
    if name in ("view", "reshape", "unflatten") and stacked and same_shape(out, (world,) + tuple(local)):
        return Ranked(0)
    if name in ("view", "reshape") and stacked and all(isinstance(d, int) and d == 1 for d in local[:-1]) \
            and same_shape(out, tuple(local[:-1]) + (world * local[-1],)):
        return Full()  # one row: the stacked slices are already side by side (funcol writes a batch-1 gather so)
    if isinstance(held, Ranked):
        moved = _moved_axis(n, held.axis, len(local) + 1)
        if moved is not None:
            return Ranked(moved)
        if name in ("view", "reshape", "flatten") and held.axis == last \
                and same_shape(out, tuple(local[:-1]) + (world * local[-1],)):
            return Full()
    if name == "chunk" and stacked and call_arg(n, 1, "chunks") == world and call_arg(n, 2, "dim", 0) == 0:
        return Pieces()
    if name == "split" and stacked and call_arg(n, 1, "split_size_or_sections", call_arg(n, 1, "split_size")) == rows \
            and call_arg(n, 2, "dim", 0) == 0:
        return Pieces()
    if n.target is operator.getitem and isinstance(held, Pieces) and isinstance(n.args[1], int):
        return Block(n.args[1] % world)
    if n.target is operator.getitem and isinstance(held, Stacked):
        r = _rank_slice(n.args[1], rows)
        if r is not None:
            return Block(r)
    # a copy into a fresh buffer, or into the gathered slice itself (Megatron's ``out[rank] = local`` before
    # ``dist.all_gather(out, local)``: the collective read the slice first, so it is a buffer from here on)
    if name == "copy_" and len(n.args) == 2 and n.args[0] in fresh and n.args[1] in values \
            and same_shape(patterns.tensor_shape(n.args[0]), patterns.tensor_shape(n.args[1]) or ()):
        return values[n.args[1]]
    if name == "copy_" and len(n.args) == 2 and n.args[1] in values and n.args[0] not in fresh:
        return (f"{n.name} copies a gathered slice into {n.args[0].name}, a tensor this call did not create (a buffer "
                "or an input, which outlives the call: removing the gather would lose that write)")
    if n.op == "call_function" and n.target is torch.stack:  # the slices of ranks 0..tp-1 along a new axis
        parts, dim = n.args[0] if n.args else n.kwargs.get("tensors"), call_arg(n, 1, "dim", 0)
        if isinstance(parts, (list, tuple)) and isinstance(dim, int) \
                and [values.get(p) for p in parts] == [Block(r) for r in range(world)]:
            return Ranked(dim % (len(local) + 1))
    if n.op == "call_function" and n.target in CAT_FUNCTIONS:
        parts = n.args[0] if n.args else n.kwargs.get("tensors")
        dim = call_arg(n, 1, "dim", 0)
        if isinstance(parts, (list, tuple)) and [values.get(p) for p in parts] == [Block(r) for r in range(world)] \
                and dim in (last, -1):
            return Full()
    return f"{n.name} ({name}) uses the gathered logits in a way nanospec does not follow"


def _moved_axis(n: fx.Node, axis: int, ndim: int) -> int | None:
    """Where ``permute``/``movedim``/``transpose`` move ``axis`` to, when they keep every other axis in order."""
    name, args = node_name(n), [a for a in n.args[1:]]
    if name == "permute":
        perm = list(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
    elif name in ("movedim", "moveaxis") and len(args) == 2 and all(isinstance(a, int) for a in args):
        src, dst = (a % ndim for a in args)
        perm = [i for i in range(ndim) if i != src]
        perm.insert(dst, src)
    elif name in ("transpose", "swapaxes", "swapdims") and len(args) == 2 and all(isinstance(a, int) for a in args):
        i, j = (a % ndim for a in args)
        perm = list(range(ndim))
        perm[i], perm[j] = perm[j], perm[i]
    else:
        return None
    if sorted(p % ndim for p in perm if isinstance(p, int)) != list(range(ndim)):
        return None
    perm = [p % ndim for p in perm]
    others = [p for p in perm if p != axis]
    return perm.index(axis) if others == sorted(others) else None


def _rank_slice(index, rows) -> int | None:
    """r when ``index`` selects rows ``[r * rows, (r + 1) * rows)`` of dim 0 and keeps every other axis (sizes may be
    symbolic: compared as expressions)."""
    first, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
    if not all(r == slice(None) or r is Ellipsis for r in rest) or not isinstance(first, slice):
        return None
    start, stop, size = _expr(first.start), _expr(first.stop), _expr(rows)
    if first.step not in (None, 1) or start is None or stop is None or size is None:
        return None
    if sympy.expand(stop - start - size) != 0:
        return None
    r = sympy.simplify(start / size) if size != 0 else None
    return int(r) if r is not None and r.is_Integer else None


def _expr(value) -> sympy.Expr | None:
    """An int or a SymInt (or a graph node computing one) as a sympy expression."""
    if isinstance(value, fx.Node):
        value = patterns.example_value(value)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return sympy.Integer(value)
    if isinstance(value, torch.SymInt):
        return value.node.expr
    return None
