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

from nanospec_fx.kernels.schema import is_op, op_arg, op_call

from . import effects, patterns, transforms
from .rewrite_head import DenseFallback, StateNodes, describe, set_example_value, where


@dataclass
class ObserveInto:
    """Where observed tokens go: an ActiveVocab's tensors and the head they copy rows from."""

    weight: fx.Node
    bias: fx.Node | None
    state: StateNodes
    num_pinned: int
    vocab_size: int  # size of the token-id space observed
    token_to_row: fx.Node | None = None  # token id -> head row map (EAGLE-3 draft vocabularies)
    transposed: bool = False  # ``weight`` is stored [H, V] (``h @ W``): observers copy its columns
    #: the state is a vocabulary-parallel head's (tensor_parallel): a lookup into a ``V / tp``-row table at
    #: ``ids - start`` is its token embedding's shard, and ``ids`` are tokens (:func:`sharded_token_lookups`)
    sharded: bool = False


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


def _arg(node: fx.Node, index: int, name: str) -> object:
    return node.kwargs.get(name, node.args[index] if len(node.args) > index else None)


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
        return _arg(node, 0, "input"), _arg(node, 1, "weight"), _arg(node, 3, "max_norm") is not None
    if t is torch.embedding:
        return _arg(node, 1, "indices"), _arg(node, 0, "weight"), False
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
        dim, ids = _arg(node, 1, "dim") if dim is None else dim, _arg(node, 2, "index") if ids is None else ids
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
        name = cur.target if cur.op == "call_method" else getattr(cur.target, "__name__", None)
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
    params |= {n for n in graph.nodes if patterns.transposed_weight(n) in params}  # W.t() of a [H, V] head: W itself
    for node in graph.nodes:
        written = set(effects.mutated_inputs(node)) & params
        if written or any(lk.writes_table and lk.table in params for lk in _lookups_at(node)):
            return (f"{describe(node)} ({where(node)}) writes the head's weight in place (an embedding with max_norm "
                    "tied to the head renormalises the rows it looks up); untie them or drop max_norm")
    vocab = head.vocab_size
    lookups = {lk.node: lk for lk in table_lookups(graph)}
    lookups.update({n: lk for lk in list(lookups.values()) for n in one_hot_internals(lk.node)})
    logits = set(head.nodes).union(*(_downstream(p) for p in head.nodes))  # the head's outputs and what follows
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


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    seen, stack = set(), list(nodes)
    while stack:
        cur = stack.pop()
        if cur not in seen:
            seen.add(cur)
            stack.extend(cur.all_input_nodes)
    return seen


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
    """A table the ids could index: a parameter or buffer with V rows or more, or any tensor with an axis of
    exactly V (``torch.arange(V)`` compared with the ids: a one-hot written by hand). A mask or activation that
    merely has a long axis (a sequence as long as the vocabulary) is computed from integer data itself, or
    is not exactly V wide."""
    shape = patterns.tensor_shape(node)
    if not shape:
        return False
    if any(isinstance(d, int) and d == vocab for d in shape):
        return True
    source = node
    while source.op in ("call_function", "call_method") and patterns.is_reshape_or_permute(source) and source.args:
        source = source.args[0]
    weight_like = source.op == "get_attr" or (source.op == "placeholder" and (
        isinstance(patterns.example_value(source), torch.nn.Parameter) or "_buffers[" in patterns.source_name(source)))
    return weight_like and any(isinstance(d, int) and d >= vocab for d in shape)


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
    weight = into.weight
    if into.transposed:  # the head rows of a [H, V] weight: a view, made where the observer runs
        weight = graph.call_method("t", (into.weight,))
        set_example_value(weight)
    node = op_call(graph, "observe", token_ids=rows, weight=weight, bias=into.bias, ids=s.ids, slot_of=s.slot_of,
                   cursor=s.cursor, cache_w=s.cache_w, cache_b=s.cache_b, num_pinned=into.num_pinned)
    node.meta["val"] = node.meta["example_value"] = None  # returns nothing; writes the state
    return node


