"""Vocabulary-parallel LM heads in a Dynamo FX graph: recognise the gather of the logits, collapse it.

A hand-written vocabulary-parallel head (Megatron style, vLLM's ``ParallelLMHead`` + gather) computes this
rank's slice of the logits with its shard ``[V / tp, H]`` of the head and all-gathers them. Dynamo turns
``funcol.all_gather_single`` (and its deprecated alias ``all_gather_tensor``), ``dist.all_gather_into_tensor`` and
``dist.all_gather`` into one functional collective and the ops that put the slices side by side::

    local = linear(h, W_shard)                                    # [..., V / tp]
    g = wait_tensor(all_gather_into_tensor(local, tp, group))     # [tp * B, ..., V / tp], rank r's rows r*B..
    z = cat([g.chunk(tp)[0], ..., g.chunk(tp)[tp - 1]], dim=-1)   # [..., V]   (or slices, or copies into buffers)

:func:`match_gather` recognises such a gather by following what every value holds (the stacked slices, rank r's
slice) through ``chunk``/``split``/slices/``copy_`` into fresh buffers, up to a ``cat`` of the slices of ranks
0..tp-1 in order along the vocabulary axis: then ``z[..., r * V/tp + i]`` is ``h . W_r[i]`` (rank r's row i),
whatever the shards hold. Any other use of those values (a local argmax, a permuted cat) is no such head: it
stays dense, with a note saying why. :func:`.collapse.collapse_gather` replaces the whole pattern by one projection to
``[..., V]`` that the usual rewrite (``rewrite_head``) turns into the compact head, and erases the collective
itself (``wait_tensor`` has a side effect: dead-code elimination would keep it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from .. import patterns, projections
from ..graph import call_arg, node_name
from .collectives import is_c10d
from .layouts import Full, Layout, Stacked, layout_after
from .slices import FRESH_BUFFERS, elementwise_prefix, in_graph_order


@dataclass
class Gather:
    """One rank's slice of the logits gathered into ``[..., V]``: the nodes to erase and the full logits."""

    local: fx.Node  # the projection onto this rank's shard
    prefix: list[fx.Node]  # elementwise ops with scalar operands between it and the gather (a cast, a temperature)
    world_size: int
    group_name: str
    full: fx.Node  # the ``cat`` giving [..., V]
    nodes: list[fx.Node] = field(default_factory=list)  # collective, wait, chunks, buffers, copies, cat
    dtensor_input: fx.Node | None = None  # a DTensor head's ``DTensor.from_local(x, mesh, (Replicate(),))``


@dataclass
class ShardedOutput:
    """A DTensor head whose output stays sharded (``ColwiseParallel()``'s default ``Shard(-1)``): ``local`` is this
    rank's ``[..., V / tp]`` slice (``to_local()``), to be read by a local selection and an exchange."""

    proj: fx.Node
    local: fx.Node
    nodes: list[fx.Node]  # redistribute, to_local
    dtensor_input: fx.Node
    world_size: int
    group_name: str


def match_dtensor(proj: fx.Node) -> Gather | str | None:
    """A DTensor ``ColwiseParallel`` head with replicated output, as Dynamo records it::

        xd = DTensor.from_local(x, mesh, (Replicate(),)); z = linear(xd, W, b)    # W: DTensor Shard(0), [V, H]
        full = z.redistribute(placements=(Replicate(),)).to_local()              # [..., V] on every rank

    (the collective appears only after AOTAutograd). None when the weight is no DTensor, a reason for the other
    layouts (an output left sharded, ``Shard(-1)``: each rank gets only its slice)."""
    x, w, b = projections.match_projection(proj)
    weight = patterns.example_value(w)
    placements = getattr(weight, "placements", None)
    if placements is None:
        return None
    from torch.distributed.tensor import Replicate, Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1 or len(placements) != 1 or not (isinstance(placements[0], Shard) and placements[0].dim == 0):
        return f"its DTensor weight is laid out as {placements} on a {mesh.ndim}-D mesh, not Shard(0) on a 1-D mesh"
    world, shape = mesh.size(), tuple(weight.shape)
    if shape[0] % world:
        return f"its {shape[0]} rows do not split evenly over {world} ranks"
    bias = patterns.example_value(b) if b is not None else None
    if bias is not None and tuple(getattr(bias, "placements", ())) != tuple(placements):
        return "its bias is not sharded like its weight"
    if not (isinstance(x, fx.Node) and node_name(x) == "from_local" and all(
            isinstance(p, Replicate) for p in call_arg(x, 2, "placements", ()))):
        return "its input is not a replicated DTensor made with DTensor.from_local"
    users = list(proj.users)
    redistribute = users[0] if len(users) == 1 and node_name(users[0]) == "redistribute" else None
    layout = call_arg(redistribute, 1, "placements", ()) if redistribute is not None else ()
    after = list(redistribute.users) if redistribute is not None else []
    if len(after) != 1 or node_name(after[0]) != "to_local":
        return "its output is not redistributed and read through to_local()"
    group = mesh.get_group().group_name
    ndim = len(patterns.tensor_shape(proj) or ())
    if len(layout) == 1 and isinstance(layout[0], Shard) and layout[0].dim % ndim == ndim - 1:
        return ShardedOutput(proj, after[0], [redistribute, after[0]], x, world, group)
    if not all(isinstance(p, Replicate) for p in layout):
        return f"its output is redistributed to {layout}, not Replicate() or Shard(-1)"
    return Gather(proj, [], world, group, after[0], [redistribute, after[0]], dtensor_input=x)


