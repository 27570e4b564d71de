"""What the recognition of an exchange of candidates gives (:class:`Exchange`), and the abstract values it follows.

Between this rank's local selection and the final pick every node holds one kind of value (local values, local
ids, global ids, their gathered layouts, the picked positions, the selection): one frozen class each, so the
interpretation in :mod:`.exchange` dispatches on the class of what a node's input holds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from .layouts import Layout


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


@dataclass(frozen=True)
class Marker:
    """A value with no parameter: equal to another of its class only (the frozen dataclass compares classes)."""


class Size(Marker):
    """A size, or arithmetic on sizes (dynamic shapes): reads no candidate."""


class LocalValues(Marker):
    """This rank's candidate values (the local selection's ``[0]``, or a widening cast of it)."""


class LocalIds(Marker):
    """This rank's candidate positions in its slice, ``0 .. V / tp - 1`` (the local selection's ``[1]``)."""


class GlobalIds(Marker):
    """The local ids offset by this rank's first row: ids in ``0 .. V - 1``."""


class FloatIds(Marker):
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
class Laid:
    """A value gathered from every rank and laid out as ``layout``: the layout is followed the same way whatever the
    value (:func:`.layouts.layout_after`)."""

    layout: Layout


@dataclass(frozen=True)
class GatheredPacked(Laid):
    """Every rank's packed tensor (``pack``)."""

    pack: Packed


@dataclass(frozen=True)
class Picked(Laid):
    """A selection of ``k2`` along axis ``axis`` of the gathered candidates; ``kept``: that axis is kept."""

    k2: int
    axis: int
    kept: bool


class Pick(Picked):
    """A ``topk(k2)`` or ``max`` (k2 = 1) over the gathered values: a (values, positions) pair."""


class Positions(Picked):
    """The positions picked (an ``argmax``, or a pick's ``[1]``)."""


@dataclass(frozen=True)
class Parts(Laid):
    """The gathered packed tensor split in two (``unbind``, ``chunk(2)``, ``split(k)``); part ``first`` holds the
    values."""

    first: int


@dataclass(frozen=True)
class Gathered(Laid):
    """Every rank's candidate values (``what == "val"``) or global ids (``"id"``)."""

    what: str


@dataclass(frozen=True)
class Selected:
    """``topk(full logits, k2)``'s values (``which == 0``) or ids (``which == 1``): what the pattern may give out."""

    which: int
    k2: int


Value = Size | LocalValues | LocalIds | GlobalIds | FloatIds | Packed | GatheredPacked | Parts | Gathered | Pick \
    | Positions | Selected
