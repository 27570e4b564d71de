"""Where the logits of two heads meet: an op that combines, element by element, values computed from two heads.

Each head weight has its own active set, so two heads' logits are ``-inf`` at different tokens. An op that
combines them (``za + zb``, ``za - zb``, ``torch.maximum``, ``torch.logaddexp``, ``torch.where(c, za, zb)``,
``zb.gather(-1, za.topk(k).indices)``, ``torch.stack([za, zb]).amax(0)``, ``log_softmax(za) - log_softmax(zb)``)
has no one set on which a rewritten chain is exact: continuing one head's chain through it masks the result
with that head's set alone (``maximum`` is then ``-inf`` where only the other head is active), and ending both
chains there gives an answer that depends on the spelling. So the backend runs every head of such a group dense,
with one warning naming them all (``nanospec_fx/compiler/plan.py``), and the rewrite stops a chain at any op whose
other operand comes from another vocabulary projection (``rewrite_head._chain_operands_ok``).

Projections of one head weight read one state: their meeting is no meeting here (the chain is exact on that set).
Numbers per row computed from one head (a logsumexp, the values of a top-k) hold no token's logit any more: combining
them with another head's (Medusa's tree scores) is plain arithmetic on values each exact on its own set. The rewrite
still ends a chain at any operand computed from another head, per row or not (``za - zb.logsumexp(-1)``).

Values computed from several heads that stay apart are not a meeting: ``torch.stack``/``torch.cat`` of them (a
Medusa drafter's ``[K, ..., V]`` logits), the graph output, and on such a stacked tensor elementwise steps, views
and ops along the vocabulary axis (``log_softmax(-1)``, ``topk``, ``argmax(-1)``). A reduction across the stacked
axis (``amax(0)``, ``mean(0)``, a flattening ``argmax()``) or any op this module does not know combines them.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from . import effects, patterns, vocab_views
from .graph import call_arg, describe, node_name, where

_KEEP_APART_FUNCTIONS = {torch.stack, torch.cat, torch.concat, torch.concatenate, torch.hstack, torch.vstack}
# ops whose ``dim`` argument (position 1 as FX records it, or the keyword) says which axis they run along
_ALONG_DIM = {"softmax", "log_softmax", "logsumexp", "amax", "amin", "max", "min", "sum", "mean", "sort", "argsort",
              "argmax", "argmin", "cumsum", "cumprod", "std", "var", "norm", "prod", "nansum", "logcumsumexp", "all",
              "any", "median", "nanmean"}


@dataclass
class Meeting:
    """Heads (indices into the list given) whose logits one op combines, and that op."""

    heads: list[int]
    node: fx.Node

    def describe(self) -> str:
        return f"{describe(self.node)} ({where(self.node)})"


def find_meetings(graph: fx.Graph, projections: list[list[fx.Node]]) -> list[Meeting]:
    """The ops of ``graph`` where logits of different heads meet (``projections[i]``: head ``i``'s projection
    nodes), in graph order; an op is listed when a head it combines is in no earlier meeting."""
    meetings: list[Meeting] = []
    grouped: set[int] = set()

    def combined(node: fx.Node, heads: frozenset[int]) -> None:
        if heads - grouped:
            meetings.append(Meeting(sorted(heads), node))
            grouped.update(heads)

    logits_sources(graph, projections, combined, token_aligned=True)
    return meetings


def logits_sources(graph: fx.Graph, projections: list[list[fx.Node]], combined=None,
                   token_aligned: bool = False) -> dict[fx.Node, frozenset]:
    """For each node computed from the logits of the heads (``projections[i]``: head ``i``'s projection nodes),
    which heads. A projection carries its own head only (ids from one head's output looked up in a table carry
    no logits on: a draft loop's next hidden state is no logits). ``combined(node, heads)`` is called at each op
    that combines values of several heads element by element.

    With ``token_aligned``, only values that still hold a value per token carry (a floating tensor with an axis as
    wide as a head's vocabulary) and token ids: a reduction or a selection of one head's logits (a logsumexp, the
    values of a top-k) is a number per row, which combined with another head's is plain arithmetic on values each
    exact on its own set (Medusa's tree scores: the top-k log-probabilities of two heads summed)."""
    widths = {shape[-1] for nodes in projections for p in nodes
              if (shape := patterns.tensor_shape(p)) and isinstance(shape[-1], int)}
    carries: dict[fx.Node, frozenset[int]] = {}  # the heads a value is computed from
    stacked: set[fx.Node] = set()  # values holding several heads' logits side by side
    for i, nodes in enumerate(projections):
        for p in nodes:
            carries[p] = frozenset({i})
    for n in graph.nodes:
        if n in carries or n.op in ("placeholder", "get_attr"):
            continue
        metadata = patterns.metadata_operands(n)  # ``bias.type_as(za)``: za's dtype only, no logits of head a
        inputs = [a for a in n.all_input_nodes if carries.get(a) and a not in metadata]
        if not inputs or _floating(n) and not any(_floating(a) for a in inputs):
            continue  # ids from a head's output looking up another table (a draft loop's embedding): no logits
        heads = frozenset().union(*(carries[a] for a in inputs))
        if len(heads) > 1 and combined is not None and not _keeps_apart(n, inputs, carries, stacked):
            combined(n, heads)
        if (token_aligned and _floating(n) and not set(_static_dims(n)) & widths
                and not patterns.is_call(n, _KEEP_APART_FUNCTIONS, {"cat"})):
            continue  # a number per row (a reduction, the values of a selection): no logits of a head any more
        carries[n] = heads
        if len(heads) > 1:
            stacked.add(n)
        for written in effects.mutated_inputs(n):  # ``za.add_(zb)``: za now holds both
            carries[written] = carries.get(written, frozenset()) | heads
            if len(carries[written]) > 1:
                stacked.add(written)
    return carries


def _static_dims(node: fx.Node) -> list[int]:
    """The static sizes of ``node``'s value (symbolic ones, rows with dynamic shapes, left out: unhashable)."""
    return [d for d in patterns.tensor_shape(node) or () if isinstance(d, int)]


def _floating(node: fx.Node) -> bool:
    value = patterns.example_value(node)
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _keeps_apart(n: fx.Node, inputs: list[fx.Node], carries: dict, stacked: set) -> bool:
    """``n`` reads values of several heads but combines no two of them element by element."""
    if n.op == "output":
        return True
    if patterns.is_call(n, _KEEP_APART_FUNCTIONS, {"cat"}):  # side by side, unless joined along the vocabulary axis
        return not _joins_vocabulary_axes(n) or all(u.op == "output" for u in n.users)
    if n.op == "call_function" and n.target in (tuple, list, operator.getitem) and not patterns.tensor_shape(n):
        return True  # a Python container, or an item of a multi-output op's result
    if n.op == "call_function" and n.target is operator.getitem and inputs == [n.args[0]] and inputs[0] in stacked:
        return True  # an index into a stacked value (``logits[0]``)
    if not all(a in stacked for a in inputs) or len({carries[a] for a in inputs}) != 1:
        return False  # two values each from their own head(s): combined
    if patterns.is_elementwise(n) or patterns.is_comparison(n) or vocab_views.is_reshape_or_permute(n):
        return True  # position by position on aligned stacked values (``stacked - lse``), or a view
    if len(inputs) != 1 or not n.args or n.args[0] is not inputs[0]:
        return False
    return _along_last_axis(n, inputs[0])


def _joins_vocabulary_axes(n: fx.Node) -> bool:
    """``torch.cat(values, -1)``: the result's last axis holds several heads' vocabularies, so anything along it
    (a logsumexp, a top-k) combines them."""
    if not (n.op == "call_function" and n.target in (torch.cat, torch.concat, torch.concatenate)
            or n.op == "call_method" and n.target == "cat"):
        return n.op == "call_function" and n.target is torch.hstack
    shape = patterns.tensor_shape(n)
    dim = call_arg(n, 1, "dim", 0)
    return shape is None or not isinstance(dim, int) or dim % len(shape) == len(shape) - 1


def _along_last_axis(n: fx.Node, x: fx.Node) -> bool:
    """``n`` runs along the last axis of ``x`` only (the vocabulary axis of stacked logits)."""
    shape = patterns.tensor_shape(x)
    if shape is None:
        return False
    if patterns.match_topk(n, x) is not None or patterns.match_argmax(n, x) is not None:
        return True
    name = node_name(n)
    if name not in _ALONG_DIM:
        return False
    dim = call_arg(n, 1, "dim")
    dims = dim if isinstance(dim, (tuple, list)) else (dim,)
    return all(isinstance(d, int) and d % len(shape) == len(shape) - 1 for d in dims) and len(shape) > 0
