"""Which rows of which tables a graph reads by integer ids: the lookup analysis the head search (a table's
vocabulary) and the observers (the ids to observe, and lookups they cannot read) build on.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from . import effects, patterns, projections, vocab_views
from .graph import call_arg, describe, downstream, node_name, where


@dataclass
class Lookup:
    """A read of rows of a 2-D table by integer ids: what the pass observes for a head."""

    node: fx.Node  # the lookup
    ids: fx.Node | list  # integer tensor (or Python ints) whose values are the rows read
    table: fx.Node
    rows: int
    writes_table: bool = False  # ``max_norm``: the lookup renormalises the rows it reads, in place


INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
ONE_HOT = {torch.nn.functional.one_hot, torch._C._nn.one_hot}


def _is_int_tensor(node: object) -> bool:
    value = patterns.example_value(node)
    return isinstance(value, torch.Tensor) and value.dtype in INT_DTYPES


def _match_lookup(node: fx.Node) -> tuple | None:
    """``(ids, table, writes_table)`` when ``node`` reads rows of a 2-D table by integer ids.

    Recognised: ``F.embedding`` (``nn.Embedding``), ``torch.embedding``, ``F.embedding_bag``, ``E[ids]``,
    ``E[3]``/``E[[1, 2]]`` (ids written in the code), ``index_select`` and ``gather`` on dim 0, and a
    one-hot matmul ``F.one_hot(ids, V).float() @ E``.
    """
    if node.op not in ("call_function", "call_method"):
        return None
    t = node.target
    if t in (torch.nn.functional.embedding, torch.nn.functional.embedding_bag):
        return call_arg(node, 0, "input"), call_arg(node, 1, "weight"), call_arg(node, 3, "max_norm") is not None
    if t is torch.embedding:
        return call_arg(node, 1, "indices"), call_arg(node, 0, "weight"), False
    if t is operator.getitem and node.args:
        table, index = node.args
        first = index[0] if isinstance(index, tuple) and index else index
        rest = index[1:] if isinstance(index, tuple) else ()
        if not all(r == slice(None) for r in rest):
            return None
        if isinstance(first, int) and not isinstance(first, bool):
            return [first], table, False
        if isinstance(first, list) and first and all(isinstance(i, int) and not isinstance(i, bool) for i in first):
            return list(first), table, False
        if isinstance(first, fx.Node) and _is_int_tensor(first):
            return first, table, False
        return None
    if patterns.is_call(node, {torch.index_select, torch.gather}, {"index_select", "gather"}):
        table, dim, ids = (node.args + (None, None, None))[:3]
        dim, ids = call_arg(node, 1, "dim") if dim is None else dim, call_arg(node, 2, "index") if ids is None else ids
        if dim in (0, -2) and isinstance(ids, fx.Node) and _is_int_tensor(ids):
            return ids, table, False
        return None
    if (patterns.is_call(node, patterns.MATMUL_TARGETS | {torch.mm}, {"matmul", "mm", "__matmul__"})
            and len(node.args) == 2):
        lhs, table = node.args
        while isinstance(lhs, fx.Node) and lhs.op == "call_method" and lhs.target in patterns.CAST_METHODS:
            lhs = lhs.args[0]
        if isinstance(lhs, fx.Node) and lhs.op == "call_function" and lhs.target in ONE_HOT:
            return lhs.args[0], table, False
    return None


def one_hot_internals(lookup: fx.Node) -> list[fx.Node]:
    """The one-hot tensor and its casts between a one-hot lookup's ids and its matmul."""
    found, lhs = [], lookup.args[0] if lookup.args else None
    while isinstance(lhs, fx.Node) and lhs.op in ("call_method", "call_function") and (
            lhs.target in patterns.CAST_METHODS or lhs.target in ONE_HOT):
        found.append(lhs)
        if lhs.target in ONE_HOT:
            break
        lhs = lhs.args[0]
    return found if found and found[-1].target in ONE_HOT else []


