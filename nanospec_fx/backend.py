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

import logging
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.fx.passes.graph_transform_observer import GraphTransformObserver
from torch.utils.weak import WeakIdKeyDictionary

from nanospec_fx import diagnosis, pass_reports
from nanospec_fx.draft_vocab import draft_vocab_hint
from nanospec_fx.dynamo_limits import record_compiled_frame
from nanospec_fx.head_kind import DenseHeadKind, kind_of_head, kind_of_state
from nanospec_fx.warning import NanoSpecWarning, warn_once  # noqa: F401 - NanoSpecWarning is re-exported
from nanospec_fx.options import NanoSpecOptions, OptionError, mode_config, option_error
from nanospec_fx.passes import (
    DenseFallback, DenseHead, HeadMatch, HeadSelectionError, ObserveInto, StateNodes, find_heads, find_meetings,
    grad_enabled_at, grad_modes, graph_position, insert_input_observers, keep_grad_modes, rewrite_head,
    snapshot_state_reads, unobserved_lookup,
)
from nanospec_fx.passes import effects, patterns, transforms, vocab_parallel_heads
from nanospec_fx.passes.find_head import projections_reaching_output, token_tables
from nanospec_fx.passes.lookups import embedding_lookups, one_hot_internals, token_id_lookups
from nanospec_fx.prefill import RecordingCall
from nanospec_fx import prefill as prefill_ids
from nanospec_fx.lookup import head_parameters
from nanospec_fx.module_heads import registered_states, unwrap
from nanospec_fx.state import STATE_TENSORS, ActiveVocab, state_for
from nanospec_fx.policies import resolve
from nanospec_fx.vocab_config import StateConfig

BACKEND_NAME = "nanospec"
log = logging.getLogger(__name__)  # debug: each head's decision (counted in torch._dynamo.utils.counters["nanospec"])


def nanospec_backend(
    gm: fx.GraphModule, example_inputs: list, mode: str | None = None, options: dict | None = None, **_: Any
) -> Callable:
    """torch.compile backend: rewrite the LM head to the active vocabulary, compile the rest."""
    opts = NanoSpecOptions.parse(options)
    record_compiled_frame()
    diagnosis.backend_called()
    config_patches = {**mode_config(mode), **opts.inductor_options}
    try:
        if opts.observe_topk is not None:
            return _compile_target_observer(gm, example_inputs, opts, config_patches)
        return _compile_drafter(gm, example_inputs, opts, config_patches)
    except HeadSelectionError as exc:  # options['head'] names nothing here: the caller's option, said unwrapped
        raise option_error(exc) from None


nanospec_backend.nanospec = True  # how nanospec_fx.diagnosis recognises the backend behind a compiled function


