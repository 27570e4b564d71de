"""Graph helpers every pass shares: a call's argument by position or name, a node's op name, where it comes from.

One index convention for :func:`call_arg`: the position in ``node.args`` as FX records it, ``self`` / the input
tensor at 0 (``x.topk(k, dim)``: ``k`` is 1, ``dim`` is 2). One remap of what a pass found in one graph into a
copy of it: :func:`map_nodes`. This module imports no other pass.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx


def call_arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a call: its keyword, else ``node.args[index]`` (``self`` / the input at 0), else
    ``default``."""
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if index < len(node.args) else default


def node_name(node: fx.Node, attribute: bool = False) -> str | None:
    """The called op's bare name, the one way the passes name an op: a method's, an ATen overload's op
    (``aten.numpy_T.default`` -> ``numpy_T``, as torch >= 2.14 records ``W.T``), or a function's ``__name__``;
    with ``attribute``, the attribute a ``getattr`` reads (``getattr(W, "T")`` -> ``T``). None for anything but a
    call."""
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return None
    target = node.target
    if attribute and target is getattr:
        return node.args[1] if len(node.args) > 1 and isinstance(node.args[1], str) else None
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", None)


def describe(node: fx.Node) -> str:
    """A name for ``node``'s op in a message (its target, for any node)."""
    return node_name(node) or str(node.target)


def where(node: fx.Node) -> str:
    """Where ``node`` comes from in the user's code (its last stack frame), or its graph name."""
    trace = node.meta.get("stack_trace")
    if trace:
        lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File")]
        if lines:
            return lines[-1]
    return f"graph node {node.name}"


def downstream(node: fx.Node) -> set[fx.Node]:
    """Every node computed from ``node``, at any depth."""
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    """``nodes`` and every node they are computed from."""
    seen, stack = set(), list(nodes)
    while stack:
        cur = stack.pop()
        if cur not in seen:
            seen.add(cur)
            stack.extend(cur.all_input_nodes)
    return seen


def precedes(a: fx.Node, b: fx.Node) -> bool:
    """Whether ``a`` comes before ``b`` in their graph, as the graph is now.

    FX gives every node an order key, renewed on each insertion, and compares nodes by it: a pass that edits the
    graph asks this instead of an index computed once (such an index knows nothing of the nodes inserted since,
    and a lookup of one of them fails)."""
    return a < b


def map_nodes(value: Any, node_map: dict[fx.Node, fx.Node]) -> Any:
    """``value`` with every node in it replaced by ``node_map[node]``: what a pass found in one graph (a
    ``HeadMatch``, an exchange) as it stands in a copy of that graph. Walks lists, tuples (named ones too), sets,
    dicts (keys and values) and dataclasses field by field (``dataclasses.fields``), so a field added to a
    dataclass is mapped without anyone listing it; a node missing from ``node_map`` raises (never a node of the
    other graph left behind)."""
    if isinstance(value, fx.Node):
        return node_map[value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        mapped = dataclasses.replace(value, **{f.name: map_nodes(getattr(value, f.name), node_map)
                                               for f in fields if f.init})
        for f in fields:
            if not f.init:
                object.__setattr__(mapped, f.name, map_nodes(getattr(value, f.name), node_map))
        return mapped
    if isinstance(value, dict):
        return type(value)((map_nodes(k, node_map), map_nodes(v, node_map)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_nodes(v, node_map) for v in value))
    if isinstance(value, (list, tuple, set, frozenset)):
        return type(value)(map_nodes(v, node_map) for v in value)
    return value
