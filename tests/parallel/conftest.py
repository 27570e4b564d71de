"""Fixtures of the tensor-parallel graph tests: a fake process group (it traces a rank's graph; its collectives
compute nothing) and the graphs the backend hands to its compiler."""
from __future__ import annotations

import pytest
import torch.distributed as dist

import nanospec_fx.compiler.lowering as lowering

TP = 2


@pytest.fixture(scope="module")
def fake_group(request):
    """A fake process group of ``TP`` ranks, as the test module's ``FAKE_RANK`` (default 0)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=getattr(request.module, "FAKE_RANK", 0), world_size=TP)
    yield
    dist.destroy_process_group()


@pytest.fixture
def compiled_graphs(monkeypatch):
    """The graphs the backend hands to its compiler (after the rewrite)."""
    graphs = []
    compile_graph = lowering.compile_graph

    def spy(gm, example_inputs, inductor, patches):
        graphs.append(gm.graph)
        return compile_graph(gm, example_inputs, inductor, patches)

    monkeypatch.setattr(lowering, "compile_graph", spy)
    return graphs
