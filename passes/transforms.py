"""Where a Dynamo graph runs inside a functorch transform (``torch.vmap``, ``torch.func.grad``/``vjp``, ``jvp``).

Dynamo inlines these transforms: the graph brackets the transformed function's ops between calls that enter
and leave a functorch level (``_vmap_increment_nesting`` ... ``_vmap_decrement_nesting``), and the values there
are the level's wrapped tensors (batched, or carrying gradients). nanospec's ops have no rule for those
wrappers, so nothing of the rewrite may be placed on them: a head inside such a span runs dense, a read of
the logits inside one ends the post-op chain (it reads the materialised logits), and ids looked up inside
one are observed through the unwrapped tensor they come from.
"""
from __future__ import annotations

import torch.fx as fx

from .graph import node_name

# The calls Dynamo emits to enter and leave each transform's level, by name (``torch._C._functorch`` or its
# pre-dispatch wrappers in ``torch._functorch.predispatch``), and how the user wrote the transform.
ENTER = {
    "_vmap_increment_nesting": "torch.vmap",
    "_grad_increment_nesting": "torch.func.grad/vjp",
    "_jvp_increment_nesting": "torch.func.jvp",
    "_enter_dual_level": "forward-mode AD (torch.func.jvp, torch.autograd.forward_ad)",
}
EXIT = {
    "_vmap_decrement_nesting": "_vmap_increment_nesting",
    "_grad_decrement_nesting": "_grad_increment_nesting",
    "_jvp_decrement_nesting": "_jvp_increment_nesting",
    "_exit_dual_level": "_enter_dual_level",
}
ADD_BATCH_DIM = "_add_batch_dim"


def transform_regions(graph: fx.Graph) -> dict[fx.Node, str]:
    """Every node inside a transform's span -> the outermost transform it runs in (as the user wrote it).

    A leave with no matching enter (a graph that is a piece of a call) puts everything before it inside.
    """
    inside: dict[fx.Node, str] = {}
    stack: list[str] = []
    seen: list[fx.Node] = []
    for node in graph.nodes:
        name = node_name(node)
        if name in EXIT:
            if stack:
                stack.pop()
            else:
                inside.update({n: ENTER[EXIT[name]] for n in seen if n.op != "placeholder" and n not in inside})
        elif stack:
            inside[node] = stack[0]
        if name in ENTER:
            stack.append(ENTER[name])
        seen.append(node)
    return inside


def outside_value(node: fx.Node, regions: dict[fx.Node, str]) -> fx.Node | None:
    """The tensor outside every transform that ``node`` is a batched copy of (``_add_batch_dim(x, dim, level)``,
    maybe nested: it holds exactly x's values), or None when ``node`` is computed inside one."""
    while node in regions:
        if node_name(node) != ADD_BATCH_DIM or not node.args or not isinstance(node.args[0], fx.Node):
            return None
        node = node.args[0]
    return node
