"""Observe the drafter's token-id inputs: every id it embeds joins the active vocabulary.

Matches embedding lookups into a table with V rows (``F.embedding(ids, E)``, which every
``nn.Embedding`` becomes, and ``E[ids]``) and inserts ``nanospec.observe(ids, ...)`` just
before each, so the prompt, the accepted and the drafted tokens are active before the head
runs, with no user code. Position or type embeddings have other row counts and are skipped.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from . import patterns
from .find_head import HeadMatch
from .rewrite_head import StateNodes


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
        found.append((node, ids))
    return found


def insert_observers(graph: fx.Graph, head: HeadMatch, state: StateNodes, num_pinned: int, bias: fx.Node | None) -> int:
    """Insert an observe op before each token-id lookup; returns how many were inserted."""
    lookups = token_id_lookups(graph, head.vocab_size)
    for lookup, ids in lookups:
        with graph.inserting_before(lookup):
            graph.call_function(
                torch.ops.nanospec.observe.default,
                (ids, head.weight, bias, state.ids, state.slot_of, state.cursor, state.cache_w, state.cache_b, num_pinned),
            )
    return len(lookups)
