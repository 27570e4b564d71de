"""Vocabulary-parallel heads read through a local selection and an exchange of (value, id) candidates.

* Graph tests in this process, on a fake process group as rank 1 (its collectives compute nothing; rank 1 makes
  the offset ``rank * V/tp`` non-zero): each spelling is rewritten with no collective left but the observers', the
  spellings nanospec cannot prove stay dense with one warning naming the op.
* Two gloo processes (spawned, with a timeout; slow): exact against plain torch (the full logits with -inf at
  inactive tokens, then max / top-k) and against the dense tensor-parallel drafter with its slice masked, ties
  across ranks included (tp_worker.py ``exchange``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import nanospec_fx
from nanospec_fx.diagnostics.warning import NanoSpecWarning

sys.path.insert(0, str(Path(__file__).parent))
from graph_helpers import call_targets, compile_and_run  # noqa: E402
from gloo_ranks import run_ranks  # noqa: E402
from tp_drafters import EXCHANGES, DTensorExchangeDrafter, ExchangeDrafter, NoOffset, ParallelEmbeddingDrafter  # noqa: E402

V, H, TP, RANK = 64, 16, 2, 1
FAKE_RANK = RANK  # the fake group makes this process rank 1: the offset rank * V/tp is not zero
C10D = torch.ops._c10d_functional
NANOSPEC = torch.ops.nanospec


def _shapes(out) -> list:
    return [tuple(t.shape) for t in (out if isinstance(out, tuple) else (out,))]


@pytest.mark.parametrize("exchange", sorted(EXCHANGES))
@pytest.mark.filterwarnings("ignore::FutureWarning")  # funcol.all_gather_tensor, as users still write it
def test_exchange_forms_lose_both_collectives(fake_group, compiled_graphs, exchange):
    model = ExchangeDrafter(V, H, TP, RANK, exchange=exchange, scale=0.5 if exchange == "topk_list" else None)
    ids = torch.randint(0, V, (2, 3))
    with torch.no_grad():
        expected = _shapes(model(ids))  # eager on the fake group: right shapes, meaningless values
    assert _shapes(compile_and_run(model, ids)) == expected
    targets = call_targets(compiled_graphs[-1])
    assert C10D.all_gather_into_tensor not in targets and targets.count(C10D.all_reduce) == 1  # the observer's
    assert NANOSPEC.compact_topk in targets
    assert nanospec_fx.active_vocab(model).shard.rank == RANK


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_dtensor_colwise_head_with_a_sharded_output_and_an_exchange(fake_group, compiled_graphs):
    from torch.distributed.device_mesh import init_device_mesh

    model = DTensorExchangeDrafter(V, H).parallelize(init_device_mesh("cpu", (TP,)))
    assert _shapes(compile_and_run(model, torch.randint(0, V, (2, 3)))) == [(2, 3)]
    text = str(compiled_graphs[-1])
    assert "all_gather_into_tensor" not in text and "redistribute" not in text and "compact_topk" in text
    assert nanospec_fx.active_vocab(model).shard.shard_rows == V // TP


class NoExchange(ExchangeDrafter):
    """Each rank returns its own shard's best id: no exchange, so no selection over the vocabulary."""

    def forward(self, ids):
        v, i = F.linear(self.embed(ids), self.head_weight).max(-1)
        return i + self.rank * self.head_weight.shape[0]


class IdsSwapped(ExchangeDrafter):
    """Concatenates the ranks' ids in another order than their values: ids and values no longer pair up."""

    def forward(self, ids):
        v, i = F.linear(self.embed(ids), self.head_weight).topk(2, dim=-1)
        i = i + self.start
        vs, js = [torch.empty_like(v) for _ in range(self.tp)], [torch.empty_like(i) for _ in range(self.tp)]
        dist.all_gather(vs, v)
        dist.all_gather(js, i)
        best, pos = torch.cat(vs, -1).topk(2, dim=-1)
        return torch.cat(js[::-1], -1).gather(-1, pos)


class TopOneThenArgmax(ExchangeDrafter):
    """argmax over each rank's topk(1): topk does not promise the first maximum, so ties are unproven."""

    def forward(self, ids):
        v, i = F.linear(self.embed(ids), self.head_weight).topk(1, dim=-1)
        i = i + self.start
        cv = funcol.all_gather_tensor(v, gather_dim=v.dim() - 1, group=dist.group.WORLD)
        ci = funcol.all_gather_tensor(i, gather_dim=i.dim() - 1, group=dist.group.WORLD)
        return ci.gather(-1, cv.argmax(-1, keepdim=True))


class TooFewCandidates(ExchangeDrafter):
    """The top 3 of each rank's top 2: not the top 3 of the vocabulary."""

    def forward(self, ids):
        v, i = F.linear(self.embed(ids), self.head_weight).topk(2, dim=-1)
        i = i + self.start
        cv = funcol.all_gather_tensor(v, gather_dim=v.dim() - 1, group=dist.group.WORLD)
        ci = funcol.all_gather_tensor(i, gather_dim=i.dim() - 1, group=dist.group.WORLD)
        return ci.gather(-1, cv.topk(3, dim=-1)[1])


class TwoPicks(ExchangeDrafter):
    """Values from one pick, ids from another: on ties they could belong to different tokens."""

    def forward(self, ids):
        v, i = F.linear(self.embed(ids), self.head_weight).max(-1)
        i = i + self.rank * self.head_weight.shape[0]
        av = funcol.all_gather_tensor(v, 0, dist.group.WORLD).view((self.tp,) + tuple(v.shape))
        ai = funcol.all_gather_tensor(i, 0, dist.group.WORLD).view((self.tp,) + tuple(i.shape))
        return av.max(0)[0], ai.gather(0, av.argmax(0).unsqueeze(0)).squeeze(0)


