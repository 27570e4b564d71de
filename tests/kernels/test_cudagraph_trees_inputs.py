"""What inductor's CUDA graphs (``mode="reduce-overhead"``: cudagraph trees) see of a nanospec graph, checked on CPU.

The compiled drafter updates the active set in place (its observe op writes the five state tensors) and its head
reads them. Cudagraph trees replay a graph only if every input it mutates is a static input (an address that never
changes); a graph mutating another input is run without CUDA graphs ("skipping cudagraphs due to mutated inputs").
Here inductor compiles a drafter under ``mode="reduce-overhead"`` on CPU and the test records, where inductor builds
the compiled graph, which inputs it mutates, which are static, and what inductor's own check for cudagraph trees
(``check_for_mutation_ignore_cuda_graph_managed_tensor``) says: nothing (no mutation of a non-static input). On a
CPU the graph is then skipped for its device only; the GPU run itself is benchmarks/gpu_check.sh's.
"""
from __future__ import annotations

import inspect

import pytest
import torch

import nanospec_fx
from drafters import TinyDrafter


def test_the_graph_mutates_only_the_static_state_inputs_so_cudagraph_trees_would_keep_it(monkeypatch):
    from torch._inductor import output_code
    from torch._inductor.cudagraph_utils import check_for_mutation_ignore_cuda_graph_managed_tensor

    seen = []
    real = output_code.CompiledFxGraph.__init__
    signature = inspect.signature(real)

    def recording(self, *args, **kwargs):
        given = signature.bind(self, *args, **kwargs).arguments
        graph, gm, static = given["graph"], given["gm"], list(given["static_input_idxs"])
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        seen.append(dict(mutated=[names[i] for i in sorted(graph.mutated_input_idxs)],
                         mutated_idx=sorted(graph.mutated_input_idxs), static=static,
                         skip=check_for_mutation_ignore_cuda_graph_managed_tensor(
                             gm, graph.mutated_inputs, graph.mutated_input_idxs, static),
                         disabled=given["disabled_cudagraphs_reason"]))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(output_code.CompiledFxGraph, "__init__", recording)
    torch.manual_seed(0)
    model = TinyDrafter(200, 16).eval()
    compiled = torch.compile(model, backend="nanospec", mode="reduce-overhead")
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):  # a cached graph is not built here
        compiled(torch.tensor([[3, 5, 7]]))
        state = nanospec_fx.active_vocab(model)
        before = state.token_ids().tolist()
        out = compiled(torch.tensor([[11, 12, 13]]))
    # the compiled graph updated the state in place, and its head read the update in the same call
    assert before == [3, 5, 7] and state.token_ids().tolist() == [3, 5, 7, 11, 12, 13]
    assert torch.isfinite(out[0, -1, [11, 12, 13]]).all() and not torch.isfinite(out[0, -1, 20])
    assert seen, "inductor compiled no graph"
    graph = seen[0]
    assert len(graph["mutated"]) == 5, graph  # ids, slot_of, cursor, cache_w, cache_b: nothing else
    assert set(graph["mutated_idx"]) <= set(graph["static"]), graph
    assert graph["skip"] is None, graph["skip"]  # cudagraph trees: no mutation of a non-static input
    if graph["disabled"] is not None:  # on a CPU: skipped for its device, not for what it mutates
        assert "mutated" not in graph["disabled"], graph["disabled"]


@pytest.mark.cuda
def test_reduce_overhead_replays_the_step_on_cuda():
    model = TinyDrafter(200, 16).eval().cuda()
    compiled = torch.compile(model, backend="nanospec", mode="reduce-overhead")
    with torch.no_grad():
        for step in range(4):
            compiled(torch.tensor([[3 + step, 50 + step]], device="cuda"))
    state = nanospec_fx.active_vocab(model)
    assert set(state.token_ids().tolist()) >= {3, 4, 5, 6, 50, 51, 52, 53}