# ----------------------------------------------------------------------------- drafter role
def _compile_drafter(gm: fx.GraphModule, example_inputs: list, opts: NanoSpecOptions, config_patches: dict) -> Callable:
    try:
        config = resolve(opts.vocab_config)  # validates policy options before anything else
    except (ValueError, TypeError, OSError) as exc:  # a policy's options (its frequencies, pinned_size)
        raise option_error(exc) from None
    position = graph_position(gm)
    notes: list[str] = []
    # A head over a draft vocabulary (EAGLE-3 d2t) has one output per draft token, not the embedding's width.
    width = opts.vocab_size
    if width is None and opts.vocab_config.draft_to_target is not None:
        width = torch.as_tensor(opts.vocab_config.draft_to_target).numel()
    heads = [h for h in vocab_parallel_heads.gathered_heads(gm, example_inputs, head=opts.head, notes=notes)
             if width is None or h.vocab_size == width]
    said: list[str] = []  # the warnings this graph gave: said again for every other model that runs it
    if not heads:
        found: list[str] = []
        heads = find_heads(gm, example_inputs, vocab_size=width, head=opts.head, notes=found)
        declared = _declared_vocab_size(gm, example_inputs) if not heads and width is None and opts.head is None \
            else None
        if declared is not None:  # the model says its vocabulary (config.vocab_size, get_output_embeddings)
            heads = find_heads(gm, example_inputs, vocab_size=declared, notes=[])
            found = [] if heads else found
        # beside the heads found, a projection onto the vocabulary that nanospec cannot take says so; a
        # vocabulary-parallel head's note says why its gather is not followed (its shard is no padded/draft head)
        if heads:
            said.extend(f"nanospec: the head {n.head} runs dense: {n}" if isinstance(n, DenseHead) else f"nanospec: {n}"
                        for n in found)
        elif not notes:
            notes.extend(found)
            if hint := draft_vocab_hint(gm, example_inputs):  # an EAGLE-3 head compiled without the option
                notes.insert(0, hint)
    counters["nanospec"]["heads_found"] += len(heads)
    if not heads:
        counters["nanospec"]["graphs_without_head"] += 1
        embeds = position.whole_call and _is_prefill(gm)
        # In a piece of a split call, only a projection nanospec cannot take as the head is worth a warning
        # (an embedding-only or a post-op-only piece: the piece with the head says why it is dense); a whole
        # call that embeds tokens and computes nothing vocabulary-wide is a prefill, not a head nanospec missed.
        for note in (n for n in notes if isinstance(n, DenseHead)):  # a head the finder cannot take: its reason
            _runs_dense(said, note.head, note)
        if any(isinstance(n, DenseHead) for n in notes):
            said.extend(f"nanospec: {n}" for n in notes if not isinstance(n, DenseHead))
        elif notes or projections_reaching_output(gm) or (position.whole_call and not embeds):
            said.append(
                "nanospec: no LM head found in this graph (a linear/matmul/einsum with a parameter or buffer weight "
                "whose vocabulary-sized output reaches the output, with the vocabulary of the token embedding"
                + (f"; {'; '.join(notes)}" if notes else "")
                + ("" if position.whole_call else f"; {position.describe()}") + "); this graph runs unchanged. "
                "If the head is in it, pass options={'vocab_size': V} or {'head': '<weight name>'}."
            )
        if position.eager_caller and not said and token_tables(gm):  # ids the eager caller embeds are never seen
            said.append(f"nanospec: this graph looks up token ids but is one piece of a call ({position.describe()}): "
                        "the ids that code embeds are not observed, so the model's head may read an active set "
                        "without them. Move the graph break out of the loop Dynamo skipped, or feed the set with "
                        "nanospec_fx.active_vocab(model).observe(ids)")
        # A whole call without a head keeps the ids it looks up for the head's next call (a prefill), warned or not.
        recording = (_recording_prefill(gm, example_inputs, opts, config_patches)
                     if position.whole_call and opts.observe_inputs else None)
        if recording is not None or not opts.observe_inputs:
            return _dense(gm, example_inputs, opts, config_patches, said, recording)
        # a piece of a call that looks up ids and has no head: counted, as a whole head-less call is (diagnosis)
        return _counted(_dense(gm, example_inputs, opts, config_patches, said), gm, example_inputs)
    real = _real_tensors(gm, example_inputs)
    met = _heads_that_meet(gm, heads, said)
    rewritable = []
    for head in heads:
        if head in met:
            continue
        reason = _dense_reason(gm, head, real, position, opts) or _layout_clash(head, heads)
        if reason:
            _runs_dense(said, head.name, reason)
        else:
            rewritable.append((head, real[head.weight], _bias_tensor(head, real)))
    _agree(heads, rewritable, said, opts)  # before any state is built: that may run a collective
    while rewritable:
        try:
            compiled = _rewrite_drafter(gm, example_inputs, rewritable, config, opts, config_patches, position)
        except DenseFallback as reason:
            head = reason.args[1]
            _runs_dense(said, head.name, reason.args[0])
            rewritable = [r for r in rewritable if r[0] is not head]
            continue
        except Exception as error:  # still meet the others' second consensus: they would wait for it
            _agree(heads, rewritable, said, opts, failure=f"{type(error).__name__}: {error}")
            raise
        _agree(heads, rewritable, said, opts)
        for message in said:
            warn_once(message)
        diagnosis.record_dense(_held_tensors(gm, example_inputs), said)
        return compiled
    _agree(heads, rewritable, said, opts)
    return _dense(gm, example_inputs, opts, config_patches, said)


