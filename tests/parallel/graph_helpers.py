"""What the tensor-parallel graph tests read back: the ops of a graph, one compiled call."""
from __future__ import annotations

import torch


def call_targets(graph) -> list:
    """The ops a graph calls (overload packets)."""
    return [getattr(n.target, "overloadpacket", n.target) for n in graph.nodes if n.op == "call_function"]


def compile_and_run(model, ids, **options):
    """``model(ids)`` compiled with nanospec (no inductor, capacity 32 unless ``options`` say otherwise)."""
    compiled = torch.compile(model, backend="nanospec", options={"inductor": False, "capacity": 32, **options})
    with torch.no_grad():
        return compiled(ids)
