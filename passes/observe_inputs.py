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

from . import effects, patterns
from .rewrite_head import StateNodes, set_example_value


@dataclass
class ObserveInto:
    """Where observed tokens go: an ActiveVocab's tensors and the head they copy rows from."""

    weight: fx.Node
    bias: fx.Node | None
    state: StateNodes
    num_pinned: int
    vocab_size: int  # size of the token-id space observed
    token_to_row: fx.Node | None = None  # token id -> head row map (EAGLE-3 draft vocabularies)


def embedding_lookups(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node, fx.Node, int]]:
    """``(lookup, token-id node, table, rows)`` for every lookup of integer ids computed from a
    user input (``F.embedding(ids, E)``, ``E[ids]``) into a 2-D table."""
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
        if not table_shape or len(table_shape) != 2 or not isinstance(table_shape[0], int):
            continue
        if not isinstance(ids_value, torch.Tensor) or ids_value.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            continue
        if not _depends_on_user_input(ids):
            continue  # e.g. positions from torch.arange: a table that happens to have V rows
        found.append((node, ids, table, table_shape[0]))
    return found


def token_id_lookups(graph: fx.Graph, vocab_size: int) -> list[tuple[fx.Node, fx.Node]]:
    """``(lookup node, token-id node)`` for every token embedding lookup of a V-token vocabulary:
    tables with V rows, or, when there is none, the smallest padded table (more than V rows;
    the observe op ignores ids outside [0, V))."""
    lookups = embedding_lookups(graph)
    exact = [(n, ids) for n, ids, _, rows in lookups if rows == vocab_size]
    if exact:
        return exact
    padded = [rows for *_, rows in lookups if rows > vocab_size]
    return [(n, ids) for n, ids, _, rows in lookups if padded and rows == min(padded)]


def _depends_on_user_input(node: fx.Node) -> bool:
    """Whether ``node``'s *values* are computed from a graph input that is not a parameter or buffer.

    Only tensor data counts: a size read from an input (``torch.arange(ids.shape[-1])`` with
    dynamic shapes) is a number, so positions never look like token ids.
    """
    seen, stack = set(), [node]
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        if cur.op == "placeholder":
            value = patterns.example_value(cur)
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                    and "_buffers[" not in _source(cur):
                return True
            continue
        if cur is not node and not isinstance(patterns.example_value(cur), torch.Tensor):
            continue  # a number (a shape, a size): not data of the input
        stack.extend(cur.all_input_nodes)
    return False


def _source(node: fx.Node) -> str:
    from .find_head import parameter_name_raw

    return parameter_name_raw(node)


def insert_observe(graph: fx.Graph, ids: fx.Node, into: ObserveInto) -> fx.Node:
    """Insert ``observe(ids)`` at the graph's current insertion point (mapping ids to rows if needed)."""
    rows = ids
    if into.token_to_row is not None:
        ge = graph.call_function(operator.ge, (ids, 0))
        lt = graph.call_function(operator.lt, (ids, into.vocab_size))
        ok = graph.call_function(operator.and_, (ge, lt))
        safe = graph.call_function(torch.clamp, (ids, 0, into.vocab_size - 1))
        mapped = graph.call_function(operator.getitem, (into.token_to_row, safe))
        rows = graph.call_function(torch.where, (ok, mapped, -1))
        for n in (ge, lt, ok, safe, mapped, rows):
            set_example_value(n)
    s = into.state
    node = graph.call_function(
        torch.ops.nanospec.observe.default,
        (rows, into.weight, into.bias, s.ids, s.slot_of, s.cursor, s.cache_w, s.cache_b, into.num_pinned),
    )
    node.meta["val"] = node.meta["example_value"] = None  # returns nothing; writes the state
    return node


