"""Observe tokens inside the graph: the drafter's token-id inputs and the target's top-k.

* Inputs: every embedding lookup into a table with V rows (``F.embedding(ids, E)``, which every
  ``nn.Embedding`` becomes, and ``E[ids]``) gets ``nanospec.observe(ids, ...)`` just before it,
  so the prompt, the accepted and the drafted tokens are active before the head runs, with no
  user code. Position or type embeddings have other row counts and are skipped.
* Target top-k: after each of the target's head projections, ``topk(logits, k).indices`` are
  observed, so the tokens the target finds likely at every scored position become active.
  The target's own outputs do not change.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from . import patterns
from .rewrite_head import StateNodes


@dataclass
class ObserveInto:
    """Where observed tokens go: an ActiveVocab's tensors and the head they copy rows from."""

    weight: fx.Node
    bias: fx.Node | None
    state: StateNodes
    num_pinned: int
    vocab_size: int  # size of the token-id space observed
    token_to_row: fx.Node | None = None  # token id -> head row map (EAGLE-3 draft vocabularies)


def token_id_lookups(graph: fx.Graph, vocab_size: int) -> list[tuple[fx.Node, fx.Node]]:
    """``(lookup node, token-id node)`` for every embedding lookup into a [V, *] table."""
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in patterns.EMBEDDING_TARGETS:
            ids = node.kwargs.get("input", node.args[0] if node.args else None)
            table = node.kwargs.get("weight", node.args[1] if len(node.args) > 1 else None)
        elif node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], fx.Node):
            table, ids = node.args
        else:
            continue
        table_shape, ids_value = patterns.tensor_shape(table), patterns.example_value(ids)
        if not table_shape or len(table_shape) != 2 or table_shape[0] != vocab_size:
            continue
        if not isinstance(ids_value, torch.Tensor) or ids_value.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            continue
        if not _depends_on_user_input(ids):
            continue  # e.g. positions from torch.arange: a table that happens to have V rows
        found.append((node, ids))
    return found


def _depends_on_user_input(node: fx.Node) -> bool:
    """Whether ``node`` is computed from a graph input that is not a parameter or buffer."""
    seen, stack = set(), [node]
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        if cur.op == "placeholder":
            if not isinstance(patterns.example_value(cur), torch.nn.Parameter):
                return True
            continue
        stack.extend(cur.all_input_nodes)
    return False


def insert_observe(graph: fx.Graph, ids: fx.Node, into: ObserveInto) -> fx.Node:
    """Insert ``observe(ids)`` at the graph's current insertion point (mapping ids to rows if needed)."""
    rows = ids
    if into.token_to_row is not None:
        ok = graph.call_function(operator.and_, (graph.call_function(operator.ge, (ids, 0)), graph.call_function(operator.lt, (ids, into.vocab_size))))
        safe = graph.call_function(torch.clamp, (ids, 0, into.vocab_size - 1))
        mapped = graph.call_function(operator.getitem, (into.token_to_row, safe))
        rows = graph.call_function(torch.where, (ok, mapped, -1))
    s = into.state
    return graph.call_function(
        torch.ops.nanospec.observe.default,
        (rows, into.weight, into.bias, s.ids, s.slot_of, s.cursor, s.cache_w, s.cache_b, into.num_pinned),
    )


def insert_input_observers(graph: fx.Graph, into: ObserveInto) -> int:
    """Insert an observe op before each token-id lookup; returns how many were inserted."""
    lookups = token_id_lookups(graph, into.vocab_size)
    for lookup, ids in lookups:
        with graph.inserting_before(lookup):
            insert_observe(graph, ids, into)
    return len(lookups)


def insert_topk_observers(graph: fx.Graph, projections: list[fx.Node], k: int, into: ObserveInto,
                          observe_prompt: bool = False) -> int:
    """After each head projection, observe the top-k token ids at every scored position.

    With ``observe_prompt``, when the head reads a slice of the hidden states (transformers'
    ``hidden[:, -logits_to_keep:]``), the head is also applied to the positions the slice left out
    - the prompt at prefill - so their top-k is observed too. Nothing is left out at decode and
    verification steps, so that extra pass is empty there.
    """
    for proj in projections:
        with graph.inserting_before(proj.next):  # a fixed anchor keeps the new nodes in order
            scored = [proj]
            rest = _positions_left_out(graph, proj) if observe_prompt else None
            if rest is not None:
                x = patterns.match_projection(proj)[0]
                scored.append(graph.node_copy(proj, lambda n: rest if n is x else n))
            for logits in scored:
                topk = graph.call_function(torch.topk, (logits, k), {"dim": -1})
                indices = graph.call_function(operator.getitem, (topk, 1))
                insert_observe(graph, indices, into)
    return len(projections)


def _positions_left_out(graph: fx.Graph, proj: fx.Node) -> fx.Node | None:
    """For a head input ``h[:, start:]`` (last dim whole), a new node ``h[:, :start]``; else None."""
    x = patterns.match_projection(proj)[0]
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target is operator.getitem):
        return None
    h, index = x.args
    shape = patterns.tensor_shape(h)
    if shape is None or len(shape) < 2 or not patterns.view_keeps_vocab(x, h, shape[-1]):
        return None
    index = list(index) if isinstance(index, tuple) else [index]
    seq_dim = len(shape) - 2
    if len(index) <= seq_dim or any(i != slice(None) for i in index[:seq_dim]):
        return None
    cut = index[seq_dim]
    if not (isinstance(cut, slice) and cut.stop is None and cut.step is None and cut.start is not None):
        return None
    complement = index[:seq_dim] + [slice(None, cut.start, None)] + index[seq_dim + 1:]
    return graph.call_function(operator.getitem, (h, tuple(complement)))
