"""A low-rank delta on a head (LoRA): ``W(h) + s * B(A(h))`` is one head over one active set.

LoRA adds to a head ``W`` [V, H] the product of two small projections, ``A`` [r, H] then ``B`` [V, r], scaled:
``lm_head(h) + B(A(h)) * s``, or PEFT's ``lora.Linear`` wrapping ``lm_head`` (``base_layer(x) +
lora_B(lora_A(dropout(x))) * scaling`` per adapter). ``B`` projects onto the vocabulary too, so the head finder
would take it for a second head with a set of its own, and logits of two sets meeting in one sum are exact on
neither. But column ``v`` of the sum is token ``v``'s alone, ``h . W[v] + s * A(h) . B[v]``: over one set, the
compact sum is the compact head plus ``s * A(h) @ B[ids].T`` on the same slots, exactly.

:func:`delta_onto` takes a projection for such a delta only in that form: its input is the output of a projection
narrower than the head's input (the rank), and its value goes, one user at a time, through elementwise steps whose
other operands are numbers (the scaling, a cast) into an ``add``; :func:`lora_deltas` then asks that the ``add``'s
other operand be computed from the head's logits. Anything else (two full heads added, a delta read elsewhere) is
left to the finder, where two heads whose logits meet run dense with a warning.

Several calls of one head in a graph (a draft loop in ``forward``, MTP depths sharing a head) each have their own
delta. :func:`lora_deltas` gives a delta to the call whose logits its ``add`` reads; when that sum is computed from
several projections onto the vocabulary (a later step of a draft loop is computed from the earlier steps' logits
too, of this head or of another), to the last of them (no other is computed from it) if it is this head's, and only
when the delta reads that call's own hidden state (its input, up to dropout and casts). A delta whose last
projection is another head's is that head's; one that fits no one call is ambiguous: the rewrite runs the head dense
with a warning naming it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from . import patterns, projections
from .graph import describe, downstream, node_name, where

ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
ADD_METHODS = {"add", "add_", "__add__", "__iadd__"}
DELTA_OF = "nanospec_lora_delta_of"  # meta of a compact LoRA delta: the cursor of the state it is read over
# what stands between a hidden state and a projection of it without changing which hidden state it is
_SAME_HIDDEN_METHODS = patterns.CAST_METHODS | {"type"}  # type_as reads a second tensor: refused below


def delta_steps(proj: fx.Node) -> tuple[list[fx.Node], fx.Node] | None:
    """``(steps, add)``: the elementwise steps whose other operands are numbers (``* scaling``, ``/ r``, a cast) that
    ``proj``'s value goes through, one user at a time, and the two-operand ``add`` it then reaches; None otherwise."""
    steps, cur = [], proj
    while len(cur.users) == 1:
        (user,) = cur.users
        others = [a for a in (*user.args, *user.kwargs.values()) if a is not cur]
        if patterns.is_call(user, ADD_FUNCTIONS, ADD_METHODS) and len(user.args) == 2 and not user.kwargs:
            return steps, user
        if not patterns.is_elementwise(user) or cur not in user.args or any(isinstance(a, fx.Node) for a in others):
            return None
        steps.append(user)
        cur = user
    return None


def _low_rank(proj: fx.Node, head_hidden: int) -> bool:
    """``proj``'s input is the output of a projection narrower than ``head_hidden`` (the rank of ``B(A(h))``)."""
    x = projections.match_projection(proj)
    if x is None or not isinstance(x[0], fx.Node) or projections.match_projection(x[0]) is None:
        return False
    rank = projections.projection_shape(x[0])
    return rank is not None and isinstance(rank[0], int) and rank[0] < head_hidden


def delta_onto(proj: fx.Node, head_hidden: int) -> tuple[fx.Node, fx.Node] | None:
    """``(add, logits)``: the ``add`` that puts the low-rank ``proj`` onto ``logits`` (its other operand), or None."""
    path = delta_steps(proj) if _low_rank(proj, head_hidden) else None
    if path is None:
        return None
    steps, add = path
    other = [a for a in add.args if a is not (steps[-1] if steps else proj)]
    return (add, other[0]) if len(other) == 1 and isinstance(other[0], fx.Node) else None