def _runs_dense(said: list[str], name: str, reason: str) -> None:
    """Say why the head ``name`` runs dense, and count it."""
    said.append(f"nanospec: the head {name} runs dense: {reason}")
    _count_dense(name, reason)


def _count_dense(name: str, reason: str) -> None:
    """Count a dense head: ``heads_dense``, and ``dense: <the reason's first clause>``."""
    counters["nanospec"]["heads_dense"] += 1
    counters["nanospec"][f"dense: {reason_key(reason)}"] += 1
    log.debug("head %s runs dense: %s", name, reason)


def _heads_that_meet(gm: fx.GraphModule, heads: list[HeadMatch], said: list[str]) -> set[HeadMatch]:
    """Heads whose logits one op combines (``passes/heads_meet.py``): each group runs dense, said once, naming
    every head of it."""
    met: set[HeadMatch] = set()
    for meeting in find_meetings(gm.graph, [h.nodes for h in heads]):
        group = [heads[i] for i in meeting.heads]
        names = ", ".join(h.name for h in group[:-1]) + f" and {group[-1].name}"
        low_rank = [h for h in group if h.hidden_size < max(g.hidden_size for g in group)]
        reason = (
            f"the logits of two heads are combined ({meeting.describe()}): each head weight has its own active set, "
            "so no one set makes the combined logits exact (one head's chain going on through the op would mask "
            "the result with that head's set alone). Combine them after the drafter's call, or rewrite one of them "
            "with options={'head': ...}"
            + (f"; {', '.join(h.name for h in low_rank)} reads a low-rank input (a LoRA delta B(A(h)) on the head): "
               "merge it into the head weight (W + s * B @ A; peft's merge_and_unload()) to have the head rewritten"
               if low_rank else ""))
        said.append(f"nanospec: the heads {names} run dense: {reason}")
        for head in group:
            if head not in met:
                _count_dense(head.name, reason)
        met.update(group)
    return met


def reason_key(reason: str) -> str:
    """A dense reason's counter key: its first clause (up to a colon, semicolon or parenthesis), at most 80
    characters."""
    cut = min((i for i in (reason.find(c) for c in ":;(") if i > 0), default=len(reason))
    return reason[:cut].strip()[:80]


def _agree(heads: list[HeadMatch], rewritable: list, said: list[str], opts: NanoSpecOptions,
           failure: str | None = None) -> None:
    """Every rank of a vocabulary-parallel head's group took the same decision, or all raise (no hang). The
    decision names the observers and their ids' shapes (each runs a fetch of that many rows), or the error the
    rewrite raised (``failure``: every rank then raises, the ranks' decisions listed where they differ)."""
    for head in heads:
        rewritten = any(r[0] is head for r in rewritable)
        observers = getattr(head, "observers", None)  # each observer runs a collective: the same count too
        shapes = getattr(head, "observer_shapes", None)
        weight = head.weight.meta.get("example_value", head.weight.meta.get("val"))
        # a head of another dtype or shape on one rank would fetch rows of other sizes (gloo aborts): agreed here
        layout = (f", head {str(weight.dtype).removeprefix('torch.')} {list(weight.shape)}"
                  if isinstance(weight, torch.Tensor) else "")
        if failure is not None:
            decision = f"{head.name} failed to compile ({failure})"
        elif rewritten:
            decision = (f"{head.name} rewritten with {opts.vocab_config}{layout}"
                        + (f", {observers} input observer(s)" if observers is not None else "")
                        + (f" of ids shaped {', '.join(shapes)}" if shapes else ""))
        else:
            decision = f"{head.name} dense ({'; '.join(said) or 'no reason given'})"
        kind_of_head(head).agree(decision)  # a head on one device: nobody to agree with


