"""A target observer: the target is not rewritten; its top-k predictions at every scored position (and its input
tokens) are observed into the drafter's active vocabulary, on the device.

Compiled with ``options={"observe_topk": k, "vocab": drafter}``. The drafter's state is looked up (or created from
its output embeddings) here, once the plan is taken; the observers copy the drafter's head rows, so the graph reads
the drafter's head weight (a vocabulary-parallel drafter's: its shard) as extra inputs.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn

from nanospec_fx.diagnostics import diagnosis
from nanospec_fx.compiler import lowering
from nanospec_fx.compiler.head_kind import kind_of_state
from nanospec_fx.compiler.lowering import GraphCopy
from nanospec_fx.compiler.options import OptionError, option_error
from nanospec_fx.compiler.plan import CompilePlan, Observe
from nanospec_fx.compiler.runtime import StatefulCall, TargetBinding, TargetObserverCall, held_tensors
from nanospec_fx.diagnostics.lookup import head_parameters
from nanospec_fx.vocab.module_heads import registered_states, unwrap
from nanospec_fx.passes import insert_input_observers
from nanospec_fx.vocab.state import ActiveVocab, state_for
from nanospec_fx.vocab.config import StateConfig
from nanospec_fx.diagnostics.warning import warn_once


def observe_target(plan: CompilePlan) -> Callable:
    """The target's graph with its observers (or unchanged, when it has no head to observe)."""
    for message in (*plan.notes, *(w for h in plan.heads for w in h.warnings)):
        warn_once(message)
    opts = plan.options
    try:
        state = resolve_vocab(opts.vocab, plan.config)
    except (ValueError, TypeError) as exc:  # options['vocab'] is not a drafter with one active vocabulary
        raise option_error(exc) from None
    heads = [(h.head, h.kind) for h in plan.heads if isinstance(h.decision, Observe)]
    kinds = [h.kind for h in plan.heads]  # every head's group agrees, observed or not
    topk, prompt, inputs = opts.observe_topk, opts.observe_prompt, opts.observe_inputs

    def build() -> Callable:
        return _observed(plan.gm, plan.example_inputs, state, heads, kinds, topk, prompt, inputs,
                         lambda gm, extra: lowering.compile_graph(gm, extra, opts.inductor, plan.patches))

    if not plan.heads:
        return lowering.compile_graph(plan.gm, plan.example_inputs, opts.inductor, plan.patches)
    compiled = build()
    if not isinstance(compiled, StatefulCall):
        return compiled
    diagnosis.record_target_observer(state, topk, held_tensors(plan.gm, plan.example_inputs))
    return TargetObserverCall(compiled, build, opts.vocab)


def _observed(gm, example_inputs: list, state: ActiveVocab, heads: list, kinds: list, topk: int, prompt: bool,
              observe_inputs: bool, compile_graph: Callable) -> Callable:
    builder = GraphCopy(gm)
    kind = kind_of_state(state)  # a vocabulary-parallel drafter's: rows come from their owner shards
    into = builder.add_state(state, None, None, kind.head_inputs(state), sharded=kind.sharded)
    observed = 0
    for head, head_kind in heads:
        if head.vocab_size != state.vocab_size:
            raise OptionError(
                f"nanospec: the target's head {head.name} has {head.vocab_size} outputs but the drafter's active "
                f"vocabulary has {state.vocab_size} tokens; "
                "for a draft vocabulary use options={'draft_to_target': ...}"
            )
        if topk > head.vocab_size:
            raise OptionError(f"observe_topk={topk} exceeds the vocabulary size {head.vocab_size}")
        if state.observes:  # a vocabulary-parallel target's top-k is read on its gathered or exchanged logits
            observed += head_kind.insert_topk_observers(
                builder.graph, builder.node_map, head, into, topk, prompt)
    inputs = insert_input_observers(builder.graph, into) if observe_inputs and state.observes else 0
    groups = {k.group: k for k in [*kinds, kind] if k.group is not None}
    for group in sorted(groups):  # each observer runs a collective: every rank the same count, or all raise
        groups[group].agree(f"target observer: {observed} top-k and {inputs} input observer(s)", what="target")
    if not observed:
        return compile_graph(gm, example_inputs)
    names, tensors = kind.observer_inputs(state)
    kind.finish_observers(builder.graph, state, into, builder.add_inputs(names, tensors) if names else [], 0)
    binding = TargetBinding(state)
    return StatefulCall(compile_graph(builder.finish(), list(example_inputs) + binding.tensors()), [binding])


def resolve_vocab(vocab: Any, config: StateConfig) -> ActiveVocab:
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
    return state_for(weight, bias, config)
