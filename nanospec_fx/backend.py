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

import warnings
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from nanospec_fx.options import NanoSpecOptions, mode_config
from nanospec_fx.passes import (
    DenseFallback, HeadMatch, ObserveInto, StateNodes, find_heads, insert_input_observers, insert_topk_observers,
    rewrite_head, snapshot_state_reads,
)
from nanospec_fx.passes import effects, patterns
from nanospec_fx.passes.find_head import token_tables
from nanospec_fx.passes.rewrite_head import set_example_value
from nanospec_fx.integrations import head_parameters
from nanospec_fx.state import STATE_TENSORS, ActiveVocab, registered_states, state_for

BACKEND_NAME = "nanospec"


class NanoSpecWarning(UserWarning):
    """Something nanospec could not do; the model still runs, unchanged where it says so."""


def warn_once(message: str) -> None:
    """Warn at compile time (not per call); Python's default filter shows each message once."""
    warnings.warn(message, NanoSpecWarning, stacklevel=3)


def nanospec_backend(gm: fx.GraphModule, example_inputs: list, mode: str | None = None, options: dict | None = None, **_: Any) -> Callable:
    """torch.compile backend: rewrite the LM head to the active vocabulary, compile the rest."""
    opts = NanoSpecOptions.parse(options)
    config_patches = {**mode_config(mode), **opts.inductor_options}
    if opts.observe_topk is not None:
        return _compile_target_observer(gm, example_inputs, opts, config_patches)
    return _compile_drafter(gm, example_inputs, opts, config_patches)


# ----------------------------------------------------------------------------- drafter role
def _compile_drafter(gm: fx.GraphModule, example_inputs: list, opts: NanoSpecOptions, config_patches: dict) -> Callable:
    config = opts.state_config()  # validates policy options before anything else
    region_inputs = _region_inputs(gm, example_inputs)
    split_rows = {rows for _, rows in _UNLINKED[0].fed} if _just_ran_unlinked() else set()
    known = {s.vocab_size for s in region_inputs.values()} | (split_rows if _resumes_after_graph_break(gm) else set())
    notes: list[str] = []
    # A head over a draft vocabulary (EAGLE-3 d2t) has one output per draft token, not the embedding's width.
    width = opts.vocab_size
    if width is None and opts.draft_to_target is not None:
        width = torch.as_tensor(opts.draft_to_target).numel()
    heads = find_heads(gm, example_inputs, vocab_size=width, head=opts.head, known_vocab=known,
                       resumed=_resumes_after_graph_break(gm), notes=notes)
    if not heads:
        if region_inputs:
            return _compile_after_break(gm, example_inputs, region_inputs, opts, config_patches)
        fed = _token_id_inputs(gm) if opts.observe_inputs else []
        warn_once(
            "nanospec: no LM head found in this graph (a linear/matmul/einsum whose vocabulary-sized output "
            "reaches the output, with the vocabulary of the token embedding"
            + (f"; {'; '.join(notes)}" if notes else "") + "); this graph runs unchanged"
            + ("; the token ids it embeds are observed into a head found in a later graph (after a graph break), if "
               "there is one" if fed else "")
            + ". If the head is in it, pass options={'vocab_size': V} or {'head': '<weight name>'}."
        )
        compiled = _compile(gm, example_inputs, opts, config_patches)
        # The embedding half of a drafter split by a graph break: feed the head compiled after it.
        return _ObservingCall(compiled, fed) if fed else compiled
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

    while True:
        try:
            return _rewrite_drafter(gm, example_inputs, rewritable, config, opts, config_patches)
        except DenseFallback as reason:
            head = reason.args[1]
            warn_once(f"nanospec: the head {head.name} runs dense: {reason.args[0]}")
            rewritable = [r for r in rewritable if r[0] is not head]
            if not rewritable:
                return _compile(gm, example_inputs, opts, config_patches)