def table_lookups(graph: fx.Graph) -> list[Lookup]:
    """Every read of rows of a 2-D table (static row count) by integer ids, whatever their source:
    inputs, buffers, or ids written in the code."""
    found = []
    for node in graph.nodes:
        match = _match_lookup(node)
        if match is None:
            continue
        ids, table, writes = match
        shape = patterns.tensor_shape(table)
        if not isinstance(table, fx.Node) or not shape or len(shape) != 2 or not isinstance(shape[0], int):
            continue
        if isinstance(ids, fx.Node) and not _is_int_tensor(ids):
            continue
        found.append(Lookup(node, ids, table, shape[0], writes))
    return found


def embedding_lookups(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node, fx.Node, int]]:
    """``(lookup, ids, table, rows)`` of the token lookups: ids that are data (a user input, a buffer) or
    written in the code, not positions (head finding uses the tables' rows as the vocabulary size)."""
    return [(lk.node, lk.ids, lk.table, lk.rows) for lk in table_lookups(graph) if not _positions(lk.ids)]


_SELECTIONS = {torch.topk, torch.argmax, torch.argsort, torch.sort, torch.max, torch.multinomial}
_SELECTION_METHODS = {"topk", "argmax", "argsort", "sort", "max", "multinomial"}


def rows_chosen_in_graph(graph: fx.Graph) -> list[tuple[Lookup, fx.Node]]:
    """``(lookup, selection)`` for each read of a token table's rows (a table the graph also looks fed ids up in) at
    ids the graph chose from scores (``selection``: a top-k, argmax, sort or sampling among their ancestors): a head
    whose rows are chosen in the graph (Gemma-4's centroid head: the tied table's rows of the top clusters), which no
    projection shows. Ids a draft loop feeds back after a head nanospec found are chosen the same way; callers ask
    only when no head was found."""
    lookups = table_lookups(graph)
    tables = {lk.table for lk in lookups if not _positions(lk.ids) and not _chosen_by(lk.ids)}
    found = []
    for lk in lookups:
        selection = _chosen_by(lk.ids) if lk.table in tables else None
        if selection is not None:
            found.append((lk, selection))
    return found


def _chosen_by(ids) -> fx.Node | None:
    """The selection (top-k, argmax, ...) ``ids`` are computed from, if any."""
    if not isinstance(ids, fx.Node):
        return None
    seen, stack = set(), [ids]
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        if patterns.is_call(cur, _SELECTIONS, _SELECTION_METHODS):
            return cur
        stack.extend(cur.all_input_nodes)
    return None


def token_id_lookups(graph: fx.Graph, vocab_size: int) -> list[Lookup]:
    """The lookups whose ids are token ids of a V-token vocabulary: every table with V rows or more
    (a padded table too; the observe op ignores ids outside [0, V)). Observing a lookup that is not
    the token embedding only adds tokens to the set, which never makes a result wrong."""
    return [lk for lk in table_lookups(graph) if lk.rows >= vocab_size and not _positions(lk.ids)]


def sharded_token_lookups(graph: fx.Graph, vocab_size: int) -> list[Lookup]:
    """The lookups of a vocabulary-parallel token embedding (Megatron's ``VocabParallelEmbedding``): a table of
    ``V / tp`` rows read at ``ids - start`` (out-of-shard entries masked to a constant), its rows zeroed outside
    the shard and summed over the ranks. Each rank reads only its own ids, but the tokens fed are the ORIGINAL
    ``ids``, the same on every rank: the returned lookups carry those (observing them is exact whatever the mask
    and the all-reduce do, since observing a token never makes a result wrong)."""
    found = []
    for lk in table_lookups(graph):
        if not (0 < lk.rows < vocab_size and vocab_size % lk.rows == 0) or not isinstance(lk.ids, fx.Node):
            continue
        tokens = _offset_ids(lk.ids)
        if tokens is not None and not _positions(tokens):
            found.append(Lookup(lk.node, tokens, lk.table, vocab_size))
    return found


