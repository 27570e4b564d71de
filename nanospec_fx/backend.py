"""The ``nanospec`` torch.compile backend.

``torch.compile(drafter, backend="nanospec")`` hands Dynamo's FX graph to
:func:`nanospec_backend`, which

1. finds the LM head (``passes/find_head.py``),
2. copies the graph and appends the head's :class:`ActiveVocab` tensors as extra inputs,
3. rewrites the head into nanospec ops and observes the token-id inputs (``passes/``),
4. compiles the result with inductor, and returns a callable that appends the state tensors
   to every call. The state is updated in place, so one compile serves every active set.

With ``options={"observe_topk": k, "vocab": drafter}`` it compiles a *target* instead: the
target is not rewritten; its top-k predictions at every scored position (and its input
tokens) are observed into the drafter's active vocabulary, on the device.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from nanospec_fx.dynamo_limits import record_compiled_frame
from nanospec_fx.warning import NanoSpecWarning, warn_once  # noqa: F401 - NanoSpecWarning is re-exported
from nanospec_fx.options import NanoSpecOptions, mode_config
from nanospec_fx.passes import (
    DenseFallback, HeadMatch, ObserveInto, StateNodes, find_heads, grad_enabled_at, graph_position,
    insert_input_observers, insert_topk_observers, rewrite_head, snapshot_state_reads, unobserved_lookup,
)
from nanospec_fx.passes import effects, patterns
from nanospec_fx.passes.find_head import projections_reaching_output, token_tables
from nanospec_fx.lookup import head_parameters, registered_states, unwrap
from nanospec_fx.state import STATE_TENSORS, ActiveVocab, state_for
from nanospec_fx.policies import resolve
from nanospec_fx.vocab_config import StateConfig

BACKEND_NAME = "nanospec"


def nanospec_backend(gm: fx.GraphModule, example_inputs: list, mode: str | None = None, options: dict | None = None, **_: Any) -> Callable:
    """torch.compile backend: rewrite the LM head to the active vocabulary, compile the rest."""
    opts = NanoSpecOptions.parse(options)
    record_compiled_frame()
    config_patches = {**mode_config(mode), **opts.inductor_options}
    if opts.observe_topk is not None:
        return _compile_target_observer(gm, example_inputs, opts, config_patches)
    return _compile_drafter(gm, example_inputs, opts, config_patches)


# ----------------------------------------------------------------------------- drafter role
def _compile_drafter(gm: fx.GraphModule, example_inputs: list, opts: NanoSpecOptions, config_patches: dict) -> Callable:
    config = resolve(opts.vocab_config)  # validates policy options before anything else
    position = graph_position(gm)
    notes: list[str] = []
    # A head over a draft vocabulary (EAGLE-3 d2t) has one output per draft token, not the embedding's width.
    width = opts.vocab_size
    if width is None and opts.vocab_config.draft_to_target is not None:
        width = torch.as_tensor(opts.vocab_config.draft_to_target).numel()
    heads = find_heads(gm, example_inputs, vocab_size=width, head=opts.head, notes=notes)
    said: list[str] = []  # the warnings this graph gave: said again for every other model that runs it
    if not heads:
        # In a piece of a split call, only a projection nanospec cannot take as the head is worth a warning
        # (an embedding-only or a post-op-only piece: the piece with the head says why it is dense).
        if position.whole_call or notes or projections_reaching_output(gm):
            said.append(
                "nanospec: no LM head found in this graph (a linear/matmul/einsum with a parameter or buffer weight "
                "whose vocabulary-sized output reaches the output, with the vocabulary of the token embedding"
                + (f"; {'; '.join(notes)}" if notes else "")
                + ("" if position.whole_call else f"; {position.describe()}") + "); this graph runs unchanged. "
                "If the head is in it, pass options={'vocab_size': V} or {'head': '<weight name>'}."
            )
        return _dense(gm, example_inputs, opts, config_patches, said)
    real = _real_tensors(gm, example_inputs)
    rewritable = []
    for head in heads:
        reason = _dense_reason(gm, head, real, position, opts)
        if reason:
            said.append(f"nanospec: the head {head.name} runs dense: {reason}")
        else:
            rewritable.append((head, real[head.weight], _bias_tensor(head, real)))
    while rewritable:
        try:
            compiled = _rewrite_drafter(gm, example_inputs, rewritable, config, opts, config_patches, position)
            for message in said:
                warn_once(message)
            return compiled
        except DenseFallback as reason:
            head = reason.args[1]
            said.append(f"nanospec: the head {head.name} runs dense: {reason.args[0]}")
            rewritable = [r for r in rewritable if r[0] is not head]
    return _dense(gm, example_inputs, opts, config_patches, said)


def _dense(gm: fx.GraphModule, example_inputs: list, opts: NanoSpecOptions, config_patches: dict, said: list[str]):
    """The graph compiled unchanged; its warnings given now, and again when another model runs it."""
    for message in said:
        warn_once(message, stacklevel=4)
    compiled = _compile(gm, example_inputs, opts, config_patches)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    position = next((i for i, (n, v) in enumerate(zip(placeholders, example_inputs)) if isinstance(v, torch.Tensor)
                     and (isinstance(v, nn.Parameter) or "_buffers[" in patterns.source_name(n))), None)
    return _DenseCall(compiled, said, position, example_inputs[position]) if said and position is not None else compiled


class _DenseCall:
    """A graph that runs a head dense, shared by several instances of one class (Dynamo compiles it once):
    each instance that runs it (told apart by its first parameter or buffer) is told so once."""

    def __init__(self, compiled: Callable, said: list[str], position: int, first: torch.Tensor):
        self.compiled, self.said, self.position = compiled, said, position
        self.seen = WeakIdKeyDictionary({first: True})  # by identity: tensors compare by value

    def __call__(self, *args: Any) -> Any:
        key = args[self.position]
        if key not in self.seen:
            self.seen[key] = True
            for message in self.said:
                warn_once(f"{message} (another model runs this compiled graph: the same holds for it)", stacklevel=2)
        return self.compiled(*args)


def _dense_reason(gm: fx.GraphModule, head: HeadMatch, real: dict, position, opts: NanoSpecOptions) -> str | None:
    """Why ``head`` cannot be rewritten in this graph for this call (None: nothing stops it yet)."""
    weight, bias = real.get(head.weight), _bias_tensor(head, real)
    if weight is None or bias is False:
        return "its weight or bias is not a parameter or buffer (it is computed in the graph or passed in)"
    sources = [real.get(n) for n in head.sources]  # the scales / parameters a weight computed per row reads
    if grad_enabled_at(gm.graph, head.nodes, torch.is_grad_enabled()) and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (weight, bias, *sources)):
        return ("it needs gradients here: grad mode is on where it runs and its weights are trainable. "
                "NanoSpec is for inference: call the drafter under torch.inference_mode() or torch.no_grad(), "
                "or freeze the head with requires_grad_(False)")
    if opts.observe_inputs and not position.whole_call:
        return (f"this graph is one piece of a call split by graph breaks ({position.describe()}), so the token ids "
                "the call embeds in another piece cannot be proven active before the head reads the active set, "
                "and post-ops run in another piece would give inactive tokens finite values. Remove the graph "
                "break (print, .item(), int(tensor), a data-dependent branch, torch._dynamo.graph_break()), or "
                "compile with options={'observe_inputs': False} and feed the set yourself with "
                "nanospec_fx.active_vocab(model).observe(ids)")
    if opts.observe_inputs:
        return unobserved_lookup(gm.graph, head)
    return None


def _rewrite_drafter(gm, example_inputs, rewritable, config, opts, config_patches, position) -> Callable:
    builder = _GraphBuilder(gm)
    bindings, reports = [], []
    for head, weight, bias in rewritable:
        state = state_for(weight, bias, config, name=head.name, transposed=head.transposed)
        mapped = builder.remap(head)
        into = builder.add_state(state, mapped.weight, next((b for b in mapped.biases if b is not None), None))
        if head.transposed:  # observers copy head rows: the columns of a [H, V] weight
            into.transposed = True
        try:
            report = rewrite_head(builder.graph, mapped, into.state, state.capacity)
        except DenseFallback as reason:
            raise DenseFallback(str(reason), head) from None
        if report.chain_outputs and (position.ends_at or position.called_from):
            raise DenseFallback(
                f"its logits leave this graph ({position.describe()}), and post-ops run on them after the break "
                "would give inactive tokens finite values. Remove that graph break", head)
        observe = opts.observe_inputs and state.observes
        try:
            report.observers = insert_input_observers(builder.graph, into) if observe else 0
        except DenseFallback as reason:
            raise DenseFallback(str(reason), head) from None
        snapshot_state_reads(builder.graph, into.state,
                             grad=grad_enabled_at(builder.graph, list(builder.graph.nodes), torch.is_grad_enabled()))
        if observe and not report.observers and token_tables(builder.gm):
            warn_once(
                f"nanospec: the head {head.name} is rewritten, but no token embedding of this graph has its vocabulary "
                f"(V={head.vocab_size} rows or more), so nothing joins the active set here: tokens outside it get -inf. "
                "Feed the set with nanospec_fx.active_vocab(model).observe(ids) or a target observer (options "
                "observe_topk/vocab).")
        reports.append((state, report))
        bindings.append(_DrafterBinding(state, builder.user_input_position(mapped.weight), builder.user_input_position(into.bias),
                                        into.state.ids))
    compiled = builder.compile(example_inputs, bindings, opts, config_patches)
    for state, report in reports:
        state.rewrites.append(report)
    return compiled


class _Binding:
    """What every call checks on the host before it runs the compiled graph (no device sync):

    * the head weight or bias was written in place since its rows were cached (``load_state_dict``,
      an optimizer step, ``w.mul_()``: their version counters moved) -> re-copy the active rows;
    * the state was rebuilt in place by a compile with other options (``state_for``) -> use its new
      tensors if they have the layout this graph was compiled for, else a clear error.
    The state records the binding (weakly): while it lives, another compile may not change the
    state's options, so no wrapper is ever left on a state that ``observe()`` no longer reaches.
    """

    state: ActiveVocab

    layout: list | None = None  # of the state tensors this graph was compiled for
    config: StateConfig | None = None  # and the vocabulary options it was compiled with

    def track(self, state: ActiveVocab) -> None:
        """Read ``state`` from now on (another instance's head: the compiled graph is shared)."""
        if self.layout is None:
            self.layout, self.config = state.layout(), state.config()
        elif state.layout() != self.layout:
            raise RuntimeError(
                f"nanospec: this compiled graph was made for an active vocabulary of another capacity or layout than "
                f"{state!r}; compile every instance of this head with the same vocabulary options"
            )
        self.state, self.generation = state, state.generation
        state.bind(self)

    def sync(self) -> bool:
        """Returns whether the state's tensors changed (the call's extra inputs must be rebuilt)."""
        changed = self.generation != self.state.generation
        if changed:
            if self.state.layout() != self.layout and self.config is not None and not self.state.fits(self.state.weight):
                # The weight changed dtype/device back to this graph's (Dynamo guards chose it): rebuild for it.
                state_for(self.state.weight, self.state.bias, self.config)
            if self.state.layout() != self.layout:
                raise RuntimeError(
                    f"nanospec: the active vocabulary this compiled graph reads was rebuilt with another capacity, "
                    f"dtype or layout ({self.state!r}); give every compile of this head the same vocabulary options "
                    "(or use nanospec_fx.speculative_pair), or call torch._dynamo.reset() and compile again"
                )
            self.generation = self.state.generation
        self.state.refresh_if_stale()
        return changed


class _DrafterBinding(_Binding):
    """Extra inputs for one rewritten head: its ActiveVocab's tensors.

    If the head weight was replaced by another tensor since compiling (Dynamo does not guard on
    parameter identity, e.g. a second instance of the same class), the new weight's state is used.
    """

    def __init__(self, state: ActiveVocab, weight_pos: int | None, bias_pos: int | None, ids_node: fx.Node | None = None):
        self.weight_pos, self.bias_pos = weight_pos, bias_pos
        self.ids_node = ids_node  # the graph input of the slot table (which outputs are this head's logits)
        self.track(state)

    def tensors(self) -> list[torch.Tensor]:
        return _state_inputs(self.state)

    def update(self, args: tuple) -> bool:
        bias = args[self.bias_pos] if self.bias_pos is not None else self.state.bias
        if self.weight_pos is None or self.state.is_weight(args[self.weight_pos]):
            self.state.set_bias(bias)  # a replaced bias (same shape) is followed; another shape raises clearly
            return self.sync()
        old = self.state
        self.track(state_for(args[self.weight_pos], bias, old.config(), transposed=old.transposed))
        if not self.state.rewrites:
            self.state.rewrites = list(old.rewrites)
        self.sync()
        return True


# ----------------------------------------------------------------------------- target role
def _compile_target_observer(gm: fx.GraphModule, example_inputs: list, opts: NanoSpecOptions, config_patches: dict) -> Callable:
    state = resolve_vocab(opts.vocab, opts)
    compiled = _build_target_observer(gm, example_inputs, state, opts, config_patches)
    if not isinstance(compiled, _StatefulCall):
        return compiled
    return _TargetObserverCall(compiled, lambda: _build_target_observer(gm, example_inputs, state, opts, config_patches))


def _build_target_observer(gm, example_inputs: list, state: ActiveVocab, opts: NanoSpecOptions,
                           config_patches: dict) -> Callable:
    heads = find_heads(gm, example_inputs, vocab_size=opts.vocab_size, head=opts.head)
    if not heads:
        warn_once("nanospec: no LM head found in the target graph; its top-k cannot be observed (it runs unchanged)")
        return _compile(gm, example_inputs, opts, config_patches)
    builder = _GraphBuilder(gm)
    into = builder.add_state(state, None, None)
    observed = 0
    for head in heads:
        if head.vocab_size != state.vocab_size:
            raise ValueError(
                f"nanospec: the target's head {head.name} has {head.vocab_size} outputs but the drafter's active "
                f"vocabulary has {state.vocab_size} tokens; for a draft vocabulary use options={{'draft_to_target': ...}}"
            )
        if opts.observe_topk > head.vocab_size:
            raise ValueError(f"observe_topk={opts.observe_topk} exceeds the vocabulary size {head.vocab_size}")
        if state.observes:
            observed += insert_topk_observers(builder.graph, builder.remap(head).nodes, opts.observe_topk, into,
                                              observe_prompt=opts.observe_prompt)
    if opts.observe_inputs and state.observes:
        insert_input_observers(builder.graph, into)
    if not observed:
        return _compile(gm, example_inputs, opts, config_patches)
    return builder.compile(example_inputs, [_TargetBinding(state)], opts, config_patches)


class _TargetObserverCall:
    """A target observer that follows its drafter's state to a new dtype or device.

    The observer copies the drafter's head rows into the drafter's ActiveVocab, so its graph is made for the
    state's dtype; ``drafter.to(dtype)`` changes the weight (Dynamo recompiles the drafter, not the target).
    Before each call: a weight that no longer fits the state rebuilds it in place (same object, tokens kept,
    as the drafter's own recompile would), and a state whose layout changed rebuilds this graph for it.
    """

    def __init__(self, compiled: "_StatefulCall", build: Callable[[], Callable]):
        self.compiled, self.build = compiled, build
        self.binding = compiled.bindings[0]
        self.state = self.binding.state

    def __call__(self, *args: Any) -> Any:
        state = self.state
        if not state.fits(state.weight):
            state_for(state.weight, state.bias, state.config())
        if state.layout() != self.binding.layout:
            self.compiled = self.build()
            self.binding = self.compiled.bindings[0]
        return self.compiled(*args)


class _TargetBinding(_Binding):
    """Extra inputs of a target observer: the drafter's head weight, bias and ActiveVocab tensors."""

    def __init__(self, state: ActiveVocab):
        self.track(state)
        # The state holds its weight weakly; this graph reads it, so it keeps it alive while it can run.
        self.weight = state.weight

    def tensors(self) -> list[torch.Tensor]:
        s = self.state
        return [s.head_rows] + ([s.bias] if s.bias is not None else []) + _state_inputs(s)

    def update(self, args: tuple) -> bool:
        return self.sync()


def resolve_vocab(vocab: Any, opts: NanoSpecOptions) -> ActiveVocab:
    """The drafter ActiveVocab a target observer feeds: given, found on the drafter, or created
    from its output embeddings (transformers models) with the vocabulary options given here."""
    if isinstance(vocab, ActiveVocab):
        return vocab
    if not isinstance(vocab, nn.Module):
        raise TypeError(f"options['vocab'] must be the drafter module or its ActiveVocab, got {type(vocab).__name__}")
    states = list({id(s): s for s in registered_states(unwrap(vocab)).values()}.values())
    if len(states) == 1:
        return states[0]
    if len(states) > 1:
        raise ValueError("the drafter has several active vocabularies; pass options['vocab'] = nanospec_fx.active_vocab(drafter, head=...)")
    try:
        weight, bias = head_parameters(vocab)
    except ValueError:
        raise ValueError(
            "nanospec: the drafter has no active vocabulary yet and no get_output_embeddings(); compile and call the "
            "drafter first, or pass options['vocab'] = nanospec_fx.attach(drafter, ...)"
        ) from None
    return state_for(weight, bias, opts.vocab_config)


# ----------------------------------------------------------------------------- shared mechanics
def _state_inputs(state: ActiveVocab) -> list[torch.Tensor]:
    return state.tensors() + ([state.token_to_row] if state.token_to_row is not None else [])


class _GraphBuilder:
    """A copy of Dynamo's GraphModule (Dynamo's own must stay intact) that gains extra inputs."""

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

    def remap(self, head: HeadMatch) -> HeadMatch:
        m = self.node_map
        return HeadMatch(m[head.weight], [m[n] for n in head.nodes], head.name, head.vocab_size, head.hidden_size,
                         [m[b] if b is not None else None for b in head.biases], head.module_path,
                         transposed=head.transposed)

    def user_input_position(self, node: fx.Node | None) -> int | None:
        return self.user_placeholders.index(node) if node in self.user_placeholders else None

    def add_inputs(self, names: list[str]) -> list[fx.Node]:
        """New trailing placeholders for tensors that are not user inputs (state, drafter weights)."""
        last = [n for n in self.graph.nodes if n.op == "placeholder"][-1]
        nodes = []
        with self.graph.inserting_after(last):
            for name in reversed(names):  # each lands right after `last`, so insert in reverse
                nodes.append(self.graph.placeholder(f"nanospec_{name}_{self.extra}"))
        nodes.reverse()
        for node in nodes:
            node._dynamo_source = None  # not a user input; AOT autograd accepts a None source
            # A static input: its address never changes, so CUDA graphs read it in place.
            node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
        self.extra += 1
        return nodes

    def add_state(self, state: ActiveVocab, weight: fx.Node | None, bias: fx.Node | None) -> ObserveInto:
        """Inputs for ``state`` (and for the head weight/bias when the graph does not hold them)."""
        names = [] if weight is not None else ["weight"] + (["bias"] if state.bias is not None else [])
        names += list(STATE_TENSORS) + (["token_to_row"] if state.token_to_row is not None else [])
        nodes = self.add_inputs(names)
        tensors = ([] if weight is not None else [state.head_rows] + ([state.bias] if state.bias is not None else []))
        self.set_input_values(nodes, tensors + _state_inputs(state))
        if weight is None:
            weight, nodes = nodes[0], nodes[1:]
            if state.bias is not None:
                bias, nodes = nodes[0], nodes[1:]
        n = len(STATE_TENSORS)
        return ObserveInto(weight, bias, StateNodes(*nodes[:n]), state.num_pinned, state.vocab_size,
                           nodes[n] if len(nodes) > n else None)

    def set_input_values(self, nodes: list[fx.Node], tensors: list[torch.Tensor]) -> None:
        """FakeTensor metadata for added inputs, so every node computed from them has some too."""
        if self.fake_mode is None:
            return
        for node, t in zip(nodes, tensors):
            node.meta["example_value"] = node.meta["val"] = self.fake_mode.from_tensor(t, static_shapes=True)

    def compile(self, example_inputs: list, bindings: list, opts: NanoSpecOptions, config_patches: dict) -> Callable:
        graph = self.graph
        # Placeholders and every op with a side effect (observe, `z.div_(t)`, `torch.clamp_(x)`, `out=`) stay.
        effects.dead_code_eliminate(graph)
        graph.lint()
        self.gm.recompile()
        extra = [t for b in bindings for t in b.tensors()]
        compiled = _compile(self.gm, list(example_inputs) + extra, opts, config_patches)
        return _StatefulCall(compiled, bindings)


class _StatefulCall:
    """Calls the compiled graph with the bindings' tensors appended to the user's inputs."""

    def __init__(self, compiled: Callable, bindings: list):
        self.compiled, self.bindings = compiled, bindings
        self.extra = [t for b in bindings for t in b.tensors()]

    def __call__(self, *args: Any) -> Any:
        if any([b.update(args) for b in self.bindings]):
            self.extra = [t for b in self.bindings for t in b.tensors()]
        return self.compiled(*args, *self.extra)


def _compile(gm: fx.GraphModule, example_inputs: list, opts: NanoSpecOptions, config_patches: dict) -> Callable:
    if not opts.inductor:
        return gm.forward
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=config_patches or None)


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
