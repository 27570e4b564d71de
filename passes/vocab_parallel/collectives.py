"""Which graph nodes are c10d functional collectives, and this process's rank in the group one names.

Dynamo records ``funcol`` / ``dist`` collectives as ``_c10d_functional`` ops (or their autograd twins) taking the
group by name: the vocabulary-parallel patterns are recognised by these ops, and an offset checked against the
rank the name resolves to.
"""
from __future__ import annotations

import torch
import torch.fx as fx


def is_c10d(node: fx.Node, name: str) -> bool:
    """``node`` calls the functional collective ``name`` (``_c10d_functional``, or its autograd twin)."""
    target = node.target
    if node.op != "call_function":
        return False
    for namespace in ("_c10d_functional", "_c10d_functional_autograd"):
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None and (target is packet or target is getattr(packet, "default", None)):
            return True
    return False


def group_rank(group_name: str) -> int:
    """This process's rank in the group a functional collective names."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return torch.distributed.get_rank(_resolve_process_group(group_name))
