"""Vocabulary-parallel LM heads in a Dynamo FX graph: recognise the gather of the logits, collapse it.

A hand-written vocabulary-parallel head (Megatron style, vLLM's ``ParallelLMHead`` + gather) computes this
rank's slice of the logits with its shard ``[V / tp, H]`` of the head and all-gathers them. Dynamo turns
``funcol.all_gather_single`` (and its deprecated alias ``all_gather_tensor``), ``dist.all_gather_into_tensor`` and
``dist.all_gather`` into one functional collective and the ops that put the slices side by side::

    local = linear(h, W_shard)                                    # [..., V / tp]
    g = wait_tensor(all_gather_into_tensor(local, tp, group))     # [tp * B, ..., V / tp], rank r's rows r*B..
    z = cat([g.chunk(tp)[0], ..., g.chunk(tp)[tp - 1]], dim=-1)   # [..., V]   (or slices, or copies into buffers)

:func:`gathered_heads` finds such heads by following what every value holds (the stacked slices, rank r's
slice) through ``chunk``/``split``/slices/``copy_`` into fresh buffers, up to a ``cat`` of the slices of ranks
0..tp-1 in order along the vocabulary axis: then ``z[..., r * V/tp + i]`` is ``h . W_r[i]`` (rank r's row i),
whatever the shards hold. Any other use of those values (a local argmax, a permuted cat) is no such head: it
stays dense, with a note saying why. :func:`collapse_gather` replaces the whole pattern by one projection to
``[..., V]`` that the usual rewrite (``rewrite_head``) turns into the compact head, and erases the collective
itself (``wait_tensor`` has a side effect: dead-code elimination would keep it).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from . import effects, patterns
from .find_head import HeadMatch
from .graph import call_arg, node_name

FRESH_BUFFERS = {"empty_like", "new_empty", "empty", "zeros_like", "new_zeros", "zeros"}
CAT_FUNCTIONS = {torch.cat, torch.concat, torch.concatenate}


@dataclass(frozen=True)
class Stacked:
    """The slices of ranks 0..tp-1 stacked along dim 0 (what ``all_gather_into_tensor`` returns)."""


@dataclass(frozen=True)
class Pieces:
    """A list of the slices in rank order (``chunk(tp)`` / ``split(rows)`` of the stacked slices)."""


@dataclass(frozen=True)
class Block:
    """Rank ``rank``'s slice."""

    rank: int


@dataclass(frozen=True)
class Ranked:
    """The slices stacked along a new axis ``axis`` of the slice's shape (``view(tp, B, ...)``, ``movedim``)."""

    axis: int


@dataclass(frozen=True)
class Full:
    """The slices side by side along the last axis in rank order: ``[..., V]``."""


Layout = Stacked | Pieces | Block | Ranked | Full  # how gathered slices are laid out (what :func:`_step` follows)


def _is_c10d(node: fx.Node, name: str) -> bool:
    """``node`` calls the functional collective ``name`` (``_c10d_functional``, or its autograd twin)."""
    target = node.target
    if node.op != "call_function":
        return False
    for namespace in ("_c10d_functional", "_c10d_functional_autograd"):
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None and (target is packet or target is getattr(packet, "default", None)):
            return True
    return False


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


@dataclass(eq=False)
class GatheredHead(HeadMatch):
    """A vocabulary-parallel head: ``weight`` is this rank's shard ``[V / tp, H]``, ``nodes`` the local projections,
    ``vocab_size`` the whole vocabulary V."""

    world_size: int = 1
    group_name: str = ""
    shard_rows: int = 0
    exchanges: dict = field(default_factory=dict)  # projection -> its Exchange (a selection, not a gather)

    __hash__ = object.__hash__