def _dense(gm: fx.GraphModule, example_inputs: list, opts: NanoSpecOptions, config_patches: dict, said: list[str],
           compiled: Callable | None = None):
    """The graph compiled unchanged (or ``compiled``, its ids recording twin); its warnings given now, and again
    when another model runs it."""
    for message in said:
        warn_once(message, stacklevel=4)
    diagnosis.record_dense(_held_tensors(gm, example_inputs), said)
    if compiled is None:
        compiled = _compile(gm, example_inputs, opts, config_patches)
    positions = _weight_positions(gm, example_inputs)
    return _DenseCall(compiled, said, positions, example_inputs) if said and positions else compiled


class _DenseCall:
    """A graph that runs a head dense, shared by several instances of one class (Dynamo compiles it once):
    each instance that runs it is told so once. An instance is told apart by its parameters and buffers, all of
    them: two drafters may share some (one ``nn.Embedding``), so a call with any tensor not seen before is another
    model's."""

    def __init__(self, compiled: Callable, said: list[str], positions: list[int], example_inputs: list):
        self.compiled, self.said, self.positions = compiled, said, positions
        # by identity: tensors compare by value
        self.seen = WeakIdKeyDictionary({example_inputs[i]: True for i in positions})

    def __call__(self, *args: Any) -> Any:
        held = [args[i] for i in self.positions]
        if any(t not in self.seen for t in held):
            for t in held:
                self.seen[t] = True
            diagnosis.record_dense(held, self.said)
            for message in self.said:
                warn_once(f"{message} (another model runs this compiled graph: the same holds for it)", stacklevel=2)
        return self.compiled(*args)


def _weight_positions(gm: fx.GraphModule, example_inputs: list) -> list[int]:
    """Inputs that are the model's parameters or buffers (what tells one instance's call from another's)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, (n, v) in enumerate(zip(placeholders, example_inputs)) if isinstance(v, torch.Tensor)
            and (isinstance(v, nn.Parameter) or "_buffers[" in patterns.source_name(n))]


def _declared_vocab_size(gm: fx.GraphModule, example_inputs: list) -> int | None:
    """The vocabulary the model whose frame is compiled says it has: its ``get_output_embeddings()``'s rows, else
    ``config.vocab_size`` (a hidden-states drafter with several wide projections names its head this way)."""
    model = diagnosis.model_of_frame(_held_tensors(gm, example_inputs))
    if model is None:
        return None
    try:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    except Exception:  # noqa: BLE001 - a model's own method: it may not apply here
        head = None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def _held_tensors(gm: fx.GraphModule, example_inputs: list) -> list[torch.Tensor]:
    """The parameters and buffers a graph receives (what ties it to the model that runs it)."""
    return [example_inputs[i] for i in _weight_positions(gm, example_inputs)]


def _is_prefill(gm: fx.GraphModule) -> bool:
    """A graph that looks up token ids and computes nothing as wide as their table along any axis (a head
    nanospec missed would, whatever reads its logits)."""
    lookups = embedding_lookups(gm.graph)
    rows = {r for *_, r in lookups}
    lookup_parts = {t for _, _, t, _ in lookups} | {n for lk, *_ in lookups for n in one_hot_internals(lk)}
    for node in gm.graph.nodes:
        value = patterns.example_value(node)
        if node not in lookup_parts and isinstance(value, torch.Tensor) and any(
                isinstance(d, int) and d in rows for d in value.shape):
            return False
    return bool(rows)


def _recording_prefill(gm: fx.GraphModule, example_inputs: list, opts: NanoSpecOptions,
                       config_patches: dict) -> Callable | None:
    """A head-less whole call that looks up token ids in a table it receives (a prefill): compiled with the
    ids as extra outputs, recorded under their table and the call's other parameters and buffers, for the heads
    of the same model (:mod:`prefill`).
    None when it looks up nothing."""
    builder = _GraphBuilder(gm)
    lookups = [(builder.user_input_position(table), ids) for _, ids, table, _ in embedding_lookups(builder.graph)]
    lookups = [(pos, ids) for pos, ids in lookups if pos is not None and isinstance(example_inputs[pos], torch.Tensor)]
    if not lookups:
        return None
    out = builder.graph.output_node()
    outputs = out.args[0]
    if not isinstance(outputs, (tuple, list)):
        return None
    extra, tables = [], []
    regions = transforms.transform_regions(builder.graph)
    for pos, ids in lookups:
        if isinstance(ids, fx.Node) and ids in regions:  # inside torch.vmap & co: the unbatched ids, if any
            inside, ids = regions[ids], transforms.outside_value(ids, regions)
            if ids is None:
                warn_once(f"nanospec: the ids this head-less call looks up inside {inside} are computed inside the "
                          "transform, so they are not kept for the next call's head (tokens only this call embeds "
                          "stay inactive there); compute them outside the transform, or feed them with "
                          "nanospec_fx.active_vocab(model).observe(ids)")
                continue
        if not isinstance(ids, fx.Node):  # ids written in the code: a constant tensor
            with builder.graph.inserting_before(out):
                ids = builder.graph.call_function(torch.tensor, (list(ids),), {"dtype": torch.int64})
        tables.append((pos, len(outputs) + len(extra)))
        extra.append(ids)
    out.args = (tuple(outputs) + tuple(extra),)
    builder.gm.recompile()
    recording = RecordingCall(_compile(builder.gm, example_inputs, opts, config_patches), len(outputs), tables,
                              _weight_positions(gm, example_inputs))
    return _counted(recording, gm, example_inputs)


def _counted(compiled: Callable, gm: fx.GraphModule, example_inputs: list) -> Callable:
    """A head-less graph that looks up token ids in tables it receives, its calls counted per table for the
    diagnosis of a model whose head never runs in a graph nanospec sees (:class:`diagnosis.HeadlessCalls`)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    positions = sorted({placeholders.index(table) for _, _, table, _ in embedding_lookups(gm.graph)
                        if table in placeholders and isinstance(example_inputs[placeholders.index(table)],
                                                                 torch.Tensor)})
    if not positions:
        return compiled
    model = diagnosis.model_of_frame([example_inputs[p] for p in positions])
    return diagnosis.HeadlessCalls(compiled, positions, model, example_inputs)