def insert_input_observers(graph: fx.Graph, into: ObserveInto) -> int:
    """Insert an observe op for each token-id lookup, as early as its ids exist; returns how many.

    Observing early (before the head, when the ids are graph inputs) means one call sees one
    state: the tokens fed to this call are active for every head evaluated in it, whatever the
    program order of embedding and head. Where the ids are computed after a head read the state
    (a tree drafter embedding its own top-k), :func:`snapshot_state_reads` keeps that head's
    later reads on the slot table it was computed with.
    """
    lookups = token_id_lookups(graph, into.vocab_size)
    for lookup, ids in lookups:
        with graph.inserting_before(_earliest_after(graph, ids, lookup)):
            insert_observe(graph, ids, into)
    return len(lookups)


def _earliest_after(graph: fx.Graph, ids: fx.Node, lookup: fx.Node) -> fx.Node:
    """The first node after ``ids`` and after every placeholder (where a use of ``ids`` can go);
    ``lookup`` itself when something writes the ids in between (``ids.clamp_(...)``)."""
    nodes = list(graph.nodes)
    start = max(nodes.index(ids), max((i for i, n in enumerate(nodes) if n.op == "placeholder"), default=-1))
    aliases = {ids}
    for n in nodes[nodes.index(ids) + 1:nodes.index(lookup)]:
        if any(w in aliases for w in effects.mutated_inputs(n)):
            return lookup
        if effects.may_alias_input(n) and any(a in aliases for a in n.all_input_nodes):
            aliases.add(n)
    for n in nodes[start + 1:]:
        if n.op != "placeholder":
            return n
    return lookup


def snapshot_state_reads(graph: fx.Graph, state: StateNodes) -> int:
    """Keep each projection's reads of the slot table consistent across observes.

    ``compact_logits`` fixes which slot holds which token; a later ``scatter_logits``,
    ``compact_topk`` or ``compact_argmax`` of the same values must map slots with that table.
    When an observe (which may evict and refill slots) runs in between, those readers get a copy
    of ``ids``/``cursor`` taken right before ``compact_logits``. Returns how many snapshots.
    """
    ops = torch.ops.nanospec
    readers = {ops.scatter_logits.default, ops.compact_topk.default, ops.compact_argmax.default}
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    observes = [pos[n] for n in nodes if n.op == "call_function" and n.target is ops.observe.default]
    taken = 0
    for node in nodes:
        if not (node.op == "call_function" and node.target is ops.compact_logits.default and node.args[3] is state.cursor):
            continue
        later = _state_readers_of(node, readers)
        if not any(pos[node] < o < max((pos[r] for r in later), default=-1) for o in observes):
            continue
        with graph.inserting_before(node):
            ids = graph.call_method("clone", (state.ids,))
            cursor = graph.call_method("clone", (state.cursor,))
        set_example_value(ids)
        set_example_value(cursor)
        downstream = _downstream(node)
        for r in later:
            r.replace_input_with(state.ids, ids)
            r.replace_input_with(state.cursor, cursor)
        for n in nodes:  # gathers of [V] post-op operands and re-masks read the ids too
            if n.op == "call_function" and n.target in (torch.clamp, operator.ge) and n.args[0] is state.ids:
                for user in list(n.users):
                    if any(u in downstream for u in user.users) or user in downstream:
                        with graph.inserting_before(user):
                            copy = graph.node_copy(n, lambda a: ids if a is state.ids else a)
                        user.replace_input_with(n, copy)
        taken += 1
    return taken


def _downstream(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def _state_readers_of(compact: fx.Node, readers: set) -> list[fx.Node]:
    return [n for n in _downstream(compact) if n.op == "call_function" and n.target in readers]


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
                set_example_value(scored[-1])
            for logits in scored:
                topk = graph.call_function(torch.topk, (logits, k), {"dim": -1})
                indices = graph.call_function(operator.getitem, (topk, 1))
                set_example_value(topk)
                set_example_value(indices)
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
    node = graph.call_function(operator.getitem, (h, tuple(complement)))
    set_example_value(node)
    return node