@pytest.mark.parametrize("drafter, reason", [
    (TwoPicks, "picks from the exchanged candidates a second time"),
    (NoExchange, "no LM head found"), (NoOffset, "exchanges the local ids .* without this rank's first row"),
    (IdsSwapped, "cat.*uses the exchanged candidates"), (TopOneThenArgmax, "argmax.*does not promise"),
    (TooFewCandidates, "top 3 of each rank's top 2")])
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_exchanges_it_cannot_prove_stay_dense_with_a_warning(fake_group, compiled_graphs, drafter, reason):
    model = drafter(V, H, TP, RANK)
    with pytest.warns(NanoSpecWarning, match=reason) as record:
        compile_and_run(model, torch.randint(0, V, (2, 3)))
    assert len([w for w in record if issubclass(w.category, NanoSpecWarning)]) == 1
    assert (C10D.all_gather_into_tensor in call_targets(compiled_graphs[-1])) == (drafter is not NoExchange)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_ids_packed_into_a_dtype_that_cannot_hold_them_stay_dense(fake_group, compiled_graphs):
    """Values and ids stacked into one bfloat16 tensor: ids above 256 are not exact in bfloat16 (V = 512)."""
    model = ExchangeDrafter(512, H, TP, RANK, exchange="max_packed").to(torch.bfloat16)
    with pytest.warns(NanoSpecWarning, match=r"ids up to 511 cast to torch.bfloat16.* up to 256: .*round-trip") \
            as record:
        compile_and_run(model, torch.randint(0, 512, (2, 3)))
    assert len([w for w in record if issubclass(w.category, NanoSpecWarning)]) == 1
    assert C10D.all_gather_into_tensor in call_targets(compiled_graphs[-1])


def test_exact_integers_of_each_dtype():
    """The largest id range a float dtype carries exactly (every integer up to 2 ** (mantissa bits + 1))."""
    from nanospec_fx.passes.vocab_parallel.id_dtypes import exact_integers, ids_round_trip

    assert [exact_integers(d) for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16)] == \
        [2 ** 53, 2 ** 24, 2 ** 11, 2 ** 8]
    for dtype, limit in ((torch.float32, 2 ** 24), (torch.float16, 2 ** 11), (torch.bfloat16, 2 ** 8)):
        ids = torch.tensor([0, 1, limit // 2 + 1, limit - 1, limit])  # exact up to limit; limit + 1 is not
        assert torch.equal(ids.to(dtype).long(), ids) and ids_round_trip(limit + 1, dtype)
        assert int(torch.tensor(limit + 1).to(dtype)) != limit + 1 and not ids_round_trip(limit + 2, dtype)


@pytest.mark.slow
def test_two_ranks_exchanges_are_exact():
    first, second = run_ranks("exchange")  # each rank asserts exactness against plain torch and the dense drafter
    assert first == second and {"max_view", "topk_list", "max_stack_ties", "dtensor_shard", "max_packed_ties",
                                "topk_packed_list_inductor", "topk_packed_unbind"} <= set(first)


@pytest.mark.parametrize("style", ["megatron", "where"])
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_vocab_parallel_embedding_observes_the_original_ids(fake_group, compiled_graphs, style):
    """Each rank looks up only its rows at ``ids - start``; the tokens fed are ``ids``: they are what is observed
    (no warning that nothing joins the set), before the head reads the set."""
    model = ParallelEmbeddingDrafter(V, H, TP, RANK, style=style)
    assert compile_and_run(model, torch.randint(0, V, (2, 3))).shape == (2, 3, V)
    graph = compiled_graphs[-1]
    targets = call_targets(graph)
    assert C10D.all_gather_into_tensor not in targets
    assert targets.count(C10D.all_reduce) == 2  # the embedding's own, and the observer's rows of the fed ids
    observed = [n for n in graph.nodes if "observe" in str(n.target)]
    assert len(observed) == 1
    feeds, stack = set(), list(observed[0].all_input_nodes)
    while stack:  # what the observed ids are computed from
        node = stack.pop()
        if node not in feeds:
            feeds.add(node)
            stack.extend(node.all_input_nodes)
    assert any(n.op == "placeholder" and "ids" in n.name for n in feeds)
    # the original ids, not ids - start
    assert not any(n.op in ("call_function", "call_method") and "sub" in str(n.target) for n in feeds)


@pytest.mark.slow
def test_two_ranks_vocab_parallel_embedding_feeds_every_id():
    first, second = run_ranks("embedding")  # each rank asserts: every fed id active, exact, identical sets
    assert first == second and set(first) == {"megatron", "where"}


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_explain_prints_the_collective_cost_model(fake_group, compiled_graphs):
    from tp_drafters import VocabParallelDrafter

    model = VocabParallelDrafter(V, H, TP, RANK)
    compile_and_run(model, torch.randint(0, V, (2, 3)))
    text = str(nanospec_fx.explain(model))
    assert f"tensor parallel: tp={TP}, {V // TP} rows per rank" in text and "alpha-beta model" in text
    assert "all-gather of [rows, V]" in text and "H100 SXM" in text and "H200" in text
    # fp32, capacity 32: shard 32 x 16 x 4 B = cache 32 x 16 x 4 B; (tp-1)/tp of [rows, 64] x 4 B; [fed, 16] x 4 B
    assert "alpha + 128*rows/link + 2048/hbm" in text and "2*alpha + 64*fed/link + 2048/hbm" in text