def _dense_reason(gm: fx.GraphModule, head: HeadMatch, real: dict, position, opts: NanoSpecOptions) -> str | None:
    """Why ``head`` cannot be rewritten in this graph for this call (None: nothing stops it yet)."""
    weight, bias = real.get(head.weight), _bias_tensor(head, real)
    transform = _transform_at(gm.graph, head)
    if transform:
        return _inside_transform(transform)
    if weight is None or bias is False:
        return "its weight or bias is not a parameter or buffer (it is computed in the graph or passed in)"
    if hasattr(weight, "placements") and not kind_of_head(head).takes_dtensor:
        return ("its weight is a DTensor in a layout nanospec does not rewrite (it rewrites ColwiseParallel heads, "
                "Shard(0) on a 1-D mesh, whose output is redistributed to Replicate(), or stays Shard(-1) and is "
                "read by a local max/top-k whose (value, id) candidates are all-gathered and picked from)")
    sources = [real.get(n) for n in getattr(head, "sources", ())]  # scales / parameters a weight computed per row reads
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


def _layout_clash(head: HeadMatch, heads: list[HeadMatch]) -> str | None:
    """A square weight read both as stored and transposed is two heads with one state (one per weight), which caches
    its rows in one layout: the transposed reader runs dense."""
    other = next((h for h in heads if h is not head and h.weight is head.weight and not h.transposed), None)
    if other is None or not head.transposed:
        return None
    return (f"its weight is also read as stored ([V, H]) by the head {other.name} in this graph, and the one active "
            "vocabulary of a weight caches its rows in one layout")


def _transform_at(graph: fx.Graph, head: HeadMatch) -> str | None:
    """The functorch transform (``torch.vmap``...) a projection of ``head`` runs inside, if any."""
    regions = transforms.transform_regions(graph)
    return next((regions[n] for n in head.nodes if n in regions), None)


def _inside_transform(transform: str) -> str:
    return (f"it runs inside {transform}, which Dynamo inlines: its values there are the transform's wrapped "
            "(batched) tensors, on which nanospec's ops cannot run. Move the head out of the transform: apply it "
            "to the transform's output (torch.vmap(body)(x), then the head), which computes the same logits")


