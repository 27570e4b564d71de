"""This rank's ``[..., V / tp]`` slice of the logits, as both vocabulary-parallel forms meet it.

A gather and an exchange both start at a projection onto this rank's shard, possibly followed by elementwise ops
with scalar operands (a cast, a temperature): that prefix gives the same values applied before or after the
collective. Shapes are compared without guarding on symbolic sizes; pattern nodes are erased in graph order.
"""
from __future__ import annotations

import torch.fx as fx

from .. import effects, patterns

FRESH_BUFFERS = {"empty_like", "new_empty", "empty", "zeros_like", "new_zeros", "zeros"}


def elementwise_prefix(local: fx.Node) -> list[fx.Node]:
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


def same_shape(shape: tuple | None, expected: tuple) -> bool:
    """Shapes equal (symbolic sizes compared as expressions, without guarding on them)."""
    return shape is not None and len(shape) == len(expected) and all(
        a is b or (isinstance(a, int) and isinstance(b, int) and a == b) or str(a) == str(b)
        for a, b in zip(shape, expected))


def in_graph_order(nodes: list[fx.Node]) -> list[fx.Node]:
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    return sorted(set(nodes), key=order.__getitem__)
