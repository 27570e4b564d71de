"""The graph stages of a drafter's rewrite, in order, each under a ``GraphTransformObserver``.

For each head the plan rewrites: ``nanospec_rewrite_head`` (the state's inputs appended, the head turned into
nanospec ops), ``nanospec_observe_inputs`` (the token lookups observed), ``nanospec_shard_observers`` (a
vocabulary-parallel head's observers made row fetches, by its kind), ``nanospec_snapshot_state_reads``; then, for the
graph, ``nanospec_keep_grad_modes`` and the dead-code elimination (``lowering.GraphCopy.finish``). A stage works on a
:class:`HeadWork` - what the plan decided for the head, as data - never on the options. The graph's inputs are those
of a state of the head's layout that no registry holds (``kind.layout_of``): the registered state is created or
looked up by :func:`registered_state` only once every stage of the head succeeded, so a head that ends dense (a
``DenseFallback`` raised by a stage, tagged here with its head) leaves none behind.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch.fx.passes.graph_transform_observer import GraphTransformObserver

from nanospec_fx.diagnostics import diagnosis

from nanospec_fx.vocab import reports as pass_reports
from nanospec_fx.compiler.head_kind import DenseHeadKind, Observers
from nanospec_fx.compiler.lowering import GraphCopy
from nanospec_fx.compiler.runtime import DrafterBinding, StatefulCall, weight_positions
from nanospec_fx.passes import (
    DenseFallback, HeadMatch, ObserveInto, RewriteReport, grad_enabled_at, grad_modes, insert_input_observers,
    keep_grad_modes, rewrite_head, snapshot_state_reads,
)
from nanospec_fx.passes.find_head import token_tables
from nanospec_fx.passes.graph_position import GraphPosition
from nanospec_fx.passes.lookups import token_id_lookups
from nanospec_fx.vocab.state import ActiveVocab
from nanospec_fx.vocab.config import StateConfig
from nanospec_fx.diagnostics.warning import warn_once

log = logging.getLogger(__name__)  # debug: each head's decision (counted in torch._dynamo.utils.counters["nanospec"])


@dataclass
class HeadWork:
    """One rewritten head's stages: what they read (the plan's decision, as data) and what they leave."""

    head: HeadMatch
    kind: DenseHeadKind
    weight: torch.Tensor
    bias: torch.Tensor | None
    config: StateConfig
    observe_inputs: bool
    position: GraphPosition
    layout: ActiveVocab | None = None  # unregistered: the shapes of the state's graph inputs
    observe: bool = False  # observe_inputs, for a state that observes
    mapped: HeadMatch | None = None
    into: ObserveInto | None = None
    report: RewriteReport | None = None
    observers: Observers | None = None
    tables: list[int] = field(default_factory=list)  # inputs that are token tables this graph observes lookups into


def rewrite(builder: GraphCopy, work: HeadWork) -> None:
    head, kind = work.head, work.kind
    work.layout = layout = kind.layout_of(head, work.weight, work.bias, work.config)
    work.observe = work.observe_inputs and layout.observes
    work.mapped = mapped = kind.remap(builder.graph, builder.node_map, head)
    work.into = into = builder.add_state(layout, mapped.weight, next((b for b in mapped.biases if b is not None), None),
                                         sharded=kind.sharded)
    if head.transposed:  # observers copy head rows: the columns of a [H, V] weight
        into.transposed = True
    into.stacked = head.stacked  # ... or the K rows of each token of a stacked weight
    work.report = rewrite_head(builder.graph, mapped, into.state, layout.capacity)
    position = work.position
    if work.report.chain_outputs and (position.ends_at or position.called_from):
        raise DenseFallback(
            f"its logits leave this graph ({position.describe()}), and post-ops run on them after the break "
            "would give inactive tokens finite values. Remove that graph break")


def observe_inputs(builder: GraphCopy, work: HeadWork) -> None:
    work.report.observers = insert_input_observers(builder.graph, work.into) if work.observe else 0


def shard_observers(builder: GraphCopy, work: HeadWork) -> None:
    names, tensors = work.kind.observer_inputs(work.layout)
    inputs = builder.add_inputs(names, tensors) if names else []
    work.observers = work.kind.finish_observers(builder.graph, work.layout, work.into, inputs, work.report.observers)


def snapshot(builder: GraphCopy, work: HeadWork) -> None:
    graph = builder.graph
    grad = grad_enabled_at(graph, list(graph.nodes), torch.is_grad_enabled())
    snapshot_state_reads(graph, work.into.state, grad=grad)


HEAD_STAGES: tuple[tuple[str, Callable[[GraphCopy, HeadWork], None]], ...] = (
    ("nanospec_rewrite_head", rewrite),
    ("nanospec_observe_inputs", observe_inputs),
    ("nanospec_shard_observers", shard_observers),
    ("nanospec_snapshot_state_reads", snapshot),
)


def run_head_stages(builder: GraphCopy, work: HeadWork) -> None:
    """Every stage of one head; a ``DenseFallback`` comes out as ``DenseFallback(reason, head)``."""
    for name, stage in HEAD_STAGES:
        try:
            with GraphTransformObserver(builder.gm, name, subsystem="nanospec"):
                stage(builder, work)
        except DenseFallback as reason:
            raise DenseFallback(str(reason.args[0]), work.head) from None
    head = work.head
    if work.observe and not work.report.observers and token_tables(builder.gm):
        warn_once(
            f"nanospec: the head {head.name} is rewritten, but no token embedding of this graph has its vocabulary "
            f"(V={head.vocab_size} rows or more), so nothing joins the active set here: "
            "tokens outside it get -inf. "
            "Feed the set with nanospec_fx.active_vocab(model).observe(ids) or a target observer (options "
            "observe_topk/vocab).")
    # Tables this graph observes lookups into: ids a prefill call of the same model (one whose parameters and
    # buffers this call also receives) embedded there join first
    # (not for a vocabulary-parallel head: its observe is a collective every rank must make in step).
    keep = work.observe and work.kind.keeps_prefill_ids
    work.tables = sorted({p for lk in (token_id_lookups(builder.graph, work.layout.vocab_size) if keep else [])
                          if (p := builder.user_input_position(lk.table)) is not None})


def keep_modes(builder: GraphCopy, grad_at: dict) -> None:
    """The rewritten ops run in the grad mode of the region their head ran in."""
    with GraphTransformObserver(builder.gm, "nanospec_keep_grad_modes", subsystem="nanospec"):
        keep_grad_modes(builder.graph, grad_at, torch.is_grad_enabled())


def rewrite_and_compile(gm: fx.GraphModule, example_inputs: list, works: list[HeadWork],
                        compile_graph: Callable[[fx.GraphModule, list], Callable]) -> StatefulCall:
    """The graph with every head of ``works`` rewritten, compiled by ``compile_graph(gm, example_inputs)``, called
    with one binding per head to its registered state (created or looked up only now, after every stage succeeded);
    what each head's stages did recorded for ``explain`` and counted."""
    gm, bindings = _rewrite_graph(gm, example_inputs, works)
    extra = [t for b in bindings for t in b.tensors()]
    compiled = StatefulCall(compile_graph(gm, list(example_inputs) + extra), bindings)
    states = [b.state for b in bindings]
    diagnosis.record_rewritten(states, example_inputs)  # heads a call argument weights too
    for state, work in zip(states, works):
        pass_reports.record(state, work.report)
        counters["nanospec"]["heads_rewritten"] += 1
        counters["nanospec"]["observers_inserted"] += work.report.observers
        log.debug("head %s rewritten: consumers %s, %d input observer(s)", work.report.head,
                  work.report.consumers, work.report.observers)
    return compiled


def _rewrite_graph(gm: fx.GraphModule, example_inputs: list,
                   works: list[HeadWork]) -> tuple[fx.GraphModule, list[DrafterBinding]]:
    builder = GraphCopy(gm)
    grad_at = grad_modes(builder.graph, torch.is_grad_enabled())  # where eager runs each op (kept after the rewrite)
    for work in works:
        run_head_stages(builder, work)
    keep_modes(builder, grad_at)
    positions = weight_positions(gm, example_inputs)
    bindings = [DrafterBinding(registered_state(w), builder.user_input_position(w.mapped.weight),
                               builder.user_input_position(w.into.bias), w.into.state.ids, w.tables, positions, w.kind)
                for w in works]
    return builder.finish(), bindings


def registered_state(work: HeadWork) -> ActiveVocab:
    """The head's state in the registry (created, or looked up), once its stages succeeded: its tensors must have
    the layout the graph was rewritten for."""
    state = work.kind.state_for(work.head, work.weight, work.bias, work.config)
    if state.layout() != work.layout.layout():
        raise RuntimeError(f"nanospec: the active vocabulary of {work.head.name} ({state!r}) does not have the layout "
                           "its graph was rewritten for; call torch._dynamo.reset() and compile again")
    return state