def _offset_ids(ids: fx.Node) -> fx.Node | None:
    """X when ``ids`` is ``X - start`` (an int or a one-element integer tensor), maybe with some entries replaced
    by a constant first or after (``torch.where(mask, 0, x)``, ``masked_fill``, ``clamp``, ``x[mask] = 0``)."""
    cur = ids
    for _ in range(8):
        if not isinstance(cur, fx.Node) or cur.op not in ("call_function", "call_method"):
            return None
        name = node_name(cur)
        args = cur.args
        if name == "where" and len(args) == 3:
            tensors = [a for a in args[1:] if isinstance(a, fx.Node) and _is_int_tensor(a) and not _scalar(a)]
            if len(tensors) != 1:
                return None
            cur = tensors[0]
        elif name in ("masked_fill", "masked_fill_", "clamp", "clamp_", "clip") and args:
            cur = args[0]
        elif name in ("sub", "__sub__") or cur.target is operator.sub:
            x, offset = args[0], args[1] if len(args) > 1 else None
            return x if _is_int_tensor(x) and (_scalar(offset) or isinstance(offset, int)) else None
        elif name in ("add", "__add__") or cur.target is operator.add:
            x, offset = args[0], args[1] if len(args) > 1 else None
            if not _is_int_tensor(x) or _scalar(x):
                x, offset = offset, x
            return x if _is_int_tensor(x) and (_scalar(offset) or isinstance(offset, int)) else None
        else:
            return None
    return None


def _scalar(node: object) -> bool:
    """A one-element integer tensor (a ``start`` buffer)."""
    value = patterns.example_value(node)
    return isinstance(node, fx.Node) and isinstance(value, torch.Tensor) and value.numel() == 1 \
        and value.dtype in INT_DTYPES


def _positions(ids) -> bool:
    """Ids computed only from ``torch.arange`` and sizes (no tensor data, no id written in the code):
    positions, not tokens (a position table may happen to have V rows)."""
    if not isinstance(ids, fx.Node):
        return False
    seen, stack, arange = set(), [ids], False
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        value = patterns.example_value(cur)
        if cur.op == "placeholder":
            if isinstance(value, torch.Tensor):
                return False  # tensor data (an input or a buffer)
            continue
        if cur.op == "call_function" and cur.target is torch.arange:
            arange = True
        elif cur.op == "call_function" and cur.target in (torch.tensor, torch.as_tensor, torch.full, torch.ones,
                                                          torch.zeros):
            return False  # ids written in the code
        if cur is not ids and not isinstance(value, torch.Tensor):
            continue  # a size: not data
        stack.extend(cur.all_input_nodes)
    return arange