def insert_input_observers(graph: fx.Graph, into: ObserveInto) -> int:
    """Insert an observe op for each token-id lookup, as early as its ids exist; returns how many.

    Ids that exist before the head first reads the state (inputs, buffers, ids written in the code,
    anything computed from those) are observed before that read, so one call sees one state whatever
    the program order of embedding and head: their computation is copied before the read when the
    program computes them later (``DenseFallback`` if that copy could differ: random or written in
    between). Ids computed from the head's own output (a draft loop feeding its argmax back) are
    observed right after they are computed; :func:`snapshot_state_reads` keeps each head's later
    reads on the slot table it was computed with.

    The observes of ids that exist before the first read are transactional for the whole call
    (:func:`_all_lookups_valid`): they run together, after every lookup of the graph whose ids exist by
    then has been checked, and observe nothing unless all of those lookups can read all of their ids.
    """
    lookups = [lk for lk in token_id_lookups(graph, into.vocab_size)  # not the rewrite's own gathers at active ids
               if not lk.node.meta.get("nanospec_active_rows")]
    if into.sharded:  # a vocabulary-parallel embedding's shard: on one device such a table is no token lookup
        lookups += [lk for lk in sharded_token_lookups(graph, into.vocab_size)
                    if not lk.node.meta.get("nanospec_active_rows")]
    reads = _state_reads(graph, into.state)
    first_read = reads[0] if reads else None
    after_read = set(reads).union(*(_downstream(r) for r in reads))  # computed from what a head returned
    regions = transforms.transform_regions(graph)
    before: list[tuple[fx.Node, fx.Node]] = []  # (ids, where they may be observed) of ids that exist before a read
    for lk in lookups:
        ids = lk.ids
        if isinstance(ids, fx.Node) and ids in regions:  # inside torch.vmap & co: observe the unbatched ids
            ids = transforms.outside_value(ids, regions)
            if ids is None:
                raise DenseFallback(
                    f"the ids looked up at {where(lk.node)} are computed inside {regions[lk.ids]}, where nanospec "
                    "cannot observe them (its ops have no rule for the transform's batched tensors); compute the ids "
                    "outside the transform, or compile with options={'observe_inputs': False} and feed the set with "
                    "nanospec_fx.active_vocab(model).observe(ids)")
        if not isinstance(ids, fx.Node):  # ids written in the code (``E[3]``, ``E[[1, 2]]``)
            with graph.inserting_before(first_read if first_read is not None else lk.node):
                ids = graph.call_function(torch.tensor, (ids,), {"dtype": torch.int64})
            set_example_value(ids)
        at = _earliest_after(graph, ids, lk.node)
        order = {n: i for i, n in enumerate(graph.nodes)}
        if first_read is not None and order[at] > order[first_read] and ids not in after_read:
            ids = _copy_before(graph, ids, first_read, lk.node)
            at = first_read
        if into.sharded:  # its observe is a collective rewritten per rank (tensor_parallel.shard_observers)
            with graph.inserting_before(at):
                insert_observe(graph, ids, into)
        elif ids in after_read:  # a draft loop's fed-back ids: after the first read, committed on their own
            with graph.inserting_before(at):
                insert_observe(graph, _only_if_looked_up(graph, ids, lk)[0], into)
        else:
            before.append((ids, at, lk))
    if before:
        _observe_together(graph, before, into, first_read, after_read, regions)
    return len(lookups)


