"""Whether autograd records at a node of a Dynamo graph, and keeping it so after the rewrite.

Dynamo guards on the grad mode the call starts in and traces every change inside the frame as a call in graph
order: ``with torch.no_grad():`` / ``torch.enable_grad()`` / ``torch.set_grad_enabled(m)`` (block or function
form) and ``@torch.no_grad()``-decorated forwards as ``torch._C._set_grad_enabled(mode)``;
``torch.inference_mode(m)`` (block or decorator) as ``_enter_inference_mode(m)`` ... ``_exit_inference_mode(ctx)``,
which turns grad mode off for ``m=True`` and ON for ``m=False`` (``inference_mode(False)`` re-enables grad inside a
``no_grad`` region), and restores the mode at its enter. So the mode at a node is found by one walk in graph order.

The rewrite inserts nodes away from the node whose value they stand for: a ``scatter_logits`` that materialises
the logits right before their reader (the graph output, after the region has closed), the fused ``head_logits``
there. Eager computed that value where the head ran, so its ``requires_grad`` and ``grad_fn`` come from the mode
there; :func:`keep_grad_modes` wraps every node that would run in another mode in the one it stands for.
"""
from __future__ import annotations

import torch
import torch.fx as fx

_SET_GRAD = {torch._C._set_grad_enabled}
_ENTER_INFERENCE = {torch.autograd.grad_mode._enter_inference_mode}
_EXIT_INFERENCE = {torch.autograd.grad_mode._exit_inference_mode}

#: meta key: the node whose grad mode an inserted node must run in (it computes that node's value, or its form)
VALUE_OF = "nanospec_grad_mode_of"


def is_mode_switch(node: fx.Node) -> bool:
    """A node that changes the grad mode (it computes nothing the mode of which matters)."""
    return node.op == "call_function" and node.target in (_SET_GRAD | _ENTER_INFERENCE | _EXIT_INFERENCE)


def grad_modes(graph: fx.Graph, initial: bool) -> dict[fx.Node, bool]:
    """The grad mode each node of ``graph`` runs in, the call starting in ``initial``."""
    modes: dict[fx.Node, bool] = {}
    enabled = initial
    entered: dict[fx.Node, bool] = {}  # an _enter_inference_mode node -> the mode it restores at its exit
    for node in graph.nodes:
        modes[node] = enabled
        if node.op != "call_function" or not node.args:
            continue
        if node.target in _SET_GRAD and isinstance(node.args[0], bool):
            enabled = node.args[0]
        elif node.target in _ENTER_INFERENCE and isinstance(node.args[0], bool):
            entered[node], enabled = enabled, not node.args[0]
        elif node.target in _EXIT_INFERENCE and node.args[0] in entered:
            enabled = entered[node.args[0]]
    return modes


def grad_enabled_at(graph: fx.Graph, nodes: list[fx.Node], initial: bool) -> bool:
    """Whether grad mode is on at any of ``nodes``, the call starting in ``initial``."""
    modes = grad_modes(graph, initial)
    return any(modes.get(n, False) for n in nodes)


def stands_for(node: fx.Node, original: fx.Node) -> fx.Node:
    """Record that ``node`` (inserted by a pass) computes ``original``'s value: it must run in ``original``'s mode."""
    node.meta[VALUE_OF] = original
    return node


def keep_grad_modes(graph: fx.Graph, before: dict[fx.Node, bool], initial: bool) -> int:
    """Make every node run in the grad mode eager ran it in: a node of the graph before the rewrite in its own
    mode (``before``, from :func:`grad_modes`), a node inserted for one (:func:`stands_for`) in that one's. A
    node that would run in another mode gets ``_set_grad_enabled(wanted)`` before it and the mode back after it.
    Returns how many nodes were wrapped."""

    def wanted(node: fx.Node, depth: int = 0) -> bool | None:
        if node in before:
            return before[node]
        origin = node.meta.get(VALUE_OF)
        return wanted(origin, depth + 1) if isinstance(origin, fx.Node) and depth < 64 else None

    current = grad_modes(graph, initial)
    wrapped = 0
    for node in list(graph.nodes):
        if node.op in ("placeholder", "output", "get_attr") or is_mode_switch(node):
            continue
        mode = wanted(node)
        if mode is None or mode == current[node]:
            continue
        with graph.inserting_before(node):
            graph.call_function(torch._C._set_grad_enabled, (mode,))
        with graph.inserting_after(node):
            graph.call_function(torch._C._set_grad_enabled, (current[node],))
        wrapped += 1
    return wrapped
