"""Dead-code elimination removes only nodes known to be pure (``effects.is_pure``): an allow-list.

Each case is a node whose result is unused; the oracle is whether eager's program would change without it
(a write, a random draw, a transform level entered, a call nanospec knows nothing about), written here by hand.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from nanospec_fx.passes import effects


@torch._dynamo.allow_in_graph
def _writes(t):
    t.add_(1)


def _eliminate(build) -> list[str]:
    graph = fx.Graph()
    x = graph.placeholder("x")
    ids = graph.placeholder("ids")
    build(graph, x, ids)
    graph.output(x)
    effects.dead_code_eliminate(graph)
    return [str(n.target) for n in graph.nodes if n.op in ("call_function", "call_method")]


KEPT = {
    "vmap_enter": lambda g, x, ids: g.call_function(torch._C._functorch._vmap_increment_nesting, (2, "error")),
    "predispatch_vmap_exit": lambda g, x, ids: g.call_function(torch._functorch.predispatch._vmap_decrement_nesting),
    "python_call_writing": lambda g, x, ids: g.call_function(_writes, (x,)),
    "in_place_method": lambda g, x, ids: g.call_method("add_", (x, 1)),
    "in_place_flag": lambda g, x, ids: g.call_function(F.relu, (x,), {"inplace": True}),
    "out_argument": lambda g, x, ids: g.call_function(torch.tanh, (x,), {"out": x}),
    "setitem": lambda g, x, ids: g.call_function(operator.setitem, (x, 0, 1.0)),
    "random": lambda g, x, ids: g.call_function(torch.rand_like, (x,)),
    "embedding_max_norm": lambda g, x, ids: g.call_function(F.embedding, (ids, x), {"max_norm": 1.0}),
    "unknown_function": lambda g, x, ids: g.call_function(print, ("hello",)),
}
REMOVED = {
    "elementwise": lambda g, x, ids: g.call_function(torch.tanh, (x,)),
    "functional": lambda g, x, ids: g.call_function(F.layer_norm, (x, (4,))),
    "view_method": lambda g, x, ids: g.call_method("view", (x, -1)),
    "shape_read": lambda g, x, ids: g.call_function(operator.getitem, (g.call_function(getattr, (x, "shape")), 0)),
    "size_method": lambda g, x, ids: g.call_method("size", (x, -1)),
    "cast_method": lambda g, x, ids: g.call_method("float", (x,)),
    "dunder_method": lambda g, x, ids: g.call_method("__and__", (ids, ids)),
    "python_arithmetic": lambda g, x, ids: g.call_function(operator.mul, (x, 2.0)),
    "normalize": lambda g, x, ids: g.call_function(F.normalize, (x,), {"dim": -1}),
    "embedding": lambda g, x, ids: g.call_function(F.embedding, (ids, x)),
}


@pytest.mark.parametrize("name", sorted(KEPT))
def test_an_unused_call_with_an_effect_or_unknown_is_kept(name):
    assert _eliminate(KEPT[name]), f"{name} was eliminated"


@pytest.mark.parametrize("name", sorted(REMOVED))
def test_an_unused_call_known_to_be_pure_is_removed(name):
    assert _eliminate(REMOVED[name]) == [], f"{name} was kept"


# --- What a node may write: an allow-list too (effects.mutated_inputs) ------------------------------------------
# A call nanospec cannot read the effects of (no op schema of its name: a Python function allowed in the graph, a
# module call, a higher-order op) may write every tensor it receives. The oracle is written by hand per case.


def _written(build) -> list[str]:
    graph = fx.Graph()
    x = graph.placeholder("x")
    ids = graph.placeholder("ids")
    node = build(graph, x, ids)
    return sorted(n.name for n in effects.mutated_inputs(node))


WRITES = {
    "python_call": (lambda g, x, ids: g.call_function(_writes, (x,)), ["x"]),
    "python_call_two_tensors": (lambda g, x, ids: g.call_function(_writes, (x, ids)), ["ids", "x"]),
    "module_call": (lambda g, x, ids: g.call_module("sub", (x,)), ["x"]),
    "in_place_flag": (lambda g, x, ids: g.call_function(F.relu, (x,), {"inplace": True}), ["x"]),
    "embedding_max_norm": (lambda g, x, ids: g.call_function(F.embedding, (ids, x), {"max_norm": 1.0}), ["x"]),
    "in_place_method": (lambda g, x, ids: g.call_method("add_", (x, 1)), ["x"]),
    "tensor_method_as_function": (lambda g, x, ids: g.call_function(torch.Tensor.mul_, (x, 2)), ["x"]),
    "out_argument": (lambda g, x, ids: g.call_function(torch.tanh, (ids,), {"out": x}), ["x"]),
    "setitem": (lambda g, x, ids: g.call_function(operator.setitem, (x, 0, 1.0)), ["x"]),
    "pure_function": (lambda g, x, ids: g.call_function(torch.tanh, (x,)), []),
    "pure_functional": (lambda g, x, ids: g.call_function(F.layer_norm, (x, (4,))), []),
    "pure_python": (lambda g, x, ids: g.call_function(operator.add, (x, ids)), []),
    "embedding": (lambda g, x, ids: g.call_function(F.embedding, (ids, x)), []),
    "shape_read": (lambda g, x, ids: g.call_function(getattr, (x, "shape")), []),
    "cast_method": (lambda g, x, ids: g.call_method("float", (x,)), []),
    "batch_dim": (lambda g, x, ids: g.call_function(torch._C._functorch._add_batch_dim, (x, 0, 1)), []),
}


@pytest.mark.parametrize("name", sorted(WRITES))
def test_what_a_call_may_write(name):
    build, expected = WRITES[name]
    assert _written(build) == expected


# End to end: a helper nanospec cannot see into (allowed in the graph) writes, before the head, the head's
# weight or the ids the embedding then reads. The oracle is the eager drafter (dense, the write included) and
# the ids the lookup really read; the old rule (an unknown call writes nothing) cached the head rows before the
# write (a wrong number, no warning) or observed the ids before they were written (tokens fed but inactive).

import warnings  # noqa: E402

import torch.nn as nn  # noqa: E402

import nanospec_fx  # noqa: E402
from helpers import compile_nanospec  # noqa: E402

V = 30


@torch._dynamo.allow_in_graph
def _scale_rows(w):
    w.mul_(1.5)


@torch._dynamo.allow_in_graph
def _shift_ids(ids):
    ids.add_(1)


class _WritesWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.lm_head = nn.Embedding(V, 8), nn.Linear(8, V, bias=False)

    def forward(self, ids):
        h = torch.tanh(self.embed(ids))[:, -1]
        _scale_rows(self.lm_head.weight)  # after the observe of ids cached the head rows
        return self.lm_head(h)


class _WritesIds(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.lm_head = nn.Embedding(V, 8), nn.Linear(8, V, bias=False)

    def forward(self, ids):
        ids = ids.clone()
        _shift_ids(ids)
        return self.lm_head(torch.tanh(self.embed(ids))[:, -1])


def test_an_unknown_call_that_gets_the_head_weight_runs_the_head_dense_with_one_warning():
    torch.manual_seed(0)
    model, reference = _WritesWeight().eval().requires_grad_(False), _WritesWeight().eval().requires_grad_(False)
    reference.load_state_dict(model.state_dict())
    compiled = compile_nanospec(model, capacity=8)
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(ids)
        expected = reference(ids)
    torch.testing.assert_close(out, expected)  # dense: every token finite, the written weight used
    messages = [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]
    assert len(messages) == 1 and "_scale_rows" in messages[0] and "cannot see into" in messages[0], messages


def test_ids_an_unknown_call_writes_are_observed_as_the_lookup_reads_them():
    torch.manual_seed(0)
    model = _WritesIds().eval()
    compiled = compile_nanospec(model, capacity=8)
    with torch.inference_mode():
        out = compiled(torch.tensor([[4, 5, 6]]))
    assert sorted(nanospec_fx.active_vocab(model).token_ids().tolist()) == [5, 6, 7]  # the ids the lookup read
    assert torch.isfinite(out[0, 7]) and out[0, 6].isfinite()