def _rewrite_drafter(gm, example_inputs, rewritable, config, opts, config_patches) -> Callable:
    builder = _GraphBuilder(gm)
    bindings, reports, links = [], [], []
    for head, weight, bias in rewritable:
        state = state_for(weight, bias, name=head.name, **config)
        mapped = builder.remap(head)
        into = builder.add_state(state, mapped.weight, next((b for b in mapped.biases if b is not None), None))
        try:
            report = rewrite_head(builder.graph, mapped, into.state, state.capacity)
        except DenseFallback as reason:
            raise DenseFallback(str(reason), head) from None
        observe = opts.observe_inputs and state.observes
        report.observers = insert_input_observers(builder.graph, into) if observe else 0
        snapshot_state_reads(builder.graph, into.state)
        if observe and not report.observers and not token_tables(builder.gm):
            links.append(state)
            if not _just_ran_unlinked() and _resumes_after_graph_break(gm):
                raise DenseFallback(
                    "it is in a graph that resumes after a graph break, and the token ids the drafter embeds before it "
                    "were run outside any graph nanospec sees (a graph break inside the embedding's function), so they "
                    "cannot join the active set. Remove the graph break between the token embedding and the head "
                    "(torch._dynamo.graph_break(), print, .item(), ...), or compile with options={'observe_inputs': False} "
                    "and feed the set with nanospec_fx.active_vocab(model).observe(ids)", head)
        if observe and not report.observers and token_tables(builder.gm):
            warn_once(
                f"nanospec: the head {head.name} is rewritten, but no token embedding of this graph has its vocabulary "
                f"(V={head.vocab_size} rows or more), so nothing joins the active set here: tokens outside it get -inf. Feed the set "
                "with nanospec_fx.active_vocab(model).observe(ids) or a target observer (options observe_topk/vocab)."
            )
        reports.append((state, report))
        bindings.append(_DrafterBinding(state, builder.user_input_position(mapped.weight), builder.user_input_position(into.bias),
                                        into.state.ids))
    crossing = _break_after_logits(builder.graph, bindings)
    if crossing is not None:
        binding, where_ = crossing
        head = next(h for (h, _, _), b in zip(rewritable, bindings) if b is binding)
        raise DenseFallback(
            f"its logits are live across a graph break inside a nested function ({where_}), and Dynamo may run the "
            "code after that break outside any graph, where post-ops would give inactive tokens finite values. Remove "
            "that graph break (or move it to the function that calls the head)", head)
    compiled = builder.compile(example_inputs, bindings, opts, config_patches)
    compiled.links = links
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
    config: dict | None = None  # and the vocabulary options it was compiled with

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
                state_for(self.state.weight, self.state.bias, **self.config)
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
        self.track(state_for(args[self.weight_pos], bias, old.capacity, old.num_pinned, seed_ids=old.seed_ids,
                             observes=old.observes, policy=old.policy, token_to_row=old.token_to_row))
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
            state_for(state.weight, state.bias, **state.config())
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
        return [s.weight] + ([s.bias] if s.bias is not None else []) + _state_inputs(s)

    def update(self, args: tuple) -> bool:
        return self.sync()


def resolve_vocab(vocab: Any, opts: NanoSpecOptions) -> ActiveVocab:
    """The drafter ActiveVocab a target observer feeds: given, found on the drafter, or created
    from its output embeddings (transformers models) with the vocabulary options given here."""
    if isinstance(vocab, ActiveVocab):
        return vocab
    if not isinstance(vocab, nn.Module):
        raise TypeError(f"options['vocab'] must be the drafter module or its ActiveVocab, got {type(vocab).__name__}")
    states = list({id(s): s for s in registered_states(getattr(vocab, "_orig_mod", vocab)).values()}.values())
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
    return state_for(weight, bias, **opts.state_config())


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
                         [m[b] if b is not None else None for b in head.biases], head.module_path)

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
        tensors = ([] if weight is not None else [state.weight] + ([state.bias] if state.bias is not None else []))
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
        return _StatefulCall(compiled, bindings, _region_outputs(graph, bindings))


class _StatefulCall:
    """Calls the compiled graph with the bindings' tensors appended to the user's inputs."""

    def __init__(self, compiled: Callable, bindings: list, region_outputs: list | None = None):
        self.compiled, self.bindings = compiled, bindings
        self.extra = [t for b in bindings for t in b.tensors()]
        self.region_outputs = region_outputs or []  # (output position, binding)
        self.links: list[ActiveVocab] = []  # heads that observe the ids of an embedding-only graph before them

    def __call__(self, *args: Any) -> Any:
        for state in self.links:
            _link_split_embedding(state)
        _CALLS[0] += 1
        if any([b.update(args) for b in self.bindings]):
            self.extra = [t for b in self.bindings for t in b.tensors()]
        out = self.compiled(*args, *self.extra)
        if self.region_outputs and isinstance(out, (tuple, list)):
            for pos, binding in self.region_outputs:
                _tag_region_tensor(out[pos], binding.state)
        return out


