"""Carry out a :class:`~nanospec_fx.compiler.plan.CompilePlan`: the callable the backend returns.

A target's plan goes to :mod:`nanospec_fx.compiler.target`. A drafter's: a graph without a head runs unchanged (a
prefill records the ids it embeds, :mod:`headless`); otherwise the heads the plan rewrites go through the graph
stages (:mod:`stages`), and a head a stage finds unsound (``DenseFallback``) is planned dense and the rewrite
restarts without it. The ranks of a vocabulary-parallel head agree twice, here only: on the plan before any state is
built (that may run a collective), and on the outcome (what the observers fetch, or the error every rank then
raises). The plan's warnings and counters are given once, at the end, from the final plan.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch._dynamo.utils import counters

from nanospec_fx.diagnostics import diagnosis
from nanospec_fx.compiler import lowering, target
from nanospec_fx.compiler.headless import counted, recording_prefill
from nanospec_fx.compiler.plan import CompilePlan, Dense, Rewrite, warnings, with_dense
from nanospec_fx.compiler.runtime import DenseCall, held_tensors, weight_positions
from nanospec_fx.compiler.stages import HeadWork, rewrite_and_compile
from nanospec_fx.passes import DenseFallback
from nanospec_fx.diagnostics.warning import warn_once

log = logging.getLogger(__name__)  # debug: each head's decision (counted in torch._dynamo.utils.counters["nanospec"])


def execute(plan: CompilePlan) -> Callable:
    """The compiled graph ``plan`` describes."""
    if plan.role == "target":
        return target.observe_target(plan)
    if not any(h.head is not None for h in plan.heads):
        return _headless(plan)
    agree(plan)  # before any state is built: that may run a collective
    try:
        plan, compiled, observers = _rewrite_settled(plan)
    except Exception as error:  # still meet the others' second consensus: they would wait for it
        agree(plan, failure=f"{type(error).__name__}: {error}")
        raise
    agree(plan, observers)
    if compiled is None:
        return _dense(plan)
    _say(plan, stacklevel=4)
    return compiled


def _rewrite_settled(plan: CompilePlan):
    """``(plan, compiled, observers)``: the plan's rewrites compiled, each head a stage finds unsound planned dense
    (``compiled`` None once none is left)."""
    while any(isinstance(h.decision, Rewrite) for h in plan.heads):
        works = [HeadWork(h.head, h.kind, h.decision.weight, h.decision.bias, plan.config,
                          plan.options.observe_inputs, plan.position)
                 for h in plan.heads if isinstance(h.decision, Rewrite)]
        inductor, patches = plan.options.inductor, plan.patches
        try:
            compiled = rewrite_and_compile(plan.gm, plan.example_inputs, works,
                                           lambda gm, inputs: lowering.compile_graph(gm, inputs, inductor, patches))
        except DenseFallback as fallback:
            plan = with_dense(plan, fallback.args[1], fallback.args[0])
            continue
        return plan, compiled, {w.head: w.observers for w in works}
    return plan, None, {}


def _headless(plan: CompilePlan) -> Callable:
    """A drafter graph without a head to rewrite. A whole call keeps the ids it looks up for the head's next call (a
    prefill), warned or not; a piece of a call that looks up ids is counted, as a whole head-less call is."""
    gm, example_inputs, opts = plan.gm, plan.example_inputs, plan.options
    recording = (recording_prefill(gm, example_inputs, opts.inductor, plan.patches)
                 if plan.position.whole_call and opts.observe_inputs else None)
    if recording is not None or not opts.observe_inputs:
        return _dense(plan, recording)
    return counted(_dense(plan), gm, example_inputs)


def _dense(plan: CompilePlan, compiled: Callable | None = None) -> Callable:
    """The graph compiled unchanged (or ``compiled``, its ids recording twin); its warnings given now, and again
    when another model runs it."""
    said = _say(plan, stacklevel=5)
    if compiled is None:
        compiled = lowering.compile_graph(plan.gm, plan.example_inputs, plan.options.inductor, plan.patches)
    positions = weight_positions(plan.gm, plan.example_inputs)
    return DenseCall(compiled, said, positions, plan.example_inputs) if said and positions else compiled


def _say(plan: CompilePlan, stacklevel: int) -> list[str]:
    """The plan's warnings, once, and its counters: heads found, each dense head and its reason."""
    heads = [h for h in plan.heads if h.head is not None]
    counters["nanospec"]["heads_found"] += len(heads)
    if not heads:
        counters["nanospec"]["graphs_without_head"] += 1
    for h in plan.heads:
        if isinstance(h.decision, Dense):
            counters["nanospec"]["heads_dense"] += 1
            counters["nanospec"][f"dense: {reason_key(h.decision.reason)}"] += 1
            log.debug("head %s runs dense: %s", h.name, h.decision.reason)
    said = warnings(plan)
    for message in said:
        warn_once(message, stacklevel=stacklevel)
    diagnosis.record_dense(held_tensors(plan.gm, plan.example_inputs), said)
    return said


def reason_key(reason: str) -> str:
    """A dense reason's counter key: its first clause (up to a colon, semicolon or parenthesis), at most 80
    characters."""
    cut = min((i for i in (reason.find(c) for c in ":;(") if i > 0), default=len(reason))
    return reason[:cut].strip()[:80]


def agree(plan: CompilePlan, observers: dict | None = None, failure: str | None = None) -> None:
    """Every rank of a vocabulary-parallel head's group took the same decision, or all raise (no hang). The
    decision names the observers and their ids' shapes (each runs a fetch of that many rows), or the error the
    rewrite raised (``failure``: every rank then raises, the ranks' decisions listed where they differ)."""
    for h in plan.heads:
        if h.head is None or h.kind.group is None:  # a head on one device: nobody to agree with
            continue
        weight = h.head.weight.meta.get("example_value", h.head.weight.meta.get("val"))
        # a head of another dtype or shape on one rank would fetch rows of other sizes (gloo aborts): agreed here
        layout = (f", head {str(weight.dtype).removeprefix('torch.')} {list(weight.shape)}"
                  if isinstance(weight, torch.Tensor) else "")
        seen = (observers or {}).get(h.head)
        if failure is not None:
            decision = f"{h.name} failed to compile ({failure})"
        elif isinstance(h.decision, Rewrite):
            decision = (f"{h.name} rewritten with {plan.options.vocab_config}{layout}"
                        + (f", {seen.count} input observer(s)" if seen is not None else "")
                        + (f" of ids shaped {', '.join(seen.shapes)}" if seen is not None and seen.shapes else ""))
        else:
            decision = f"{h.name} dense ({'; '.join(warnings(plan)) or 'no reason given'})"
        h.kind.agree(decision)