def unobserved_lookup(graph: fx.Graph, head) -> str | None:
    """Why the ids this graph feeds ``head`` cannot all be observed before it reads the set, or None.

    * the graph writes the head's weight or bias in place (an ``nn.Embedding(max_norm=...)`` tied to
      the head renormalises the rows it looks up, after the observer copied them);
    * an op anywhere in the graph reads a vocabulary-sized table ([>= V, ...]) by integer data and is not
      a recognised lookup (``torch.take``, a lookup inside ``torch.cond``, a custom op...), or mixes
      integer data with a tensor as wide as the vocabulary (a hand-written one-hot): its ids cannot
      be read, so they would not join the set.
    """
    params = {head.weight, *(b for b in head.biases if b is not None)}
    params |= {n for n in graph.nodes if projections.transposed_weight(n) in params}  # W.t() of a [H, V] head: W itself
    for node in graph.nodes:
        written = set(effects.mutated_inputs(node)) & params
        if written and effects.unknown_call(node):
            return (f"{describe(node)} ({where(node)}) receives the head's weight and is a call nanospec cannot see "
                    "into (no op schema: a function allowed in the graph, a module or higher-order call), so it may "
                    "write the weight in place after the active rows were cached. Call it outside the compiled "
                    "function, or pass it something other than the head's weight")
        if written or any(lk.writes_table and lk.table in params for lk in _lookups_at(node)):
            return (f"{describe(node)} ({where(node)}) writes the head's weight in place (an embedding with max_norm "
                    "tied to the head renormalises the rows it looks up); untie them or drop max_norm")
    vocab = head.vocab_size
    lookups = {lk.node: lk for lk in table_lookups(graph)}
    lookups.update({n: lk for lk in list(lookups.values()) for n in one_hot_internals(lk.node)})
    logits = set(head.nodes).union(*(downstream(p) for p in head.nodes))  # the head's outputs and what follows
    integer = _integer_data(graph, lookups)
    for node in graph.nodes:
        if node in lookups or node.op not in ("call_function", "call_method", "call_module"):
            continue
        mixes = any(a in integer for a in node.all_input_nodes) and any(
            a not in integer and a not in logits and _vocabulary_wide(a, vocab) for a in node.all_input_nodes)
        if mixes or _soft_lookup(node, vocab):
            return (f"{describe(node)} ({where(node)}) reads integer data and a tensor as wide as the vocabulary "
                    "but is not a lookup nanospec can observe (nn.Embedding, F.embedding, E[ids], index_select, "
                    "gather, embedding_bag, a one-hot matmul), so the ids it reads would not join the active set. "
                    "Use one of those lookups, or compile with options={'observe_inputs': False} and feed the set "
                    "with nanospec_fx.active_vocab(model).observe(ids)")
    return None


def _lookups_at(node: fx.Node) -> list[Lookup]:
    match = _match_lookup(node)
    if match is None:
        return []
    ids, table, writes = match
    return [Lookup(node, ids, table, -1, writes)] if isinstance(table, fx.Node) else []


def _integer_data(graph: fx.Graph, lookups: dict) -> set[fx.Node]:
    """Integer and bool tensors (ids, masks and what is computed from them while it stays integer), except
    the results of recognised lookups. Floats computed from integers (rotary angles from positions) are
    not ids."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if node in lookups:
            continue
        value = patterns.example_value(node)
        if isinstance(value, torch.Tensor) and (value.dtype in INT_DTYPES or value.dtype == torch.bool):
            found.add(node)
    return found


def _soft_lookup(node: fx.Node, vocab: int) -> bool:
    """``x @ E`` contracting a vocabulary table's rows (a one-hot or a mixture of rows built by hand): which
    rows it reads depends on values nanospec cannot see."""
    if not (patterns.is_call(node, patterns.MATMUL_TARGETS | {torch.mm, torch.bmm},
                             {"matmul", "mm", "bmm", "__matmul__"})
            and len(node.args) == 2):
        return False
    table = node.args[1]
    shape = patterns.tensor_shape(table)
    return isinstance(table, fx.Node) and bool(shape) and len(shape) == 2 and _vocabulary_wide(table, vocab) \
        and isinstance(shape[0], int) and shape[0] >= vocab


def _vocabulary_wide(node: fx.Node, vocab: int) -> bool:
    """A table the ids could index: a tensor the model holds (``patterns.is_weight_like``: a parameter, buffer or
    plain tensor attribute) with V rows or more, or any tensor with an axis of exactly V (``torch.arange(V)``
    compared with the ids: a one-hot written by hand). A mask or activation that merely has a long axis (a sequence
    as long as the vocabulary) is computed from integer data itself, or is not exactly V wide."""
    shape = patterns.tensor_shape(node)
    if not shape:
        return False
    if any(isinstance(d, int) and d == vocab for d in shape):
        return True
    source = node
    while source.op in ("call_function", "call_method") and vocab_views.is_reshape_or_permute(source) and source.args:
        source = source.args[0]
    return patterns.is_weight_like(source, patterns.example_value(source)) and any(
        isinstance(d, int) and d >= vocab for d in shape)