def _rewrite_drafter(gm, example_inputs, rewritable, config, opts, config_patches, position) -> Callable:
    builder = _GraphBuilder(gm)
    bindings, reports = [], []
    grad_at = grad_modes(builder.graph, torch.is_grad_enabled())  # where eager runs each op (kept after the rewrite)
    for head, weight, bias in rewritable:
        kind = kind_of_head(head)
        state = kind.build_state(head, weight, bias, config)
        mapped = kind.remap(builder, head)
        into = kind.add_state(builder, state, mapped.weight, next((b for b in mapped.biases if b is not None), None))
        if head.transposed:  # observers copy head rows: the columns of a [H, V] weight
            into.transposed = True
        try:
            with GraphTransformObserver(builder.gm, "nanospec_rewrite_head", subsystem="nanospec"):
                report = rewrite_head(builder.graph, mapped, into.state, state.capacity)
        except DenseFallback as reason:
            raise DenseFallback(str(reason), head) from None
        if report.chain_outputs and (position.ends_at or position.called_from):
            raise DenseFallback(
                f"its logits leave this graph ({position.describe()}), and post-ops run on them after the break "
                "would give inactive tokens finite values. Remove that graph break", head)
        observe = opts.observe_inputs and state.observes
        try:
            with GraphTransformObserver(builder.gm, "nanospec_observe_inputs", subsystem="nanospec"):
                report.observers = insert_input_observers(builder.graph, into) if observe else 0
        except DenseFallback as reason:
            raise DenseFallback(str(reason), head) from None
        kind.finish_observers(builder, state, into, head, report.observers)
        snapshot_state_reads(builder.graph, into.state,
                             grad=grad_enabled_at(builder.graph, list(builder.graph.nodes), torch.is_grad_enabled()))
        if observe and not report.observers and token_tables(builder.gm):
            warn_once(
                f"nanospec: the head {head.name} is rewritten, but no token embedding of this graph has its vocabulary "
                f"(V={head.vocab_size} rows or more), so nothing joins the active set here: "
                "tokens outside it get -inf. "
                "Feed the set with nanospec_fx.active_vocab(model).observe(ids) or a target observer (options "
                "observe_topk/vocab).")
        reports.append((state, report))
        # Tables this graph observes lookups into: ids a prefill call of the same model (one whose parameters and
        # buffers this call also receives) embedded there join first
        # (not for a vocabulary-parallel head: its observe is a collective every rank must make in step).
        keep = observe and kind.keeps_prefill_ids
        tables = sorted({p for lk in (token_id_lookups(builder.graph, state.vocab_size) if keep else [])
                         if (p := builder.user_input_position(lk.table)) is not None})
        bindings.append(_DrafterBinding(state, builder.user_input_position(mapped.weight),
                                        builder.user_input_position(into.bias), into.state.ids, tables,
                                        _weight_positions(gm, example_inputs), kind))
    keep_grad_modes(builder.graph, grad_at, torch.is_grad_enabled())
    compiled = builder.compile(example_inputs, bindings, opts, config_patches)
    diagnosis.record_rewritten([state for state, _ in reports], example_inputs)  # heads a call argument weights too
    for state, report in reports:
        pass_reports.record(state, report)
        counters["nanospec"]["heads_rewritten"] += 1
        counters["nanospec"]["observers_inserted"] += report.observers
        log.debug("head %s rewritten: consumers %s, %d input observer(s)", report.head, report.consumers,
                  report.observers)
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
    kind: DenseHeadKind  # what a call passes and checks for the head's kind (head_kind.py)

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
            if (self.state.layout() != self.layout and self.config is not None
                    and not self.state.fits(self.state.weight)):
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

    def __init__(self, state: ActiveVocab, weight_pos: int | None, bias_pos: int | None,
                 ids_node: fx.Node | None = None, table_positions: list[int] = (), weight_positions: list[int] = (),
                 kind: DenseHeadKind | None = None):
        self.weight_pos, self.bias_pos = weight_pos, bias_pos
        self.kind = kind or kind_of_state(state)
        self.ids_node = ids_node  # the graph input of the slot table (which outputs are this head's logits)
        self.table_positions = table_positions  # inputs that are token tables this graph observes lookups into
        self.weight_positions = weight_positions  # inputs that are the model's parameters and buffers
        self.track(state)

    def observe_prefill(self, args: tuple) -> None:
        """Ids a head-less call of this model embedded in its tables since (:mod:`nanospec_fx.prefill`): a
        prefill call whose parameters and buffers all reach this call too (the same model, not another that
        shares the table)."""
        for position in self.table_positions:
            ids = prefill_ids.claim(args[position], self.state, lambda: [args[p] for p in self.weight_positions])
            if ids is not None:
                self.state.observe(ids, validate=False)

    def tensors(self) -> list[torch.Tensor]:
        return _state_inputs(self.state) + self.kind.graph_inputs(self.state)

    def update(self, args: tuple) -> bool:
        bias = args[self.bias_pos] if self.bias_pos is not None else self.state.bias
        if self.weight_pos is None or self.state.is_weight(args[self.weight_pos]):
            self.state.set_bias(bias)  # a replaced bias (same shape) is followed; another shape raises clearly
            changed = self.sync()
        else:
            old = self.state
            self.track(state_for(args[self.weight_pos], bias, old.config(), factory=old._fresh_factory(),
                                 transposed=old.transposed))
            pass_reports.carry(old, self.state)
            self.sync()
            changed = True
        return changed