def _observe_together(graph: fx.Graph, found: list, into: ObserveInto, first_read: fx.Node | None, after_read: set,
                      regions: dict) -> None:
    """Observe every ``(ids, at, lookup)`` at one point (the first read of the set, else the latest ``at``): each
    ``ids`` kept (a fresh tensor) at its own ``at``, and all of them only if every lookup checked by
    :func:`_all_lookups_valid` reads only rows its table has."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    kept, flags = [], []
    for ids, at, lk in found:
        with graph.inserting_before(at):
            ids, ok = _only_if_looked_up(graph, ids, lk)
        kept.append(ids)
        flags.append(ok)
    common = first_read if first_read is not None else max((at for _, at, _ in found), key=order.__getitem__)
    flags += _all_lookups_valid(graph, common, after_read, regions, {lk.node for *_, lk in found})
    with graph.inserting_before(common):
        ok = flags[0]
        for flag in flags[1:]:
            ok = graph.call_function(torch.logical_and, (ok, flag))
            set_example_value(ok)
        for ids in kept:
            if len(flags) > 1:
                ids = graph.call_function(torch.where, (ok, ids, -1))
                set_example_value(ids)
            insert_observe(graph, ids, into)


def _all_lookups_valid(graph: fx.Graph, common: fx.Node, after_read: set, regions: dict,
                       checked: set) -> list[fx.Node]:
    """0-d bool nodes, each inserted where a lookup's ids exist (before ``common``): that lookup reads only rows its
    table has. Every lookup of the graph not in ``checked`` (any table: token, position, type embeddings) whose ids
    exist, with the values it reads, before ``common``.

    A call that raises on one of them then observes nothing, whatever the order of its lookups: the call's lookups
    are one transaction. Not checked: lookups whose ids are computed after ``common`` (after the first read of the
    set: a draft loop's fed-back ids, checked by their own observe only) or inside ``torch.vmap`` & co."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    flags = []
    for lk in table_lookups(graph):
        ids = lk.ids
        if lk.node in checked or lk.node.meta.get("nanospec_active_rows") or not isinstance(ids, fx.Node) \
                or ids in after_read or ids in regions or lk.node in regions:
            continue
        point = _earliest_after(graph, ids, lk.node)  # the lookup itself when something writes the ids before it
        if order[point] > order[common]:
            continue
        with graph.inserting_before(point):
            flags.append(_valid(graph, ids, lk))
    return flags


def _valid(graph: fx.Graph, ids: fx.Node, lk: Lookup) -> fx.Node:
    """A 0-d bool node: every one of ``ids`` is a row the lookup can read (on the device: no sync)."""
    low = -lk.rows if lk.node.target is operator.getitem else 0  # ``E[ids]`` reads E[-1] too
    ge = graph.call_function(torch.ge, (ids, low))
    lt = graph.call_function(torch.lt, (ids, lk.rows))
    both = graph.call_function(torch.logical_and, (ge, lt))
    ok = graph.call_function(torch.all, (both,))
    for n in (ge, lt, both, ok):
        set_example_value(n)
    return ok


def _only_if_looked_up(graph: fx.Graph, ids: fx.Node, lk: Lookup) -> tuple[fx.Node, fx.Node]:
    """``(kept, ok)``: ``kept`` is ``ids`` (a fresh int64 tensor) when every one of them is a row the lookup can read
    (``ok``), else all -1 (the observe op skips them): a call whose lookup raises on an id (-1 padding, an id past
    the table) then leaves the set as it was, instead of having observed its valid ids first. On the device, no
    sync: a reduction and a select."""
    ok = _valid(graph, ids, lk)
    wide = graph.call_method("to", (ids, torch.int64))
    kept = graph.call_function(torch.where, (ok, wide, -1))
    for n in (wide, kept):
        set_example_value(n)
    return kept, ok


def _state_reads(graph: fx.Graph, state: StateNodes) -> list[fx.Node]:
    """The nodes that read the active set for a head (not observes), in graph order."""
    placeholders = {state.ids, state.slot_of, state.cursor, state.cache_w, state.cache_b}
    return [n for n in graph.nodes if n.op in ("call_function", "call_method")
            and not is_op(n, "observe") and any(a in placeholders for a in n.all_input_nodes)]


_RANDOM = ("rand", "bernoulli", "multinomial", "normal", "uniform", "dropout", "exponential", "poisson", "cauchy")


def _copy_before(graph: fx.Graph, ids: fx.Node, before: fx.Node, lookup: fx.Node) -> fx.Node:
    """A copy of ``ids``' computation placed before ``before`` (the first read of the state)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    late = sorted((n for n in _ancestors([ids]) if order[n] >= order[before]), key=order.__getitem__)
    inputs = _ancestors([ids])
    for n in late:
        name = describe(n).lower()
        if (n.op not in ("call_function", "call_method") or effects.has_side_effect(n)
                or any(r in name for r in _RANDOM)):
            raise DenseFallback(f"the ids looked up at {where(lookup)} are computed after the head reads the active "
                                f"set, by {describe(n)} ({where(n)}), which cannot be moved before it; look the "
                                "ids up before the head")
    nodes = list(graph.nodes)
    for n in nodes[order[before]:order[lookup]]:
        if set(effects.mutated_inputs(n)) & inputs:
            raise DenseFallback(f"the ids looked up at {where(lookup)} are written by {describe(n)} ({where(n)}) "
                                "after the head reads the active set; look the ids up before the head")
    copies: dict[fx.Node, fx.Node] = {}
    with graph.inserting_before(before):
        for n in late:
            copies[n] = graph.node_copy(n, lambda a: copies.get(a, a))
            set_example_value(copies[n])
    return copies[ids]


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


def snapshot_state_reads(graph: fx.Graph, state: StateNodes, grad: bool = False) -> int:
    """Keep each projection's reads of the slot table consistent across observes.

    ``compact_logits`` fixes which slot holds which token; every later read made for the same
    compact logits (``scatter_logits``, ``compact_topk``/``compact_argmax``, the inactive-token mask,
    the ids that gather [V] operands: each tagged with its ``compact_logits`` by the rewrite) must map
    slots with that table. When an observe (which may evict and refill slots) runs in between, those
    reads get a copy of ``ids``/``cursor`` taken right before ``compact_logits``. Each projection has
    its own copy: a draft loop inside ``forward`` reads, at step k, the set as it is at step k.
    With ``grad`` (autograd records the head), ``compact_logits`` also reads a copy of the cached rows:
    its backward needs them as they were, and a later observe writes them in place.
    Returns how many snapshots.
    """
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    observes = [pos[n] for n in nodes if is_op(n, "observe")]
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        compact = n.meta.get("nanospec_compact")
        if compact in pos and op_arg(compact, "cursor") is state.cursor and (state.ids in n.all_input_nodes
                                                                    or state.cursor in n.all_input_nodes):
            groups.setdefault(compact, []).append(n)
    taken = 0
    for compact, reads in groups.items():
        last = max(pos[r] for r in reads)
        if not any(pos[compact] < o < last for o in observes):
            continue
        with graph.inserting_before(compact):
            ids = graph.call_method("clone", (state.ids,))
            cursor = graph.call_method("clone", (state.cursor,))
        set_example_value(ids)
        set_example_value(cursor)
        for r in reads:
            r.replace_input_with(state.ids, ids)
            r.replace_input_with(state.cursor, cursor)
        if grad:
            compact.replace_input_with(state.cursor, cursor)
            for cached in (op_arg(compact, "cache_w"), op_arg(compact, "cache_b")):
                if isinstance(cached, fx.Node):
                    with graph.inserting_before(compact):
                        copy = graph.call_method("clone", (cached,))
                    set_example_value(copy)
                    compact.replace_input_with(cached, copy)
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