def match_dtensor(proj: fx.Node) -> Gather | str | None:
    """A DTensor ``ColwiseParallel`` head with replicated output, as Dynamo records it::

        xd = DTensor.from_local(x, mesh, (Replicate(),)); z = linear(xd, W, b)    # W: DTensor Shard(0), [V, H]
        full = z.redistribute(placements=(Replicate(),)).to_local()              # [..., V] on every rank

    (the collective appears only after AOTAutograd). None when the weight is no DTensor, a reason for the other
    layouts (an output left sharded, ``Shard(-1)``: each rank gets only its slice)."""
    x, w, b = patterns.match_projection(proj)
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


def match_gather(local: fx.Node) -> Gather | str | None:
    """How ``local`` (a projection's ``[..., V / tp]`` output) is gathered into ``[..., V]``: a :class:`Gather`,
    a reason (str) when it is gathered in a way that cannot be proven to be the concatenation of the slices in
    rank order, or None when it is not gathered at all."""
    prefix, sliced = _elementwise_prefix(local), local
    if prefix:
        sliced = prefix[-1]
    gathers = [u for u in sliced.users if _is_c10d(u, "all_gather_into_tensor")]
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
        value = _step(n, values, fresh | {sliced}, world, rows, shape)
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
    return Gather(local, prefix, world, group, full, _in_graph_order(pattern))


def _elementwise_prefix(local: fx.Node) -> list[fx.Node]:
    """The ops between the projection and its gather that act on each logit alone with scalar operands
    (``.float()``, ``/ temperature``): applied before or after the gather, they give the same values."""
    chain, cur = [], local
    while len(cur.users) == 1:
        (user,) = cur.users
        if not (patterns.is_elementwise(user) and user.all_input_nodes == [cur] and not effects.mutated_inputs(user)
                and user.args and user.args[0] is cur):
            break
        chain.append(user)
        cur = user
    return chain


def _step(n: fx.Node, values: dict[fx.Node, Layout], fresh: set, world: int, rows: int, local: tuple) -> Layout | str:
    """The :data:`Layout` ``n`` holds, given its inputs' (a reason when it is not a step of the gather)."""
    name = node_name(n)
    src = n.args[0] if n.args else None
    held = values.get(src)
    last = len(local) - 1
    out = patterns.tensor_shape(n)
    if _is_c10d(n, "wait_tensor") and isinstance(held, Stacked):
        return held
    if name == "contiguous" and held is not None:
        return held
    if name in ("view", "reshape", "unflatten") and isinstance(held, Stacked) and _same(out, (world,) + tuple(local)):
        return Ranked(0)
    if name in ("view", "reshape") and isinstance(held, Stacked) \
            and all(isinstance(d, int) and d == 1 for d in local[:-1]) \
            and _same(out, tuple(local[:-1]) + (world * local[-1],)):
        return Full()  # one row: the stacked slices are already side by side (funcol writes a batch-1 gather so)
    if isinstance(held, Ranked):
        moved = _moved_axis(n, held.axis, len(local) + 1)
        if moved is not None:
            return Ranked(moved)
        if name in ("view", "reshape", "flatten") and held.axis == last \
                and _same(out, tuple(local[:-1]) + (world * local[-1],)):
            return Full()
    if name == "chunk" and isinstance(held, Stacked) and call_arg(n, 1, "chunks") == world \
            and call_arg(n, 2, "dim", 0) == 0:
        return Pieces()
    if name == "split" and isinstance(held, Stacked) \
            and call_arg(n, 1, "split_size_or_sections", call_arg(n, 1, "split_size")) == rows \
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
            and _same(patterns.tensor_shape(n.args[0]), patterns.tensor_shape(n.args[1]) or ()):
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


def _same(shape: tuple | None, expected: tuple) -> bool:
    """Shapes equal (symbolic sizes compared as expressions, without guarding on them)."""
    return shape is not None and len(shape) == len(expected) and all(
        a is b or (isinstance(a, int) and isinstance(b, int) and a == b) or str(a) == str(b)
        for a, b in zip(shape, expected))


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


def _in_graph_order(nodes: list[fx.Node]) -> list[fx.Node]:
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    return sorted(set(nodes), key=order.__getitem__)


