"""Vocabulary-parallel drafter heads (tensor parallelism): the gather of the logits is recognised and removed.

* Graph tests in this process, on a fake process group (it traces the ranks' graph; its collectives compute
  nothing): each gather form (and DTensor ColwiseParallel) is rewritten with no logits collective left in the
  compiled graph, the forms nanospec cannot follow stay dense with one warning, target observers feed the set.
* Two gloo processes (spawned, with a timeout; slow): exact against the dense tensor-parallel drafter masked to
  the active set, every fed id active, identical sets and slot order on both ranks, for every form, a DTensor head,
  a draft vocabulary and a target observer; and a rank disagreeing on the decision raises the same error on every
  rank instead of hanging.
"""
from __future__ import annotations

import sys
from pathlib import Path

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import nanospec_fx
from nanospec_fx.diagnostics.warning import NanoSpecWarning

sys.path.insert(0, str(Path(__file__).parent))
from gloo_ranks import run_ranks  # noqa: E402
from graph_helpers import call_targets, compile_and_run  # noqa: E402
from tp_drafters import GATHERS, DTensorDrafter, VocabParallelDrafter, gather_funcol  # noqa: E402
from nanospec_fx.vocab import reports as pass_reports
V, H, TP = 64, 16, 2
C10D = torch.ops._c10d_functional


@pytest.mark.parametrize("gather, bias", [("funcol", False), ("list", True), ("into_tensor", False), ("movedim", True),
                                         ("stack", False), ("megatron", True), ("c10d_movedim", True),
                                         ("list_movedim", False)])
