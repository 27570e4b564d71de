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
