"""A low-rank delta on a head (LoRA): ``W(h) + s * B(A(h))`` is one head over one active set.

LoRA adds to a head ``W`` [V, H] the product of two small projections, ``A`` [r, H] then ``B`` [V, r], scaled:
``lm_head(h) + B(A(h)) * s``, or PEFT's ``lora.Linear`` wrapping ``lm_head`` (``base_layer(x) +
lora_B(lora_A(dropout(x))) * scaling`` per adapter). ``B`` projects onto the vocabulary too, so the head finder
would take it for a second head with a set of its own, and logits of two sets meeting in one sum are exact on
neither. But column ``v`` of the sum is token ``v``'s alone, ``h . W[v] + s * A(h) . B[v]``: over one set, the
compact sum is the compact head plus ``s * A(h) @ B[ids].T`` on the same slots, exactly.

:func:`lora_delta` takes a projection for such a delta only in that form: its input is the output of a projection
narrower than the head's input (the rank), and its value goes, one user at a time, through elementwise steps whose
other operands are numbers (the scaling, a cast) into an ``add`` whose other operand is computed from the head's
logits. Anything else (two full heads added, a delta read elsewhere) is left to the finder, where two heads whose
logits meet run dense with a warning.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from . import patterns, projections
from .graph import downstream

ADD_FUNCTIONS = {operator.add, operator.iadd, torch.add}
ADD_METHODS = {"add", "add_", "__add__", "__iadd__"}


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


def lora_delta(proj: fx.Node, head_logits: set[fx.Node], head_hidden: int) -> fx.Node | None:
    """The ``add`` that puts ``proj`` (a projection onto the vocabulary) onto a head's logits as a LoRA delta, or
    None when ``proj`` is not one. ``head_logits``: every node computed from the head's projections (and those);
    ``head_hidden``: the head's input width H (the delta's input, ``A(h)``, must be narrower)."""
    x = projections.match_projection(proj)
    if x is None or not isinstance(x[0], fx.Node) or projections.match_projection(x[0]) is None:
        return None
    rank = projections.projection_shape(x[0])
    if rank is None or not isinstance(rank[0], int) or rank[0] >= head_hidden:
        return None
    path = delta_steps(proj)
    if path is None:
        return None
    steps, add = path
    other = [a for a in add.args if a is not (steps[-1] if steps else proj)]
    return add if len(other) == 1 and isinstance(other[0], fx.Node) and other[0] in head_logits else None


def lora_deltas(graph: fx.Graph, head_nodes: list[fx.Node], vocab: int, hidden: int) -> dict[fx.Node, list[fx.Node]]:
    """Each of ``head_nodes`` (a head's projections onto ``vocab`` tokens from ``hidden``) -> the LoRA deltas added
    onto its logits in ``graph``: projections onto the vocabulary with a stored weight [V, r] (parameter, buffer,
    input: its rows are gathered at the set's slots) that :func:`lora_delta` takes. The finder and the rewrite
    both ask this, each on its own graph."""
    candidates = [n for n in graph.nodes if n not in head_nodes and (m := projections.match_projection(n))
                  and m[1].op in ("placeholder", "get_attr") and not projections.projection_transposed(n)
                  and (shape := patterns.tensor_shape(n)) and shape[-1] == vocab]
    if not candidates:
        return {p: [] for p in head_nodes}
    return {p: [d for d in candidates if lora_delta(d, {p} | downstream(p), hidden) is not None] for p in head_nodes}