def collapse_gather(graph: fx.Graph, local: fx.Node) -> fx.Node:
    """Replace ``local``'s gather into ``[..., V]`` by one projection ``linear(x, W_shard, b)`` whose value is the
    full logits (its FakeTensor is the ``cat``'s); erase the collective and everything between. The new node is
    a placeholder for ``rewrite_head``, which replaces it by the compact head: it must not run as it is.
    A DTensor head's projection reads the plain input and ``W.to_local()`` (the observers read that shard)."""
    gather = match_dtensor(local) or match_gather(local)
    if not isinstance(gather, Gather):
        raise ValueError(f"nanospec: {local.name} is not a gathered vocabulary-parallel projection: {gather}")
    x, w, b = patterns.match_projection(local)
    anchor = gather.prefix[-1] if gather.prefix else local
    if gather.dtensor_input is not None:
        x, w, b = gather.dtensor_input.args[0], *local_shards(graph, local, gather.world_size,
                                                               patterns.example_value(gather.full))
    with graph.inserting_before(anchor.next):  # in order, after the slice's last op
        proj = graph.call_function(torch._C._nn.linear, (x, w, b))
        value = proj
        for op in gather.prefix:  # the casts and scalings of the slice, now on [..., V]
            value = graph.create_node(op.op, op.target, (value,) + tuple(op.args[1:]), dict(op.kwargs))
    proj.meta.update(
        {k: v for k, v in local.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
    fake, full = patterns.example_value(local), patterns.example_value(gather.full)
    if gather.prefix:  # [..., V] in the projection's dtype (the prefix may cast)
        with fake.fake_mode:
            full = fake.new_empty(full.shape)
    proj.meta["example_value"] = proj.meta["val"] = full
    node = proj.next
    while node is not value.next:
        node.meta["example_value"] = node.meta["val"] = patterns.fake_value(node)
        node = node.next
    gather.full.replace_all_uses_with(value)
    for node in reversed(gather.nodes):
        graph.erase_node(node)
    erase_local_slice(graph, local, gather.prefix)
    if gather.dtensor_input is not None and not gather.dtensor_input.users:
        graph.erase_node(gather.dtensor_input)
    return proj


def local_shards(graph: fx.Graph, proj: fx.Node, world: int, plain: torch.Tensor) -> tuple:
    """``W.to_local()`` (and the bias's) of a DTensor head's projection, read at the top of the graph (observers
    read the shard before the head); ``plain``: a FakeTensor of the fake mode every local value lives in."""
    _, w, b = patterns.match_projection(proj)
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        shards = [graph.call_method("to_local", (t,)) if t is not None else None for t in (w, b)]
    for t, orig in zip(shards, (w, b)):
        if t is not None:
            dtensor = patterns.example_value(orig)
            with plain.fake_mode:
                shape = (dtensor.shape[0] // world,) + tuple(dtensor.shape[1:])
                t.meta["example_value"] = t.meta["val"] = plain.new_empty(shape, dtype=dtensor.dtype)
    return tuple(shards)


def full_logits(local: fx.Node) -> fx.Node:
    """The ``[..., V]`` logits a vocabulary-parallel projection is gathered into (a target observer's top-k reads
    them: the target keeps its gather, which verification needs)."""
    gather = match_dtensor(local) or match_gather(local)
    if not isinstance(gather, Gather):
        raise ValueError(f"nanospec: {local.name} is not a gathered vocabulary-parallel projection: {gather}")
    return gather.full


def erase_local_slice(graph: fx.Graph, local: fx.Node, prefix: list[fx.Node]) -> None:
    """Erase this rank's slice and its elementwise prefix once nothing reads them, with the fresh buffers an
    in-place collective copied them into (dead-code elimination keeps nodes next to side-effecting ones)."""
    sliced = [local, *prefix]
    for buffer in [u for n in sliced for u in n.users if node_name(u) in FRESH_BUFFERS and not u.users]:
        graph.erase_node(buffer)
    for node in reversed(sliced):
        graph.erase_node(node)
