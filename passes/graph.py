"""Graph helpers every pass shares: a call's argument by position or name, a node's op name, where it comes from.

One index convention for :func:`call_arg`: the position in ``node.args`` as FX records it, ``self`` / the input
tensor at 0 (``x.topk(k, dim)``: ``k`` is 1, ``dim`` is 2). This module imports no other pass.
"""
from __future__ import annotations

from typing import Any

import torch.fx as fx


def call_arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a call: its keyword, else ``node.args[index]`` (``self`` / the input at 0), else
    ``default``."""
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if index < len(node.args) else default


def node_name(node: fx.Node) -> str | None:
    """The called op's bare name: a method's, or a function's ``__name__``; None for anything but a call."""
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", None)
    return None


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