# ----------------------------------------------------------------------------- target role
def _compile_target_observer(
    gm: fx.GraphModule, example_inputs: list, opts: NanoSpecOptions, config_patches: dict
) -> Callable:
    try:
        state = resolve_vocab(opts.vocab, opts)
    except (ValueError, TypeError) as exc:  # options['vocab'] is not a drafter with one active vocabulary
        raise option_error(exc) from None
    compiled = _build_target_observer(gm, example_inputs, state, opts, config_patches)
    if not isinstance(compiled, _StatefulCall):
        return compiled
    diagnosis.record_target_observer(state, opts.observe_topk, _held_tensors(gm, example_inputs))
    return _TargetObserverCall(
        compiled, lambda: _build_target_observer(gm, example_inputs, state, opts, config_patches), opts.vocab)


def _build_target_observer(gm, example_inputs: list, state: ActiveVocab, opts: NanoSpecOptions,
                           config_patches: dict) -> Callable:
    notes: list[str] = []
    heads = vocab_parallel_heads.gathered_heads(gm, example_inputs, head=opts.head, notes=notes,
                                                sharded_outputs=True) or find_heads(
        gm, example_inputs, vocab_size=opts.vocab_size, head=opts.head)
    if not heads:
        warn_once("nanospec: no LM head found in the target graph" + (f" ({'; '.join(notes)})" if notes else "")
                  + "; its top-k cannot be observed (it runs unchanged)")
        return _compile(gm, example_inputs, opts, config_patches)
    builder = _GraphBuilder(gm)
    kind = kind_of_state(state)  # a vocabulary-parallel drafter's: rows come from their owner shards
    into = kind.add_state(builder, state, None, None)
    observed = 0
    for head in heads:
        transform = _transform_at(gm.graph, head)
        if transform:
            warn_once(f"nanospec: the target's head {head.name} is not observed: {_inside_transform(transform)}")
            continue
        if head.vocab_size != state.vocab_size:
            raise OptionError(
                f"nanospec: the target's head {head.name} has {head.vocab_size} outputs but the drafter's active "
                f"vocabulary has {state.vocab_size} tokens; "
                "for a draft vocabulary use options={'draft_to_target': ...}"
            )
        if opts.observe_topk > head.vocab_size:
            raise OptionError(f"observe_topk={opts.observe_topk} exceeds the vocabulary size {head.vocab_size}")
        if state.observes:  # a vocabulary-parallel target's top-k is read on its gathered or exchanged logits
            observed += kind_of_head(head).insert_topk_observers(builder, head, into, opts)
    inputs = insert_input_observers(builder.graph, into) if opts.observe_inputs and state.observes else 0
    kinds = {k.group: k for k in [*map(kind_of_head, heads), kind] if k.group is not None}
    for group in sorted(kinds):  # each observer runs a collective: every rank the same count, or all raise
        kinds[group].agree(f"target observer: {observed} top-k and {inputs} input observer(s)", what="target")
    if not observed:
        return _compile(gm, example_inputs, opts, config_patches)
    kind.finish_observers(builder, state, into)
    return builder.compile(example_inputs, [_TargetBinding(state)], opts, config_patches)