def match_gather(local: fx.Node) -> Gather | str | None:
    """How ``local`` (a projection's ``[..., V / tp]`` output) is gathered into ``[..., V]``: a :class:`Gather`,
    a reason (str) when it is gathered in a way that cannot be proven to be the concatenation of the slices in
    rank order, or None when it is not gathered at all."""
    prefix, sliced = elementwise_prefix(local), local
    if prefix:
        sliced = prefix[-1]
    gathers = [u for u in sliced.users if is_c10d(u, "all_gather_into_tensor")]
    if not gathers:
        return None
    if len(gathers) > 1:
        return f"{local.name} is gathered {len(gathers)} times"
    gather = gathers[0]
    world, group = gather.args[1], gather.args[2]
    shape = patterns.tensor_shape(sliced)
    if not isinstance(world, int) or not shape:
        return f"{gather.name} gathers over a group whose size is not static"
    rows = shape[0]
    values: dict[fx.Node, Layout] = {gather: Stacked()}
    nodes = list(local.graph.nodes)
    fresh = {n for n in nodes if n.op in ("call_function", "call_method") and node_name(n) in FRESH_BUFFERS}
    pattern = [gather]
    full = None
    for n in nodes[nodes.index(gather) + 1:]:
        inputs = [a for a in n.all_input_nodes if a in values]
        if not inputs:
            continue
        if n in fresh:  # ``torch.empty_like(gathered)``: reads only its shape
            pattern.append(n)
            continue
        value = layout_after(n, values, fresh | {sliced}, world, rows, shape)
        if isinstance(value, str):
            return value
        pattern.append(n)
        if isinstance(value, Full):
            full = n
            break
        values[n] = value
        if node_name(n) == "copy_":  # the buffer holds the copied value from here on
            values[n.args[0]] = value
            if n.args[0] is not sliced:  # the slice itself (Megatron's list) is erased with the projection
                pattern.append(n.args[0])
    if full is None:
        return f"the gathered slices of {local.name} are not concatenated in rank order along the vocabulary axis"
    inside = set(pattern) | {local, *prefix}
    for n in pattern:
        if n is full:
            continue
        stray = [u for u in n.users if u not in inside]
        if stray:
            return (f"{stray[0].name} reads {n.name}, a value of the gather of {local.name} other than the full "
                    "logits")
    stray = [u for n in (local, *prefix) for u in n.users if u not in inside and node_name(u) not in FRESH_BUFFERS]
    if stray:
        return f"{stray[0].name} reads this rank's slice of the logits ({local.name}) itself"
    return Gather(local, prefix, world, group, full, in_graph_order(pattern))


def full_logits(local: fx.Node) -> fx.Node:
    """The ``[..., V]`` logits a vocabulary-parallel projection is gathered into (a target observer's top-k reads
    them: the target keeps its gather, which verification needs)."""
    gather = match_dtensor(local) or match_gather(local)
    if not isinstance(gather, Gather):
        raise ValueError(f"nanospec: {local.name} is not a gathered vocabulary-parallel projection: {gather}")
    return gather.full
