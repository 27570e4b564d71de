"""What one compile will do, decided before anything is done: the :class:`CompilePlan`.

Inductor's shape: decisions as data, then a stage list (:mod:`nanospec_fx.compiler.execute`). The plan holds the
parsed options, the vocabulary's state config (its policy resolved here, once), the inductor config patches, the
graph's position in the call (graph breaks), the role (a drafter's heads are rewritten; a target's are observed),
and one :class:`HeadPlan` per head: its kind (``head_kind.py``), its decision - :class:`Rewrite`, :class:`Observe`
or :class:`Dense` with the reason - and the warnings that decision gives. Every soundness decision that keeps a
head dense is taken here (the reasons come from ``decisions.py``), so each is said once. The plan is frozen: a
head the rewrite finds unsound after all (a ``DenseFallback``) gets a new plan, :func:`with_dense`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx

from nanospec_fx.compiler import decisions, find
from nanospec_fx.compiler.head_kind import DENSE, DenseHeadKind, gathered_heads, kind_of_head
from nanospec_fx.compiler.options import NanoSpecOptions, mode_config, option_error
from nanospec_fx.passes import DenseHead, HeadMatch, find_heads, graph_position
from nanospec_fx.passes.graph_position import GraphPosition
from nanospec_fx.vocab.policies import resolve
from nanospec_fx.vocab.config import StateConfig


@dataclass(frozen=True)
class Rewrite:
    """The head is rewritten to its active vocabulary: its weight and bias tensors (the state's key)."""

    weight: torch.Tensor
    bias: torch.Tensor | None


@dataclass(frozen=True)
class Observe:
    """A target's head: its top-k predictions are observed into the drafter's active vocabulary."""


@dataclass(frozen=True)
class Dense:
    """The head runs as it is, for ``reason`` (said once, counted as ``dense: <its first clause>``)."""

    reason: str


@dataclass(frozen=True)
class HeadPlan:
    """One head's decision. ``head`` is None for a projection onto the vocabulary the finder could not take as a
    head (its note is the reason)."""

    name: str
    head: HeadMatch | None
    kind: DenseHeadKind
    decision: Rewrite | Observe | Dense
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class CompilePlan:
    """Everything one compile decided (see the module docstring)."""

    gm: fx.GraphModule
    example_inputs: list
    options: NanoSpecOptions
    config: StateConfig
    patches: dict
    position: GraphPosition
    role: str  # "drafter" or "target"
    heads: tuple[HeadPlan, ...]
    notes: tuple[str, ...] = ()
    """What the graph says besides its heads' decisions (said before them)."""

    @classmethod
    def build(cls, gm: fx.GraphModule, example_inputs: list, mode: str | None, options: dict | None) -> "CompilePlan":
        """The plan for one graph Dynamo hands the backend; a bad option raises :class:`OptionError`."""
        mode_patches = mode_config(mode)
        opts = NanoSpecOptions.parse(options)
        try:
            config = resolve(opts.vocab_config)  # validates policy options before anything else
        except (ValueError, TypeError, OSError) as exc:  # a policy's options (its frequencies, pinned_size)
            raise option_error(exc) from None
        position = graph_position(gm)
        if opts.observe_topk is not None:
            heads, notes = _target_heads(gm, example_inputs, opts.head, opts.vocab_size)
            role = "target"
        else:
            # A head over a draft vocabulary (EAGLE-3 d2t) has one output per draft token, not the embedding's width.
            width = opts.vocab_size
            if width is None and opts.vocab_config.draft_to_target is not None:
                width = torch.as_tensor(opts.vocab_config.draft_to_target).numel()
            heads, notes = _drafter_heads(gm, example_inputs, opts.head, width, opts.observe_inputs, position)
            role = "drafter"
        patches = {**mode_patches, **opts.inductor_options}
        return cls(gm, example_inputs, opts, config, patches, position, role, tuple(heads), tuple(notes))


def warnings(plan: CompilePlan) -> list[str]:
    """Everything the plan says, once, in order: the graph's notes, then each head's."""
    return [*plan.notes, *(w for h in plan.heads for w in h.warnings)]


def with_dense(plan: CompilePlan, head: HeadMatch, reason: str) -> CompilePlan:
    """``plan`` with ``head`` dense after all (its rewrite or observers found it unsound)."""
    heads = tuple(dataclasses.replace(h, decision=Dense(reason), warnings=(*h.warnings, _runs_dense(h.name, reason)))
                  if h.head is head else h for h in plan.heads)
    return dataclasses.replace(plan, heads=heads)


def _runs_dense(name: str, reason: str) -> str:
    return f"nanospec: the head {name} runs dense: {reason}"


def _drafter_heads(gm, example_inputs, name: str | None, width: int | None, observe_inputs: bool,
                   position) -> tuple[list[HeadPlan], list[str]]:
    """A drafter's heads (``options['head']`` ``name``, of ``width`` outputs), each rewritten or dense, and the
    graph's notes."""
    heads, notes = find.drafter_heads(gm, example_inputs, head=name, width=width)
    # a projection onto the vocabulary the finder cannot take as a head (passes' DenseHead note): dense, its reason
    refused = [HeadPlan(n.head, None, DENSE, Dense(str(n)), (_runs_dense(n.head, n),))
               for n in notes if isinstance(n, DenseHead)]
    if not heads:
        return refused, find.headless_notes(gm, notes, position)
    said = [f"nanospec: {n}" for n in notes if not isinstance(n, DenseHead)]
    real = decisions.real_tensors(gm, example_inputs)
    met: dict[HeadMatch, str] = {}
    told: dict[HeadMatch, list[str]] = {h: [] for h in heads}
    for group, reason in decisions.meetings(gm, heads):  # each group said once, naming every head of it
        names = ", ".join(h.name for h in group[:-1]) + f" and {group[-1].name}"
        told[group[0]].append(f"nanospec: the heads {names} run dense: {reason}")
        for head in group:
            met.setdefault(head, reason)
    plans = []
    for head in heads:
        kind = kind_of_head(head)
        reason = met.get(head) or decisions.dense_reason(
            gm, head, real, position, observe_inputs, kind.takes_dtensor) or decisions.layout_clash(head, heads)
        if head in met:
            decision = Dense(reason)
        elif reason:
            decision = Dense(reason)
            told[head].append(_runs_dense(head.name, reason))
        else:
            decision = Rewrite(real[head.weight], decisions.bias_tensor(head, real))
        plans.append(HeadPlan(head.name, head, kind, decision, tuple(told[head])))
    return [*plans, *refused], said


def _target_heads(gm, example_inputs, name: str | None, width: int | None) -> tuple[list[HeadPlan], list[str]]:
    """A target's heads: each observed, unless it runs inside a functorch transform."""
    notes: list[str] = []
    heads = gathered_heads(gm, example_inputs, head=name, notes=notes, sharded_outputs=True) or find_heads(
        gm, example_inputs, vocab_size=width, head=name)
    if not heads:
        return [], ["nanospec: no LM head found in the target graph" + (f" ({'; '.join(notes)})" if notes else "")
                    + "; its top-k cannot be observed (it runs unchanged)"]
    plans = []
    for head in heads:
        transform = decisions.transform_at(gm.graph, head)
        reason = decisions.inside_transform(transform) if transform else None
        said = (f"nanospec: the target's head {head.name} is not observed: {reason}",) if reason else ()
        plans.append(HeadPlan(head.name, head, kind_of_head(head), Dense(reason) if reason else Observe(), said))
    return plans, []
