"""The graph a head is rewritten in, and its hand-over to inductor.

:class:`GraphCopy` is a copy of Dynamo's GraphModule (Dynamo's own must stay intact) that gains extra inputs: the
state tensors, appended as trailing placeholders, with fake values so that every node computed from them has some
too. :func:`compile_graph` is the one call of ``compile_fx`` (every graph the backend returns goes through it).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx
from torch.fx.passes.graph_transform_observer import GraphTransformObserver

from nanospec_fx.compiler.runtime import state_inputs
from nanospec_fx.passes import ObserveInto, StateNodes, effects, patterns
from nanospec_fx.vocab.state import STATE_TENSORS, ActiveVocab


def compile_graph(gm: fx.GraphModule, example_inputs: list, inductor: bool, patches: dict) -> Callable:
    """``gm`` compiled by inductor with the config ``patches`` (``inductor=False``: run eagerly)."""
    if not inductor:
        return gm.forward
    from torch._inductor.compile_fx import compile_fx

    from nanospec_fx.kernels.selection import inductor_cache_tag

    with inductor_cache_tag():  # the kernel config is part of inductor's cache keys (triton_op bodies bake it in)
        return compile_fx(gm, example_inputs, config_patches=patches or None)


class GraphCopy:
    """A copy of Dynamo's GraphModule that gains extra inputs."""

    def __init__(self, gm: fx.GraphModule):
        graph = fx.Graph()
        self.node_map: dict[fx.Node, fx.Node] = {}
        out = graph.graph_copy(gm.graph, self.node_map)
        graph.output(out)
        for old, new in self.node_map.items():
            if hasattr(old, "_dynamo_source"):
                new._dynamo_source = old._dynamo_source
        self.gm = fx.GraphModule(gm, graph)
        self.gm.meta = dict(gm.meta)
        if hasattr(gm, "_param_name_to_source"):
            self.gm._param_name_to_source = gm._param_name_to_source
        self.graph = graph
        self.user_placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.extra = 0
        values = [patterns.example_value(n) for n in graph.nodes]
        self.fake_mode = next((v.fake_mode for v in values if isinstance(v, torch._subclasses.FakeTensor)), None)

    def user_input_position(self, node: fx.Node | None) -> int | None:
        return self.user_placeholders.index(node) if node in self.user_placeholders else None

    def add_inputs(self, names: list[str], tensors: list[torch.Tensor]) -> list[fx.Node]:
        """New trailing placeholders for tensors that are not user inputs (state, drafter weights), with the fake
        values of ``tensors``."""
        last = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
        nodes = []
        with self.graph.inserting_after(last):
            for name in reversed(names):  # each lands right after `last`, so insert in reverse
                nodes.append(self.graph.placeholder(f"nanospec_{name}_{self.extra}"))
        nodes.reverse()
        for node, t in zip(nodes, tensors):
            node._dynamo_source = None  # not a user input; AOT autograd accepts a None source
            # A static input: its address never changes, so CUDA graphs read it in place.
            node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
            if self.fake_mode is not None:
                node.meta["example_value"] = node.meta["val"] = self.fake_mode.from_tensor(t, static_shapes=True)
        self.extra += 1
        return nodes

    def add_state(self, state: ActiveVocab, weight: fx.Node | None, bias: fx.Node | None,
                  head_inputs: tuple[list[str], list[torch.Tensor]] = ([], []), sharded: bool = False) -> ObserveInto:
        """Inputs for ``state``, after ``head_inputs`` (the head weight/bias when the graph does not hold them: a
        target observer's)."""
        head_names, head_tensors = head_inputs if weight is None else ([], [])
        names = head_names + list(STATE_TENSORS) + (["token_to_row"] if state.token_to_row is not None else [])
        nodes = self.add_inputs(names, head_tensors + state_inputs(state))
        if weight is None:
            weight, nodes = nodes[0], nodes[1:]
            if len(head_names) > 1:
                bias, nodes = nodes[0], nodes[1:]
        n = len(STATE_TENSORS)
        into = ObserveInto(weight, bias, StateNodes(*nodes[:n]), state.num_pinned, state.vocab_size,
                           nodes[n] if len(nodes) > n else None)
        into.sharded = sharded
        return into

    def finish(self) -> fx.GraphModule:
        """Dead code removed (placeholders and every op with a side effect stay: observe, ``z.div_(t)``,
        ``out=``), the graph checked and recompiled."""
        with GraphTransformObserver(self.gm, "nanospec_dead_code_elimination", subsystem="nanospec"):
            effects.dead_code_eliminate(self.graph)
        self.graph.lint()
        self.gm.recompile()
        return self.gm
