"""A call captured in a CUDA graph, as a serving engine's draft loop runs it (for the GPU benchmarks and checks)."""
from __future__ import annotations

from typing import Callable

import torch


def graphed(fn: Callable[[], object], device: str) -> Callable[[], None] | None:
    """``fn`` captured in a CUDA graph after three warm-up calls on a side stream: returns the graph's replay, or
    None off CUDA. The captured call is the fourth; its outputs keep their addresses on every replay."""
    if torch.device(device).type != "cuda":
        return None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay
