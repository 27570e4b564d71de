"""The compiler plans once, then executes (issue 41 item 1): the plan's decisions as data, a head that ends dense
leaves no state behind, the options travel a short way, and no module of the package holds several ideas."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch._dynamo
import torch.nn as nn

import nanospec_fx
from nanospec_fx.compiler.plan import CompilePlan, Dense, Rewrite
from nanospec_fx.vocab.state import registered_state
from nanospec_fx.vocab.config import StateConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
V, H = 48, 8


class BreakAfterHead(nn.Module):
    """The head's logits leave the graph at a graph break; a temperature runs on them in the next graph."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, ids):
        z = self.lm_head(self.embed(ids))
        torch._dynamo.graph_break()
        return z / 0.7


class TwoHeadsMeet(nn.Module):
    """The logits of two heads are added: no one active set makes the sum exact."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.a = nn.Linear(H, V, bias=False)
        self.b = nn.Linear(H, V, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        return self.a(h) + self.b(h)


def _plan_of(model: nn.Module, ids: torch.Tensor, options: dict) -> CompilePlan:
    """The plan of Dynamo's first graph of ``model``, built while Dynamo compiles it (as the backend does)."""
    plans = []

    def planning(gm, example_inputs, **_):
        plans.append(CompilePlan.build(gm, example_inputs, None, options))
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=planning)(ids)
    return plans[0]


def test_a_head_that_ends_dense_at_a_graph_break_leaves_no_registered_state():
    torch.manual_seed(0)
    model = BreakAfterHead().eval()
    ids = torch.tensor([[1, 2, 3]])
    compiled = torch.compile(model, backend="nanospec", options={"capacity": 16, "inductor": False,
                                                                  "observe_inputs": False})
    with pytest.warns(nanospec_fx.NanoSpecWarning, match="its logits leave this graph"), torch.no_grad():
        out = compiled(ids)
    torch.testing.assert_close(out, model(ids))  # dense: the eager logits, every token finite
    assert registered_state(model.lm_head.weight) is None  # the rewrite's state is made only once it succeeded
    with pytest.raises(LookupError, match="runs dense: its logits leave this graph"):  # and the lookup says why
        nanospec_fx.active_vocab(model)


def test_the_plan_holds_each_heads_decision_and_the_resolved_config():
    torch.manual_seed(0)
    ids = torch.tensor([[1, 2, 3]])
    plan = _plan_of(nn.Sequential(nn.Embedding(V, H), nn.Linear(H, V, bias=False)).eval(), ids,
                    {"capacity": 16, "inductor": False, "policy": "static", "static_size": 4,
                     "frequencies": list(range(V))})
    (head,) = plan.heads
    assert isinstance(head.decision, Rewrite) and head.warnings == ()
    assert isinstance(plan.config, StateConfig) and plan.config.policy == "static" and not plan.config.observes
    assert plan.role == "drafter" and plan.position.whole_call

    plan = _plan_of(TwoHeadsMeet().eval(), ids, {"capacity": 16})
    assert [type(h.decision) for h in plan.heads] == [Dense, Dense]
    assert all("the logits of two heads are combined" in h.decision.reason for h in plan.heads)
    said = [w for h in plan.heads for w in h.warnings]
    assert len(said) == 1 and "a.weight and b.weight" in said[0]  # one warning naming both heads


def test_a_heads_meeting_is_said_once_and_leaves_no_state():
    torch.manual_seed(0)
    model = TwoHeadsMeet().eval()
    compiled = torch.compile(model, backend="nanospec", options={"capacity": 16, "inductor": False})
    with pytest.warns(nanospec_fx.NanoSpecWarning, match="run dense") as caught, torch.no_grad():
        compiled(torch.tensor([[1, 2]]))
    assert sum("run dense" in str(w.message) for w in caught) == 1
    assert registered_state(model.a.weight) is None and registered_state(model.b.weight) is None


def test_the_options_walk_of_one_compile_is_short():
    """The options of one drafter compile pass through few modules and seldom come back to one
    (``benchmarks/options_walk.py``; issue 41: <= 15 stays, <= 5 returns; 39 and 23 before the plan)."""
    spec = importlib.util.spec_from_file_location("options_walk", ROOT / "benchmarks" / "options_walk.py")
    walk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(walk)
    measured = walk.measure()
    assert measured["stays"] <= 15 and measured["returns"] <= 5, measured["walk"]
    assert "nanospec_fx.compiler.plan" in measured["walk"]  # the walk sees the plan (it measures something)


def test_no_module_of_the_compiler_is_over_300_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "nanospec_fx" / "compiler").glob("*.py")}
    assert len(sizes) >= 8 and max(sizes.values()) <= 300, sizes


def test_the_vllm_head_and_the_compiler_build_states_through_one_factory():
    from nanospec_fx.compiler.head_kind import request_vocabs
    from nanospec_fx.vocab.request_vocab import RequestVocabs

    weight = torch.randn(V + 4, H)  # padded rows past the vocabulary
    vocabs = request_vocabs(weight, 2, V, None, capacity=8)
    assert type(vocabs) is RequestVocabs and vocabs.rows == V
