"""Whether autograd records at a node of a Dynamo graph.

Dynamo guards on the grad mode the call starts in and traces every change inside the frame
(``with torch.enable_grad():``, a ``@torch.no_grad()`` forward, ``torch.set_grad_enabled``) as a
``torch._C._set_grad_enabled(mode)`` call in graph order. So the mode at a node is the last such
call before it, or the mode at compile time when there is none.
"""
from __future__ import annotations

import torch
import torch.fx as fx

_SET_GRAD = {torch._C._set_grad_enabled}


def grad_enabled_at(graph: fx.Graph, nodes: list[fx.Node], initial: bool) -> bool:
    """Whether grad mode is on at any of ``nodes`` (in graph order), starting from ``initial``."""
    wanted, enabled, any_on = set(nodes), initial, False
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _SET_GRAD and node.args and isinstance(node.args[0], bool):
            enabled = node.args[0]
        elif node in wanted:
            any_on = any_on or enabled
    return any_on