# ----------------------------------------------------------------------------- graph breaks
# A graph break between the token embedding and the head splits the drafter in two graphs: the
# first embeds the ids (no head), the second has the head (no embedding). The first graph's wrapper
# keeps the ids it was called with until the next head graph without an embedding runs (Dynamo runs
# the two back to back); that head graph then links to it, observes them before reading the state,
# and from then on the first graph observes into that head's state directly.
_UNLINKED: list = []  # the embedding-only graph that ran last and is not linked to a head yet (0 or 1)
_CALLS = [0]  # calls of nanospec-compiled graphs so far: "ran just before" means the previous call


def _just_ran_unlinked() -> bool:
    return bool(_UNLINKED) and _UNLINKED[0].seq == _CALLS[0]


def _token_id_inputs(gm: fx.GraphModule) -> list[tuple[int, int]]:
    """``(input position, table rows)`` of the token ids this graph embeds, when they are graph inputs."""
    from nanospec_fx.passes.observe_inputs import embedding_lookups

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [(placeholders.index(ids), rows) for _, ids, _, rows in embedding_lookups(gm.graph) if ids in placeholders]


def _fits(state: ActiveVocab, rows: int) -> bool:
    return state.vocab_size <= rows


def _link_split_embedding(state: ActiveVocab) -> None:
    """Called by a head graph without an embedding before it runs: adopt the embedding graph that just ran."""
    if _just_ran_unlinked() and all(_fits(state, rows) for _, rows in _UNLINKED[0].fed):
        embedding = _UNLINKED.pop()
        embedding.state = state
        for ids in embedding.pending:
            state.observe(ids, validate=False)
        embedding.pending = []


class _ObservingCall:
    """A graph that embeds token ids but holds no head: observe them into the head's state."""

    def __init__(self, compiled: Callable, fed: list[tuple[int, int]]):
        self.compiled, self.fed = compiled, fed
        self.state: ActiveVocab | None = None
        self.pending: list[torch.Tensor] = []
        self.seq = -1

    def __call__(self, *args: Any) -> Any:
        ids = [args[pos] for pos, _ in self.fed]
        if self.state is not None:
            for t in ids:
                self.state.observe(t, validate=False)
        _CALLS[0] += 1
        if self.state is None:
            self.pending, self.seq = ids, _CALLS[0]
            _UNLINKED[:] = [self]
        return self.compiled(*args)


def _resumes_after_graph_break(gm: fx.GraphModule) -> bool:
    """Whether Dynamo traced ``gm`` from a resume function (the rest of a frame after a graph break)."""
    from nanospec_fx.passes.find_head import parameter_name_raw

    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        if InstructionTranslator.current_tx().f_code.co_name.startswith("torch_dynamo_resume_in_"):
            return True
    except Exception:  # noqa: BLE001 - not called by Dynamo
        pass
    return any(parameter_name_raw(n).startswith("L['___stack") for n in gm.graph.nodes if n.op == "placeholder")


# The [..., V] logits a rewritten head returns (-inf at inactive tokens), by tensor identity, so a
# graph compiled after a graph break can recognise them among its inputs and keep them masked.
_REGION_TENSORS: dict[int, tuple[weakref.ref, ActiveVocab]] = {}


def _tag_region_tensor(t: Any, state: ActiveVocab) -> None:
    if isinstance(t, torch.Tensor):
        key = id(t)
        _REGION_TENSORS[key] = (weakref.ref(t, lambda _, key=key: _REGION_TENSORS.pop(key, None)), state)


def region_state(t: Any) -> ActiveVocab | None:
    """The ActiveVocab whose rewritten head produced ``t`` (a graph output), or None."""
    entry = _REGION_TENSORS.get(id(t))
    return entry[1] if entry is not None and entry[0]() is t else None


