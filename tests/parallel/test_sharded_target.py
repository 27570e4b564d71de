"""A target observer on a vocabulary-parallel target whose logits stay sharded (issue 19 item 4).

The target selects on its own slice and exchanges (value, id) candidates, or its DTensor ``ColwiseParallel()`` head
keeps a ``Shard(-1)`` output: there are no ``[..., V]`` logits to take a top-k of. The observer adds a local top-k,
an exchange of k candidates per rank and a global top-k, and observes those ids; the target is not changed.

* Graph tests in this process, on a fake process group as rank 1 (the offset ``rank * V/tp`` is not zero).
* Two gloo processes (spawned, with a timeout; slow): the observed ids are plain torch's top-k of the concatenated
  logits at every scored position, on both ranks; the target's outputs are unchanged (tp_worker.py
  ``sharded_target``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nanospec_fx.diagnostics.warning import NanoSpecWarning

sys.path.insert(0, str(Path(__file__).parent))
from graph_helpers import call_targets, compile_and_run  # noqa: E402
from gloo_ranks import run_ranks  # noqa: E402
from tp_drafters import DTensorDrafter, DTensorExchangeDrafter, ExchangeDrafter, NoOffset, VocabParallelDrafter  # noqa: E402

V, H, TP, RANK = 64, 16, 2, 1
FAKE_RANK = RANK
C10D = torch.ops._c10d_functional


def _observe_target(target, drafter, k=3, vocab=V):
    """``target`` compiled as the drafter's target observer (top-``k``), after the drafter made its state."""
    compile_and_run(drafter, torch.randint(0, vocab, (1, 2)))
    compiled = torch.compile(target, backend="nanospec", options={"observe_topk": k, "vocab": drafter,
                                                                  "inductor": False})
    with torch.no_grad():
        return compiled(torch.randint(0, vocab, (2, 3)))


def _offsets(graph) -> list:
    """The ints added to the ids of a local top-k (this rank's first row)."""
    tops = [n for n in graph.nodes if n.target is torch.topk]
    return [u.args[1] for t in tops for g in t.users if g.args[1] == 1 for u in g.users
            if "add" in str(u.target) and isinstance(u.args[1], int)]


@pytest.mark.parametrize("exchange", ["max_view", "topk_list"])
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_an_exchanging_target_gets_a_local_topk_and_an_exchange(fake_group, compiled_graphs, exchange):
    target = ExchangeDrafter(V, H, TP, RANK, exchange=exchange, seed=5)
    with torch.no_grad():
        expected = target(torch.randint(0, V, (2, 3)))
    out = _observe_target(target, VocabParallelDrafter(V, H, TP, RANK))
    assert [t.shape for t in (out if isinstance(out, tuple) else (out,))] == \
        [t.shape for t in (expected if isinstance(expected, tuple) else (expected,))]
    graph = compiled_graphs[-1]
    targets = call_targets(graph)
    assert targets.count(C10D.all_gather_into_tensor) == 3  # the target's own two, the observer's values + ids
    assert C10D.all_reduce in targets  # the observed ids' rows, from their owner shards
    assert RANK * V // TP in _offsets(graph)  # the observer's global ids
    assert any("observe" in str(n.target) for n in graph.nodes)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_ids_a_bfloat16_cannot_hold_travel_apart_from_the_values(fake_group, compiled_graphs):
    """A bfloat16 target over 512 tokens: ids above 256 are not exact in bfloat16, so the observer exchanges its
    values and ids in two collectives instead of one stacked tensor."""
    target = ExchangeDrafter(512, H, TP, RANK, seed=5).to(torch.bfloat16)
    _observe_target(target, VocabParallelDrafter(512, H, TP, RANK), vocab=512)
    graph = compiled_graphs[-1]
    assert call_targets(graph).count(C10D.all_gather_into_tensor) == 4 and RANK * 256 in _offsets(graph)


@pytest.mark.parametrize("kind", ["exchange", "sharded_output"])
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_dtensor_target_with_a_sharded_output(fake_group, compiled_graphs, kind):
    """``ColwiseParallel()`` keeps ``Shard(-1)``: read by an exchange, or returned as each rank's slice (the DTensor
    layout says which tokens the columns are)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (TP,))
    if kind == "exchange":
        target = DTensorExchangeDrafter(V, H, seed=5).parallelize(mesh)
    else:
        target = DTensorDrafter(V, H, seed=5)
        parallelize_module(target, mesh, {"lm_head": ColwiseParallel()})
    out = _observe_target(target, VocabParallelDrafter(V, H, TP, RANK), k=2)
    assert out.shape == ((2, 3) if kind == "exchange" else (2, 3, V // TP))
    graph = compiled_graphs[-1]
    assert RANK * V // TP in _offsets(graph)
    assert call_targets(graph).count(C10D.all_gather_into_tensor) == 1 + 2 * (kind == "exchange")


class SliceOnly(ExchangeDrafter):
    """Returns its own slice of the logits: nothing says which tokens its columns are."""

    def forward(self, ids):
        return F.linear(self.embed(ids), self.head_weight)


@pytest.mark.parametrize("target, reason", [
    (SliceOnly, "no LM head found in the target graph;"),
    (NoOffset, "exchanges the local ids .* without this rank's first row")])
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_sharded_targets_it_cannot_prove_are_not_observed(fake_group, compiled_graphs, target, reason):
    with pytest.warns(NanoSpecWarning, match=reason) as record:
        _observe_target(target(V, H, TP, RANK, seed=5), VocabParallelDrafter(V, H, TP, RANK))
    assert len([w for w in record if issubclass(w.category, NanoSpecWarning)]) == 1
    assert not any("observe" in str(n.target) for n in compiled_graphs[-1].nodes)


@pytest.mark.slow
def test_two_ranks_observe_the_top_k_of_the_concatenated_logits():
    first, second = run_ranks("sharded_target")  # each rank asserts the ids against plain torch's top-k itself
    assert first == second and {"max_view", "topk_list", "dtensor_shard", "dtensor_exchange", "ties"} <= set(first)
