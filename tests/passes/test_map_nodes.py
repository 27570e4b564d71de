"""One remap of what a pass found in Dynamo's graph into the backend's copy: every field, at any depth.

Three hand-written remaps each dropped fields (``reach``, ``sources``, ``transposed``); ``graph.map_nodes`` walks
``dataclasses.fields``, so these tests set every field of the head types to a value of its own and check that the
mapped head holds the same value, with each node replaced by its copy.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch
import torch.fx as fx

from nanospec_fx.passes.find_head import HeadMatch
from nanospec_fx.passes.graph import map_nodes
from nanospec_fx.passes.vocab_parallel.exchange_values import Exchange
from nanospec_fx.passes.vocab_parallel.heads import GatheredHead


def _graph_and_copy() -> tuple[fx.Graph, dict[fx.Node, fx.Node]]:
    g = fx.Graph()
    x, w, b, s = (g.placeholder(n) for n in ("x", "w", "b", "scale"))
    y = g.call_function(torch.nn.functional.linear, (x, w, b))
    z = g.call_function(torch.mul, (y, s))
    g.output(z)
    copy, node_map = fx.Graph(), {}
    copy.graph_copy(g, node_map)
    return g, node_map


def _names(value):
    """``value`` with every node replaced by ("node", its name, its graph): the shape of what it holds."""
    if isinstance(value, fx.Node):
        return ("node", value.name, id(value.graph))
    if dataclasses.is_dataclass(value):
        return (type(value).__name__, {f.name: _names(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, dict):
        return sorted((repr(_names(k)), _names(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return [_names(v) for v in value]
    return value


def _every_field_set(head: HeadMatch) -> None:
    """Each field of ``head`` differs from its default (a new field must be given a value here to pass)."""
    for f in dataclasses.fields(head):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert getattr(head, f.name) != default, f"test the remap of {type(head).__name__}.{f.name}: give it a value"


def _check_mapped(head, mapped, node_map) -> None:
    assert type(mapped) is type(head)
    new_graph = id(next(iter(node_map.values())).graph)
    expected = _names(head)
    # the same structure, every node named alike, and living in the copy
    old_graph = id(head.weight.graph)
    assert repr(_names(mapped)) == repr(expected).replace(str(old_graph), str(new_graph))
    for f in dataclasses.fields(head):
        assert repr(_names(getattr(mapped, f.name))).count(str(old_graph)) == 0, f.name


def test_every_field_of_a_head_match_is_mapped():
    g, node_map = _graph_and_copy()
    x, w, b, s, y, z = list(g.nodes)[:6]
    head = HeadMatch(w, [y], "lm_head.weight", 97, 8, biases=[b], module_path="lm_head", reach="selection",
                     transposed=True, sources=[s], stacked=(1, 0, 2))
    _every_field_set(head)
    _check_mapped(head, map_nodes(head, node_map), node_map)


def test_every_field_of_a_gathered_head_is_mapped_exchanges_included():
    g, node_map = _graph_and_copy()
    x, w, b, s, y, z = list(g.nodes)[:6]
    exchange = Exchange(y, [z], 2, "group", 3, {z: 1}, nodes=[z], dtensor_input=x, proj=y, head_nodes=[s])
    head = GatheredHead(w, [y], "lm_head.weight", 97, 8, biases=[b], module_path="lm_head", reach="selection",
                        transposed=True, sources=[s], stacked=(1, 0, 2), world_size=2, group_name="group", shard_rows=49,
                        exchanges={y: exchange})
    _every_field_set(head)
    mapped = map_nodes(head, node_map)
    _check_mapped(head, mapped, node_map)
    (key, value), = mapped.exchanges.items()
    assert key is node_map[y] and value.finals == {node_map[z]: 1} and value.dtensor_input is node_map[x]


def test_a_field_added_to_a_head_is_mapped_without_being_named():
    @dataclass(eq=False)
    class HeadWithMore(HeadMatch):
        extra: dict = field(default_factory=dict)  # a field the remap was never told about
        pairs: tuple = ()

    g, node_map = _graph_and_copy()
    x, w, b, s, y, z = list(g.nodes)[:6]
    head = HeadWithMore(w, [y], "h", 97, 8, extra={"scale": [s]}, pairs=((y, z),))
    mapped = map_nodes(head, node_map)
    assert mapped.extra == {"scale": [node_map[s]]} and mapped.pairs == ((node_map[y], node_map[z]),)


def test_a_node_missing_from_the_map_raises():
    g, node_map = _graph_and_copy()
    w, y = list(g.nodes)[1], list(g.nodes)[4]
    del node_map[y]
    with pytest.raises(KeyError):
        map_nodes(HeadMatch(w, [y], "h", 97, 8), node_map)