def _break_after_logits(graph: fx.Graph, bindings: list) -> tuple | None:
    """``(binding, where)`` when this graph ends at a graph break inside a nested call and returns
    a head's logits (or a view of them) to the code after it; else None."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        reason = InstructionTranslator.current_tx().output.compile_subgraph_reason
    except Exception:  # noqa: BLE001 - not called by Dynamo (a test calling the backend directly)
        return None
    if reason is None or not getattr(reason, "graph_break", False) or len(reason.user_stack or ()) < 2:
        return None
    by_ids = {b.ids_node: b for b in bindings if isinstance(b, _DrafterBinding)}
    made = {torch.ops.nanospec.scatter_logits.default: 1, torch.ops.nanospec.head_logits.default: 3}
    output = next(n for n in graph.nodes if n.op == "output")
    for value in output.all_input_nodes:
        cur = value
        while cur.op in ("call_function", "call_method") and cur.target not in made and effects.may_alias_input(cur) \
                and cur.all_input_nodes:
            cur = cur.all_input_nodes[0]
        if cur.op == "call_function" and cur.target in made and cur.args[made[cur.target]] in by_ids:
            frame = reason.user_stack[-1]
            return by_ids[cur.args[made[cur.target]]], f"{frame.filename}:{frame.lineno} in {frame.name}"
    return None


def _region_outputs(graph: fx.Graph, bindings: list) -> list:
    """Graph output positions holding materialised head logits, with their binding."""
    by_ids = {}
    for b in bindings:
        if isinstance(b, _DrafterBinding):
            by_ids[b.ids_node] = b
    if not by_ids:
        return []
    made = {torch.ops.nanospec.scatter_logits.default: 1, torch.ops.nanospec.head_logits.default: 3}
    output = next(n for n in graph.nodes if n.op == "output")
    values = output.args[0]
    if not isinstance(values, (tuple, list)):
        return []
    found = []
    for pos, v in enumerate(values):
        if isinstance(v, fx.Node) and v.op == "call_function" and v.target in made:
            ids = v.args[made[v.target]]
            binding = by_ids.get(ids)
            if binding is not None:
                found.append((pos, binding))
    return found


def _region_inputs(gm: fx.GraphModule, example_inputs: list) -> dict[fx.Node, ActiveVocab]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    found = {}
    for node, value in zip(placeholders, example_inputs):
        state = region_state(value)
        if state is not None and value.dim() and value.shape[-1] == state.vocab_size:
            found[node] = state
    return found


def _compile_after_break(gm, example_inputs, region_inputs: dict, opts, config_patches) -> Callable:
    """A graph whose inputs include a rewritten head's logits (a graph break after the head).

    Post-ops here would turn the inactive tokens' -inf into finite values (a soft-cap gives
    -cap); every elementwise op on those logits is followed by a re-mask, so inactive tokens stay
    exactly -inf after them, as if the post-ops had run before the break.
    """
    builder = _GraphBuilder(gm)
    bindings, masked = [], 0
    for node, state in region_inputs.items():
        into = builder.add_state(state, None, None)
        binding = _TargetBinding(state)
        masked += _remask_post_ops(builder.graph, builder.node_map[node], into.state, state)
        bindings.append(binding)
    if not masked:
        return _compile(gm, example_inputs, opts, config_patches)
    return builder.compile(example_inputs, bindings, opts, config_patches)


def _remask_post_ops(graph: fx.Graph, logits: fx.Node, s: StateNodes, state: ActiveVocab) -> int:
    vocab = state.vocab_size
    carriers, stack, post_ops = {logits}, [logits], []
    while stack:
        cur = stack.pop()
        for user in list(cur.users):
            if user in carriers:
                continue
            if patterns.elementwise_operands_ok(user, cur, vocab, carriers):
                post_ops.append(user)
            elif not patterns.view_keeps_vocab(user, cur, vocab):
                continue
            carriers.add(user)
            stack.append(user)
    if not post_ops:
        return 0
    first = min(post_ops, key=list(graph.nodes).index)
    with graph.inserting_before(first):
        zeros = graph.call_method("new_zeros", (s.ids, (state.capacity,)), {"dtype": torch.float32})
        row = graph.call_function(torch.ops.nanospec.scatter_logits.default, (zeros, s.ids, s.cursor, vocab))
        inactive = graph.call_function(torch.isneginf, (row,))
    for n in (zeros, row, inactive):
        set_example_value(n)
    for op in post_ops:
        written = effects.mutated_inputs(op)
        with graph.inserting_after(op):
            if written:
                graph.call_method("masked_fill_", (written[0], inactive, float("-inf")))
                continue
            remasked = graph.call_method("masked_fill", (op, inactive, float("-inf")))
        op.replace_all_uses_with(remasked, delete_user_cb=lambda u: u is not remasked)
        set_example_value(remasked)
    return len(post_ops)


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
