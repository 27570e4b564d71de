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

    _static_extra_inputs(gm, example_inputs)
    with inductor_cache_tag():  # the kernel config is part of inductor's cache keys (triton_op bodies bake it in)
        return compile_fx(gm, example_inputs, config_patches=patches or None)


EXTRA_PREFIX = "nanospec_"  # the name of every input GraphCopy.add_inputs adds


def _static_extra_inputs(gm: fx.GraphModule, example_inputs: list) -> None:
    """Tell AOT autograd that the inputs nanospec added (state tensors, a target observer's head) have static shapes,
    as their fake values in the graph say: it re-fakifies every real input Dynamo did not fakify, with symbolic sizes
    (the capacity and H would become ``s31``), and in a training graph inductor's ``decompose_auto_functionalized``
    then meets the in-place ops on them with symbolic sizes in one trace and constants in the other and fails
    (a draft loop in grad mode under inductor). A torch without these internals compiles as before."""
    try:
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic, StatefulSymbolicContext

        context = torch._guards.TracingContext.try_get()
    except Exception:  # noqa: BLE001 - another torch: leave AOT autograd's default
        return
    if context is None:
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, x in zip(placeholders, example_inputs):
        if node.name.startswith(EXTRA_PREFIX) and isinstance(x, torch.Tensor) and x not in context.tensor_to_context:
            context.tensor_to_context[x] = StatefulSymbolicContext(
                dynamic_sizes=[DimDynamic.STATIC] * x.dim(), dynamic_strides=[DimDynamic.INFER_STRIDE] * x.dim(),
                tensor_source=ConstantSource(node.name))


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
                nodes.append(self.graph.placeholder(f"{EXTRA_PREFIX}{name}_{self.extra}"))
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