def _hidden_source(node) -> object:
    """The hidden state ``node`` is, up to dropout (``F.dropout``, PEFT's ``lora_dropout``) and casts or copies."""
    while isinstance(node, fx.Node) and node.args and isinstance(node.args[0], fx.Node) and (
            "dropout" in (node_name(node) or "") or node.op == "call_method" and node.target in _SAME_HIDDEN_METHODS
            and not any(isinstance(a, fx.Node) for a in (*node.args[1:], *node.kwargs.values()))):
        node = node.args[0]
    return node


def _projection_input(proj: fx.Node) -> object:
    """The hidden state a projection reads (None for one it cannot match)."""
    m = projections.match_projection(proj)
    return _hidden_source(m[0]) if m is not None else None


def _delta_input(delta: fx.Node) -> object:
    """The hidden state a delta ``B(A(h))`` reads: ``h``."""
    return _projection_input(projections.match_projection(delta)[0])


@dataclass
class LoraDeltas:
    """A head's LoRA deltas: ``of`` each projection (the ones read over its set), and the ``ambiguous`` ones, each
    with the reason no one projection's set is provably its own."""

    of: dict[fx.Node, list[fx.Node]]
    ambiguous: dict[fx.Node, str] = field(default_factory=dict)

    def all(self) -> set[fx.Node]:
        return {d for ds in self.of.values() for d in ds} | set(self.ambiguous)


def lora_deltas(graph: fx.Graph, head_nodes: list[fx.Node], vocab: int, hidden: int) -> LoraDeltas:
    """``head_nodes`` (a head's projections onto ``vocab`` tokens from ``hidden``) -> the LoRA deltas added onto their
    logits in ``graph``: projections onto the vocabulary with a stored weight [V, r] (parameter, buffer, input: its
    rows are gathered at the set's slots) that :func:`delta_onto` takes. Each delta goes to one projection: the
    one whose logits its ``add`` reads; of several projections onto the vocabulary (any head's), the last (none of
    the others computed from it), if it is one of ``head_nodes`` and the delta reads its own hidden state;
    otherwise it is ``ambiguous`` (or another head's). The finder and the rewrite both ask this, each on its own
    graph."""
    candidates = [n for n in graph.nodes if n not in head_nodes and (m := projections.match_projection(n))
                  and m[1].op in ("placeholder", "get_attr") and not projections.projection_transposed(n)
                  and (shape := patterns.tensor_shape(n)) and shape[-1] == vocab]
    found = LoraDeltas({p: [] for p in head_nodes})
    if not candidates:
        return found
    # every projection onto the vocabulary that is no delta: this head's calls and any other head's
    heads = [n for n in graph.nodes if n in head_nodes or projections.match_projection(n) is not None
             and (shape := patterns.tensor_shape(n)) and shape[-1] == vocab and DELTA_OF not in n.meta
             and not _low_rank(n, hidden)]
    after = {q: downstream(q) for q in heads}
    for d in candidates:
        path = delta_onto(d, hidden)
        if path is None:
            continue
        onto = [q for q in heads if path[1] is q or path[1] in after[q]]  # the projections the sum is computed from
        last = [q for q in onto if not any(r in after[q] for r in onto)]
        if not any(q in head_nodes for q in last):
            continue  # another head's delta, or none
        if len(onto) == 1 or len(last) == 1 and _projection_input(last[0]) is _delta_input(d) is not None:
            found.of[last[0]].append(d)
        else:
            found.ambiguous[d] = (
                f"the LoRA delta {describe(d)} ({where(d)}) is added to logits computed from {len(onto)} head "
                "calls, and it reads the hidden state of no one last call: which call's active set it is read "
                "over is not clear. Add each call's delta to that call's own logits, computed from its own input")
    return found