class _TargetObserverCall:
    """A target observer that follows its drafter's state to a new dtype or device.

    The observer copies the drafter's head rows into the drafter's ActiveVocab, so its graph is made for the
    state's dtype; ``drafter.to(dtype)`` changes the weight (Dynamo recompiles the drafter, not the target).
    Before each call: a weight that no longer fits the state rebuilds it in place (same object, tokens kept,
    as the drafter's own recompile would), and a state whose layout changed rebuilds this graph for it.
    """

    def __init__(self, compiled: "_StatefulCall", build: Callable[[], Callable], vocab: Any = None):
        self.compiled, self.build = compiled, build
        self.binding = compiled.bindings[0]
        self.state = self.binding.state
        # What options['vocab'] was, held weakly: a torch.compile wrapper transformers may bypass (diagnosis)
        self.vocab = weakref.ref(vocab) if isinstance(vocab, nn.Module) else None
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        state = self.state
        self.calls += 1
        vocab = self.vocab() if self.vocab is not None else None
        if vocab is not None:
            diagnosis.note_target_call(state, vocab, self.calls)
        if not state.fits(state.weight):
            state_for(state.weight, state.bias, state.config())
        if state.layout() != self.binding.layout:
            self.compiled = self.build()
            self.binding = self.compiled.bindings[0]
        return self.compiled(*args)


class _TargetBinding(_Binding):
    """Extra inputs of a target observer: the drafter's head weight and bias (a vocabulary-parallel drafter's: its
    shard), its ActiveVocab tensors, then what its kind's observers read (``head_kind.py``)."""

    def __init__(self, state: ActiveVocab):
        self.kind = kind_of_state(state)
        self.track(state)
        # The state holds its weight weakly; this graph reads it, so it keeps it alive while it can run.
        self.weight = state.weight

    def tensors(self) -> list[torch.Tensor]:
        s = self.state
        return self.kind.weight_inputs(s) + _state_inputs(s) + self.kind.graph_inputs(s)

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
        raise ValueError("the drafter has several active vocabularies; "
                         "pass options['vocab'] = nanospec_fx.active_vocab(drafter, head=...)")
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
        with GraphTransformObserver(self.gm, "nanospec_dead_code_elimination", subsystem="nanospec"):
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
        try:  # a vocabulary-parallel head: its collectives' failures and its fetches' checks are the group's
            if any([b.update(args) for b in self.bindings]):
                self.extra = [t for b in self.bindings for t in b.tensors()]
            self.observe_prefill(args)
            out = self.compiled(*args, *self.extra)
        except Exception as error:
            for b in self.bindings:
                b.kind.explain_failure(b.state, error)  # another rank's nanospec error, if any
            raise
        for b in self.bindings:
            b.kind.after_call(b.state)
        return out

    def observe_prefill(self, args: tuple) -> None:
        """Prefill ids of this model, into every head's set that reads them (each head reads a prefill's log once,
        whatever the order the heads run in: :mod:`nanospec_fx.prefill`)."""
        for b in self.bindings:
            if hasattr(b, "observe_prefill"):
                b.observe_prefill(args)


def _compile(gm: fx.GraphModule, example_inputs: list, opts: NanoSpecOptions, config_patches: dict) -> Callable:
    if not opts.inductor:
        return gm.forward
    from torch._inductor.compile_fx import compile_fx

    from nanospec_fx.kernels.selection import inductor_cache_tag

    with inductor_cache_tag():  # the kernel config is part of inductor's cache keys (triton_op bodies bake it in)
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
