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

import torch
import torch.fx as fx

from nanospec_fx.kernels.schema import is_op, op_arg, op_call

from . import effects, patterns, projections, transforms, vocab_views
from .contract import DenseFallback, ObserveInto, StateNodes
from .graph import ancestors, describe, downstream, precedes, where
from .lookups import Lookup, sharded_token_lookups, table_lookups, token_id_lookups
from .patterns import set_example_value
from .stacked_heads import compact_cursor, stacked_parts


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
    elif into.stacked:  # the K rows of each token of a stacked weight: its [V, K, H] view
        weight = graph.call_method("permute", (into.weight, *into.stacked))
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
    after_read = set(reads).union(*(downstream(r) for r in reads))  # computed from what a head returned
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
        if first_read is not None and precedes(first_read, at) and ids not in after_read:
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
    ``ids`` kept (a fresh tensor) at its own ``at``, all of them in one observe (flattened, in lookup order), and
    only if every lookup checked by :func:`_all_lookups_valid` reads only rows its table has."""
    kept, flags = [], []
    for ids, at, lk in found:
        with graph.inserting_before(at):
            ids, ok = _only_if_looked_up(graph, ids, lk)
        kept.append(ids)
        flags.append(ok)
    common = first_read if first_read is not None else max(at for _, at, _ in found)  # the latest, by graph order
    flags += _all_lookups_valid(graph, common, after_read, regions, {lk.node for *_, lk in found})
    with graph.inserting_before(common):
        ok = flags[0]
        for flag in flags[1:]:
            ok = graph.call_function(torch.logical_and, (ok, flag))
            set_example_value(ok)
        if len(kept) > 1:  # one observe of all of them, in lookup order: a token fed by one lookup is then never
            # evicted by another's new tokens (the ring renews the call's tokens within one observe only)
            flat = []
            for ids in kept:
                ids = graph.call_function(torch.reshape, (ids, (-1,)))
                set_example_value(ids)
                ids = graph.call_method("to", (ids, torch.int64))
                set_example_value(ids)
                flat.append(ids)
            kept = [graph.call_function(torch.cat, (flat,))]
            set_example_value(kept[0])
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
    flags = []
    for lk in table_lookups(graph):  # each check goes in at its lookup's ids: the graph grows as the loop runs
        ids = lk.ids
        if lk.node in checked or lk.node.meta.get("nanospec_active_rows") or not isinstance(ids, fx.Node) \
                or ids in after_read or ids in regions or lk.node in regions:
            continue
        point = _earliest_after(graph, ids, lk.node)  # the lookup itself when something writes the ids before it
        if precedes(common, point):
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
    late = sorted(n for n in ancestors([ids]) if not precedes(n, before))  # FX nodes sort in graph order
    inputs = ancestors([ids])
    for n in late:
        name = describe(n).lower()
        if (n.op not in ("call_function", "call_method") or effects.has_side_effect(n)
                or any(r in name for r in _RANDOM)):
            raise DenseFallback(f"the ids looked up at {where(lookup)} are computed after the head reads the active "
                                f"set, by {describe(n)} ({where(n)}), which cannot be moved before it; look the "
                                "ids up before the head")
    for n in _between(before, lookup):
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
    aliases = {ids}
    for n in _between(ids.next, lookup):
        if any(w in aliases for w in effects.mutated_inputs(n)):
            return lookup
        if effects.may_alias_input(n) and any(a in aliases for a in n.all_input_nodes):
            aliases.add(n)
    return next((n for n in _between(ids.next, None) if n.op != "placeholder"), lookup)


def _between(first: fx.Node, end: fx.Node | None):
    """The nodes from ``first`` up to (not including) ``end`` (the graph's end when None), walked as the graph is
    now: nodes inserted while the caller edits the graph are met too."""
    node = first
    while node is not end and node.op != "root":
        yield node
        node = node.next


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
    present = set(nodes)
    observes = [n for n in nodes if is_op(n, "observe")]
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        compact = n.meta.get("nanospec_compact")
        if compact in present and compact_cursor(compact) is state.cursor and (
                state.ids in n.all_input_nodes or state.cursor in n.all_input_nodes):
            groups.setdefault(compact, []).append(n)
    taken = 0
    for compact, reads in groups.items():
        last = max(reads)  # the latest, by graph order (the clones inserted below do not move it)
        if not any(precedes(compact, o) and precedes(o, last) for o in observes):
            continue
        parts = stacked_parts(compact)  # a stacked head's compact logits: an einsum over the cache, then a mask
        with graph.inserting_before(parts[0] if parts else compact):
            ids = graph.call_method("clone", (state.ids,))
            cursor = graph.call_method("clone", (state.cursor,))
        set_example_value(ids)
        set_example_value(cursor)
        for r in reads:
            r.replace_input_with(state.ids, ids)
            r.replace_input_with(state.cursor, cursor)
        if grad and parts:
            for part in parts:
                part.replace_input_with(state.cursor, cursor)
            einsum = next(p for p in parts if p.target is torch.einsum)
            with graph.inserting_before(einsum):
                copy = graph.call_method("clone", (einsum.args[2],))
            set_example_value(copy)
            einsum.replace_input_with(einsum.args[2], copy)
        elif grad:
            compact.replace_input_with(state.cursor, cursor)
            for cached in (op_arg(compact, "cache_w"), op_arg(compact, "cache_b")):
                if isinstance(cached, fx.Node):
                    with graph.inserting_before(compact):
                        copy = graph.call_method("clone", (cached,))
                    set_example_value(copy)
                    compact.replace_input_with(cached, copy)
        taken += 1
    return taken


def insert_topk_observers(graph: fx.Graph, head_nodes: list[fx.Node], k: int, into: ObserveInto,
                          observe_prompt: bool = False) -> int:
    """After each head projection, observe the top-k token ids at every scored position.

    With ``observe_prompt``, when the head reads a slice of the hidden states (transformers'
    ``hidden[:, -logits_to_keep:]``), the head is also applied to the positions the slice left out
    - the prompt at prefill - so their top-k is observed too. Nothing is left out at decode and
    verification steps, so that extra pass is empty there.
    """
    for proj in head_nodes:
        with graph.inserting_before(proj.next):  # a fixed anchor keeps the new nodes in order
            scored = [proj]
            rest = _positions_left_out(graph, proj) if observe_prompt else None
            if rest is not None:
                x = projections.match_projection(proj)[0]
                scored.append(graph.node_copy(proj, lambda n: rest if n is x else n))
                set_example_value(scored[-1])
            for logits in scored:
                topk = graph.call_function(torch.topk, (logits, k), {"dim": -1})
                indices = graph.call_function(operator.getitem, (topk, 1))
                set_example_value(topk)
                set_example_value(indices)
                insert_observe(graph, indices, into)
    return len(head_nodes)


def _positions_left_out(graph: fx.Graph, proj: fx.Node) -> fx.Node | None:
    """For a head input ``h[:, start:]`` (last dim whole), a new node ``h[:, :start]``; else None."""
    x = projections.match_projection(proj)[0]
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target is operator.getitem):
        return None
    h, index = x.args
    shape = patterns.tensor_shape(h)
    if shape is None or len(shape) < 2 or not vocab_views.view_keeps_vocab(x, h, shape[-1]):
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
