"""A recognised vocabulary-parallel pattern replaced by one projection onto the whole vocabulary.

Both forms (a gather of the slices, an exchange of candidates) collapse into ``linear(x, W_shard, b)`` whose value
stands for the full ``[..., V]`` logits: a placeholder that ``rewrite_head`` turns into the compact head (the state
holds the rows this rank needs), so no collective of the pattern is left. The pattern's nodes are erased here
because the collective's ``wait_tensor`` has a side effect: dead-code elimination would keep it.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import patterns, projections
from ..graph import node_name
from .exchange_values import Exchange
from .gather import Gather, match_dtensor, match_gather
from .slices import FRESH_BUFFERS


def collapse_gather(graph: fx.Graph, local: fx.Node) -> fx.Node:
    """Replace ``local``'s gather into ``[..., V]`` by one projection ``linear(x, W_shard, b)`` whose value is the
    full logits (its FakeTensor is the ``cat``'s); erase the collective and everything between. The new node is
    a placeholder for ``rewrite_head``, which replaces it by the compact head: it must not run as it is.
    A DTensor head's projection reads the plain input and ``W.to_local()`` (the observers read that shard)."""
    gather = match_dtensor(local) or match_gather(local)
    if not isinstance(gather, Gather):
        raise ValueError(f"nanospec: {local.name} is not a gathered vocabulary-parallel projection: {gather}")
    x, w, b = projections.match_projection(local)
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


def collapse_exchange(graph: fx.Graph, exchange: Exchange) -> fx.Node:
    """Replace the exchange by ``topk(linear(x, W_shard, b), k, dim=-1)`` over ``[..., V]`` (the projection's value
    is the full logits: a placeholder for ``rewrite_head``, which makes it the compact head); erase the local
    selection, the offsets, both collectives and the pick. Returns the new projection."""
    local = exchange.local
    head = exchange.proj or local
    x, w, b = projections.match_projection(head)
    anchor = exchange.prefix[-1] if exchange.prefix else local
    fake = patterns.example_value(local)
    with fake.fake_mode:
        full = fake.new_empty(tuple(fake.shape[:-1]) + (exchange.world_size * fake.shape[-1],))
    if exchange.dtensor_input is not None:
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


def local_shards(graph: fx.Graph, proj: fx.Node, world: int, plain: torch.Tensor) -> tuple:
    """``W.to_local()`` (and the bias's) of a DTensor head's projection, read at the top of the graph (observers
    read the shard before the head); ``plain``: a FakeTensor of the fake mode every local value lives in."""
    _, w, b = projections.match_projection(proj)
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


def erase_local_slice(graph: fx.Graph, local: fx.Node, prefix: list[fx.Node]) -> None:
    """Erase this rank's slice and its elementwise prefix once nothing reads them, with the fresh buffers an
    in-place collective copied them into (dead-code elimination keeps nodes next to side-effecting ones)."""
    sliced = [local, *prefix]
    for buffer in [u for n in sliced for u in n.users if node_name(u) in FRESH_BUFFERS and not u.users]:
        graph.erase_node(buffer)
    for node in reversed(sliced):
        graph.erase_node(node)