def test_gather_forms_lose_their_logits_collective(fake_group, compiled_graphs, gather, bias):
    scale = 0.5 if bias else None  # a temperature and a cast between the slice and its gather
    model = VocabParallelDrafter(V, H, TP, rank=0, gather=gather, bias=bias, scale=scale)
    out = compile_and_run(model, torch.randint(0, V, (2, 3)))
    assert out.shape == (2, 3, V) and out.dtype == (torch.float64 if scale else torch.float32)
    (graph,) = compiled_graphs
    targets = call_targets(graph)
    assert C10D.all_gather_into_tensor not in targets and C10D.wait_tensor in targets  # the observer's only
    assert targets.count(C10D.all_reduce) == 1 + bias  # the rows (and bias entries) of the fed ids, from their owners
    state = nanospec_fx.active_vocab(model)
    assert (state.vocab_size, state.capacity, state.shard.world_size, state.shard.shard_rows) == (V, 32, TP, V // TP)
    assert "head_weight" in str(nanospec_fx.explain(model))


def test_a_one_row_gather_written_as_a_view(fake_group, compiled_graphs):
    """For one row funcol writes the gather as ``stacked.view(1, 1, V)``: the slices are already side by side."""
    model = VocabParallelDrafter(V, H, TP, rank=0)
    assert compile_and_run(model, torch.randint(0, V, (1, 1))).shape == (1, 1, V)
    assert C10D.all_gather_into_tensor not in call_targets(compiled_graphs[-1])


@pytest.mark.parametrize("gather", ["funcol", "list"])
def test_dynamic_shapes_keep_the_rewrite(fake_group, compiled_graphs, gather):
    model = VocabParallelDrafter(V, H, TP, rank=0, gather=gather)
    compiled = torch.compile(model, backend="nanospec", options={"inductor": False, "capacity": 32}, dynamic=True)
    with torch.no_grad():
        for shape in [(2, 3), (3, 5)]:
            assert compiled(torch.randint(0, V, shape)).shape == shape + (V,)
    assert all(C10D.all_gather_into_tensor not in call_targets(g) for g in compiled_graphs)


@pytest.mark.parametrize("output", ["replicate", "shard"])
def test_dtensor_colwise_head(fake_group, compiled_graphs, output):
    """``ColwiseParallel`` with a replicated output is rewritten; a sharded output (each rank its slice) stays dense."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = DTensorDrafter(V, H, bias=True)
    layout = Replicate() if output == "replicate" else Shard(-1)
    parallelize_module(model, init_device_mesh("cpu", (TP,)), {"lm_head": ColwiseParallel(output_layouts=layout)})
    if output == "replicate":
        assert compile_and_run(model, torch.randint(0, V, (2, 3))).shape == (2, 3, V)
        assert nanospec_fx.active_vocab(model).shard.shard_rows == V // TP
        assert "redistribute" not in str(compiled_graphs[-1])
    else:
        with pytest.warns(NanoSpecWarning, match="DTensor in a layout"):
            assert compile_and_run(model, torch.randint(0, V, (2, 3))).shape == (2, 3, V // TP)


@pytest.mark.parametrize("ids", [[5, 2, 5, -1, 70, 9], [-3, 99], [2]])
def test_write_rows_writes_exactly_the_active_ids_rows(ids):
    """Rows of active ids land in their slots; out-of-range and inactive ids change nothing (repeated indices carry
    the same value, so the result is deterministic)."""
    from nanospec_fx.parallel.sharded_state import write_rows

    slot_of = torch.full((V,), -1, dtype=torch.int32)
    slot_of[torch.tensor([5, 2, 40])] = torch.tensor([3, 0, 1], dtype=torch.int32)  # 9 is not active
    cache = torch.randn(4, H)
    token_ids = torch.tensor(ids)
    rows = torch.randn(len(ids), H)
    rows[token_ids == 5] = rows[ids.index(5)].clone() if 5 in ids else 0  # a token's rows agree wherever it appears
    expected = cache.clone()
    for i, t in enumerate(ids):
        if 0 <= t < V and slot_of[t] >= 0:
            expected[slot_of[t]] = rows[i]
    write_rows(token_ids, rows, slot_of, cache, V)
    assert torch.equal(cache, expected)


class DraftLoop(VocabParallelDrafter):
    """Three draft steps inside ``forward``, each gathering its logits and feeding its argmax back."""

    def forward(self, ids):
        picks = []
        for _ in range(3):
            local = F.linear(torch.tanh(self.embed(ids)), self.head_weight)
            ids = gather_funcol(local, self.tp)[:, -1:].argmax(-1)
            picks.append(ids)
        return torch.cat(picks, -1)


def test_a_draft_loop_loses_every_gather(fake_group, compiled_graphs):
    model = DraftLoop(V, H, TP, rank=0)
    assert compile_and_run(model, torch.randint(0, V, (2, 3))).shape == (2, 3)
    targets = call_targets(compiled_graphs[-1])
    assert C10D.all_gather_into_tensor not in targets and targets.count(C10D.all_reduce) == 3  # one per step's ids
    assert len(pass_reports.reports(nanospec_fx.active_vocab(model))[-1].consumers) == 3  # argmax on the compact logits


class LocalArgmaxToo(VocabParallelDrafter):
    """Reads its own slice of the logits besides gathering it: nothing proves what that slice would hold."""

    def forward(self, ids):
        local = F.linear(self.embed(ids), self.head_weight)
        return gather_funcol(local, self.tp), local.argmax(-1)


class RanksSwapped(VocabParallelDrafter):
    """Concatenates the slices in another order than the ranks': not the head's [..., V] logits."""

    def forward(self, ids):
        local = F.linear(self.embed(ids), self.head_weight)
        out = local.new_empty((self.tp * local.shape[0],) + tuple(local.shape[1:]))
        dist.all_gather_into_tensor(out, local)
        first, second = out.chunk(2)
        return torch.cat([second, first], -1)


class IntoPersistentBuffers(VocabParallelDrafter):
    """``dist.all_gather`` into module buffers: the write outlives the call, so the gather cannot be removed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for r in range(self.tp):
            self.register_buffer(f"part{r}", torch.zeros(2, 3, V // self.tp))

    def forward(self, ids):
        local = F.linear(self.embed(ids), self.head_weight)
        out = [getattr(self, f"part{r}") for r in range(self.tp)]
        dist.all_gather(out, local)
        return torch.cat(out, -1)


@pytest.mark.parametrize("drafter, why", [(LocalArgmaxToo, "reads this rank's slice"), (RanksSwapped, r"cat \(cat\) uses the gathered"),
                                          (IntoPersistentBuffers, "did not create.*funcol.all_gather_tensor")])
def test_gathers_it_cannot_follow_stay_dense_with_a_warning(fake_group, compiled_graphs, drafter, why):
    model = drafter(V, H, TP, rank=0)
    with pytest.warns(NanoSpecWarning, match=f"runs unchanged|{why}") as caught:
        compile_and_run(model, torch.randint(0, V, (2, 3)))
    assert re.search(why, " ".join(str(w.message) for w in caught))
    assert C10D.all_gather_into_tensor in call_targets(compiled_graphs[-1])


@pytest.mark.parametrize("target_kind", ["vocab_parallel", "replicated"])
def test_a_target_observer_feeds_a_sharded_state(fake_group, compiled_graphs, target_kind):
    """The target keeps its own gather (verification needs its logits); its top-k of the gathered logits is observed
    with the rows fetched from their owner shards."""
    model = VocabParallelDrafter(V, H, TP, rank=0)
    compile_and_run(model, torch.randint(0, V, (1, 2)))
    target = VocabParallelDrafter(V, H, TP, rank=0, seed=5) if target_kind == "vocab_parallel" else \
        nn.Sequential(nn.Embedding(V, H), nn.Linear(H, V))
    compiled = torch.compile(target, backend="nanospec", options={"observe_topk": 2, "vocab": model, "inductor": False})
    with torch.no_grad():
        assert compiled(torch.randint(0, V, (1, 2))).shape == (1, 2, V)
    targets = call_targets(compiled_graphs[-1])
    assert torch.topk in targets and C10D.all_reduce in targets
    assert (C10D.all_gather_into_tensor in targets) == (target_kind == "vocab_parallel")


# ----------------------------------------------------------------------------- two gloo processes
@pytest.mark.slow
def test_two_ranks_exact_with_identical_sets():
    results = run_ranks("exact")  # each rank asserts exactness, fed ids and identical sets itself
    assert results[0] == results[1] and set(results[0]) == set(GATHERS) - {"stack"} | {"dtensor", "target_observer",
                                                                                   "draft_to_target"}


@pytest.mark.slow
def test_ranks_that_disagree_all_raise_the_same_error():
    first, second = run_ranks("disagree", timeout=240)
    assert first == second and "rank 0: head_weight rewritten" in first["error"] and "rank 1: head_weight dense" \
        in first["error"]
    assert "tensor-parallel target" in first["target_error"] and "rank 0: target observer: 1 top-k and 0 input" \
        in first["target_error"] and "rank 1: target observer: 1 top-k and 1 input" in first["target_error"]


def test_two_ranks_per_request_sets_replicate_the_full_head():
    """The vLLM plugin's tensor-parallel head state (ShardedRequestVocabs): see tp_worker.requests."""
    first, second = run_ranks("requests", timeout=300)
    assert first == second and first["all_ranks"] == [False, True]


def test_vllm_head_one_decision_on_every_rank():
    """The vLLM plugin's head under tensor parallelism: exact on both ranks; a first-call check that fails on one
    rank turns the compact head off on both (see tp_worker.vllm_head)."""
    first, second = run_ranks("vllm_head", timeout=300)
    assert first == second == {
        "agree": {"disabled": False, "compact_calls": 2, "dense_calls": 0, "sharded": True, "other_rank_warned": False},
        "rank_1_differs": {"disabled": True, "compact_calls": 0, "dense_calls": 2, "sharded": True}}


@pytest.mark.slow
def test_ranks_whose_ids_or_local_decisions_differ_all_raise_the_same_error():
    """See tp_worker.diverge: the same ids in another order, other ids of the same count (eagerly and in a compiled
    step), an id out of range on one rank, a reset() on one rank only, other input shapes at the first compile, an unexpected error in the
    rewrite on one rank. Before, these gave wrong rows silently, a gloo abort or a hang."""
    first, second = run_ranks("diverge", timeout=240)
    assert first == second  # the same error on every rank
    for case in ("reordered", "other_ids", "compiled_other_ids", "sticky"):
        assert "fetched head rows for different token ids" in first[case], first[case]
    assert "last reset them at different steps" in first["reset_alone"]  # met in the store, before the fetch
    assert "outside [0, 96)" in first["out_of_range"] and "rank(s) [1] of 2" in first["out_of_range"]
    assert "ids shaped (1, 3); rank 1" in first["shapes"] and "ids shaped (1, 4))" in first["shapes"]
    assert "rank 1: head_weight failed to compile (KeyError" in first["rewrite_error"]


@pytest.mark.slow
def test_ranks_that_observe_different_numbers_of_ids_all_raise_the_same_error():
    """See tp_worker.id_counts (a 20 s collective timeout): an eager observe with 3 ids on rank 0 and 4 on rank 1
    aborted the process in gloo (sizes differ); now every rank raises the same error listing each rank's count,
    no set changes, and the next observe with the same ids works."""
    first, second = run_ranks("id_counts", timeout=240)
    assert first == second  # the same error on every rank
    assert "different numbers of token ids" in first["drafter"] and "(rank 0: 3, rank 1: 4)" in first["drafter"]
    assert "(rank 0: 0, rank 1: 2)" in first["drafter_empty"]
    assert "(rank 0: 1 x 2, rank 1: 1 x 3)" in first["requests"]  # one request row of 2 or 3 ids
    assert "(rank 0: 0 x" in first["requests_empty"] and "rank 1: 1 x 2)" in first["requests_empty"]  # an empty
    # batch on rank 0 meets rank 1's observe (it used to return early: rank 1 waited until the timeout)


@pytest.mark.slow
def test_a_broken_spmd_program_ends_in_one_error_on_every_rank():
    """See tp_worker.spmd_breaks (a 15 s collective and store timeout): with no collective in the draft step
    (observe_inputs=False) a head shard written on one rank only and a reset on one rank only were silent; another
    dtype on one rank passed the compile consensus and aborted in gloo; one rank observing once more, or raising
    before its collective, hung until the collective's timeout. Now every rank raises the same error."""
    first, second = run_ranks("spmd_breaks", timeout=240)
    assert first == second  # the same error on every rank
    assert "written in place on rank(s) [1] only" in first["written_alone"]
    assert "last reset them at different steps" in first["reset_alone"] and "rank 1: 0" in first["reset_alone"]
    assert "last reset them at different steps" in first["still_apart"]  # until every rank resets
    assert "different steps" in first["observed_once_more"] and "rank 0: compiled draft step; rank 1: observe" \
        in first["observed_once_more"]
    assert "took different decisions" in first["dtype"] and "float64" in first["dtype"]
    assert "written in place on rank(s) [1] only" in first["requests_written_alone"]
    assert "rank(s) [1] did not within 15 s" in first["raised_before"] and "rank 1: check-in" \
        in first["raised_before"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario, cause", [("recompile_alone", "exchange 3 of 'compile'"),
                                             ("stale_alone", "written in place on rank(s) [1] only")])
def test_a_rank_that_recompiles_or_refreshes_alone_ends_in_the_same_error_not_a_hang(scenario, cause):
    """See tp_worker.recompile_alone / stale_alone (a 20 s collective and store timeout): rank 1 waits in the
    store, rank 0 in its step's collective; both raise the message rank 1 left, neither hangs nor aborts."""
    first, second = run_ranks(scenario, timeout=240)
    assert first == second and cause in first["error"]


@pytest.mark.slow
def test_a_check_in_costs_three_store_calls():
    """See tp_worker.check_in_cost: a compiled draft step and an eager observe of a vocabulary-parallel head each
    meet the other ranks in the store with one multi_set, one multi_get and one delete_key (before: 5 + world calls:
    a check, two sets, a wait, a get per rank, a delete)."""
    first, second = run_ranks("check_in_cost", timeout=300)
    assert first == second == {what: {"delete_key": 1.0, "multi_get": 1.0, "multi_set": 1.0}
                               for what in ("compiled", "observe")}


@pytest.mark.slow
def test_a_rank_that_runs_the_drafter_eagerly_ends_in_one_error_on_every_rank():
    """See tp_worker.eager_rank (a 15 s collective and store timeout): rank 1 runs the drafter eagerly while rank 0
    calls the compiled one. Both raise the same nanospec error within the timeout: rank 1 named with its last step
    (rank 0 waited in the store, not in a collective), or the two steps side by side when rank 1's next nanospec
    call meets rank 0 still waiting."""
    first, second = run_ranks("eager_rank", timeout=240)
    assert first == second, (first, second)
    assert ("rank(s) [1] did not within 15 s" in first["error"] and "rank 1: check-in 1, compiled draft step"
            in first["error"]) or "rank 0: compiled draft step; rank 1: observe" in first["error"], first
