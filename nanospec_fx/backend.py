"""The ``nanospec`` torch.compile backend.

``torch.compile(drafter, backend="nanospec")`` hands Dynamo's FX graph to
:func:`nanospec_backend`, which

1. finds the LM head (``passes/find_head.py``),
2. copies the graph and appends the head's :class:`ActiveVocab` tensors as extra inputs,
3. rewrites the head into nanospec ops and observes the token-id inputs (``passes/``),
4. compiles the result with inductor, and returns a callable that appends the state tensors
   to every call. The state is updated in place, so one compile serves every active set.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.fx as fx

from nanospec_fx.options import NanoSpecOptions, mode_config
from nanospec_fx.passes import HeadMatch, StateNodes, find_heads, insert_observers, rewrite_head
from nanospec_fx.state import ActiveVocab, state_for

BACKEND_NAME = "nanospec"


class NanoSpecWarning(UserWarning):
    """Something nanospec could not do; the drafter still runs, unchanged where it says so."""


def warn_once(message: str) -> None:
    """Warn at compile time (not per call); Python's default filter shows each message once."""
    warnings.warn(message, NanoSpecWarning, stacklevel=3)


def nanospec_backend(gm: fx.GraphModule, example_inputs: list, mode: str | None = None, options: dict | None = None, **_: Any) -> Callable:
    """torch.compile backend: rewrite the LM head to the active vocabulary, compile the rest."""
    opts = NanoSpecOptions.parse(options)
    config_patches = {**mode_config(mode), **opts.inductor_options}
    heads = find_heads(gm, example_inputs, vocab_size=opts.vocab_size, head=opts.head)
    if not heads:
        warn_once(
            "nanospec: no LM head found in this graph (a linear/matmul whose vocabulary-sized output "
            "reaches the output); it runs unchanged. If the head is there, pass options={'vocab_size': V} "
            "or {'head': '<weight name>'}, and check the drafter has no graph break before it."
        )
        return _compile(gm, example_inputs, opts, config_patches)
    real = _real_tensors(gm, example_inputs)
    rewritable = []
    for head in heads:
        weight, bias = real.get(head.weight), _bias_tensor(head, real)
        if weight is None or bias is False:
            warn_once(f"nanospec: the head {head.name} has a weight or bias that is not a parameter; it runs dense")
        elif torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad)):
            warn_once(
                f"nanospec: the head {head.name} needs gradients here (grad mode on, trainable weights), so it "
                "runs dense. NanoSpec is for inference: call the drafter under torch.inference_mode() or "
                "torch.no_grad(), or freeze the head with requires_grad_(False)."
            )
        else:
            rewritable.append((head, weight, bias))
    if not rewritable:
        return _compile(gm, example_inputs, opts, config_patches)

    new_gm = _copy_graph_module(gm)
    graph = new_gm.graph
    node_map = {old: new for old, new in zip(gm.graph.nodes, graph.nodes)}
    states: list[ActiveVocab] = []
    weight_positions: list[tuple[int | None, int | None]] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    for head, weight, bias in rewritable:
        state = state_for(weight, bias, opts.capacity, opts.num_pinned)
        head = _remap(head, node_map)
        with graph.inserting_after(last_placeholder):
            nodes = [graph.placeholder(f"nanospec_{name}_{len(states)}") for name in ("cache_b", "cache_w", "cursor", "slot_of", "ids")][::-1]
        last_placeholder = nodes[-1]
        for node in nodes:
            node._dynamo_source = None  # not a user input; AOT autograd accepts a None source
            # A static input: its address never changes, so CUDA graphs read it in place.
            node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
        state_nodes = StateNodes(*nodes)
        report = rewrite_head(graph, head, state_nodes, state.capacity)
        bias_node = next((b for b in head.biases if b is not None), None)
        report.observers = insert_observers(graph, head, state_nodes, state.num_pinned, bias_node) if opts.observe_inputs else 0
        state.rewrites.append(report)
        states.append(state)
        weight_positions.append((_position(placeholders, node_map, head.weight), _position(placeholders, node_map, bias_node)))
    graph.eliminate_dead_code()  # placeholders and the (mutating) observe ops are impure and stay
    graph.lint()
    new_gm.recompile()

    state_args = [t for s in states for t in s.tensors()]
    compiled = _compile(new_gm, list(example_inputs) + state_args, opts, config_patches)
    return _StatefulCall(compiled, states, weight_positions)


class _StatefulCall:
    """Calls the compiled graph with the state tensors appended to the user's inputs.

    If a head weight was replaced by another tensor since compiling (Dynamo does not guard
    on parameter identity), the state of the new weight is used, so logits are never stale.
    """

    def __init__(self, compiled: Callable, states: list[ActiveVocab], positions: list[tuple[int | None, int | None]]):
        self.compiled, self.states, self.positions = compiled, states, positions
        self.state_args = [t for s in states for t in s.tensors()]

    def __call__(self, *args: Any) -> Any:
        for i, (state, (w_pos, b_pos)) in enumerate(zip(self.states, self.positions)):
            if w_pos is not None and args[w_pos] is not state.weight:
                self._rebind(i, args[w_pos], args[b_pos] if b_pos is not None else state.bias)
        return self.compiled(*args, *self.state_args)

    def _rebind(self, i: int, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        old = self.states[i]
        self.states[i] = state_for(weight, bias, old.capacity, old.num_pinned)
        if not self.states[i].rewrites:
            self.states[i].rewrites = list(old.rewrites)
        self.state_args = [t for s in self.states for t in s.tensors()]


def _compile(gm: fx.GraphModule, example_inputs: list, opts: NanoSpecOptions, config_patches: dict) -> Callable:
    if not opts.inductor:
        return gm.forward
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=config_patches or None)


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of Dynamo's GraphModule whose graph we may change (Dynamo's own must stay intact)."""
    graph = fx.Graph()
    value_map: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, value_map)
    graph.output(out)
    for old, new in value_map.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    new_gm = fx.GraphModule(gm, graph)
    new_gm.meta = dict(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        new_gm._param_name_to_source = gm._param_name_to_source
    return new_gm


def _position(placeholders: list[fx.Node], node_map: dict, new_node: fx.Node | None) -> int | None:
    """Index among the user inputs of the original placeholder behind ``new_node`` (None if not one)."""
    old = next((o for o, n in node_map.items() if n is new_node), None) if new_node is not None else None
    return placeholders.index(old) if old in placeholders else None


def _remap(head: HeadMatch, node_map: dict) -> HeadMatch:
    return HeadMatch(
        weight=node_map[head.weight],
        nodes=[node_map[n] for n in head.nodes],
        name=head.name,
        vocab_size=head.vocab_size,
        hidden_size=head.hidden_size,
        biases=[node_map[b] if b is not None else None for b in head.biases],
    )


def _real_tensors(gm: fx.GraphModule, example_inputs: list) -> dict[fx.Node, torch.Tensor]:
    """The real parameter tensors behind placeholder / get_attr nodes."""
    found = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.Tensor):
            found[node] = value
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            obj = gm
            for part in node.target.split("."):
                obj = getattr(obj, part)
            if isinstance(obj, torch.Tensor):
                found[node] = obj
    return found


def _bias_tensor(head: HeadMatch, real: dict) -> torch.Tensor | None | bool:
    """The head's bias tensor, None without one, False when the projections disagree or it is computed."""
    biases = set(head.biases)
    if len(biases) > 1:
        return False
    (b,) = biases
    if b is None:
        return None
    return real.get(b, False) if b.op in ("placeholder", "get_attr") else False
