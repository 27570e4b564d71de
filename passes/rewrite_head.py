"""Rewrite an LM head into nanospec ops: compact logits -> post-ops -> materialise [..., V].

Before::

    logits = linear(x, W, b)            # reads all V rows of W
    out = cap * tanh(logits / cap)

After::

    compact = nanospec.compact_logits(x, cache_w, cache_b, cursor)   # [..., C], C = capacity
    out_c = cap * tanh(compact / cap)                                # post-ops on compact logits
    out = nanospec.scatter_logits(out_c, ids, cursor, V)            # -inf for inactive tokens

The rewrite is a forward dataflow walk over the *vocabulary region* (every value computed from
the head's output, aliases included), in graph order; ``patterns.py`` states the rule that keeps
it sound. Each use of a compact value is one of:

* an exact compact op (post-op, cast, vocabulary-preserving view, in-place post-op): it runs on
  the compact tensor and its result stays in the region;
* a compact consumer (top-k / argmax, maybe behind softmax): it reads the compact logits and maps
  slots back to token ids;
* a materialisation point: a plain reader gets its own ``scatter_logits`` right before it (the
  value as of that point); a reader that writes the value, or whose result may alias it,
  materialises the value's whole alias class once, and every later use of any alias reads the
  materialised tensor (views replayed on it), so no mutation is lost and no reader is stale.

Every node inserted here gets ``example_value``/``val`` metadata (FakeTensors), so matchers that
run later (and other heads' rewrites) see correct shapes.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from nanospec_fx.kernels.schema import is_op, op_arg, op_call

from . import effects, heads_meet, patterns, projections, transforms, vocab_views
from .chain_walk import check_aliases, read_metadata, visit, visit_dense
from .contract import DenseFallback, RewriteReport, StateNodes
from .find_head import HeadMatch
from .grad_mode import stands_for
from .graph import describe, where
from .lora_delta import DELTA_OF, delta_steps, lora_deltas
from .patterns import set_example_value
from .region import Member, Region
from .row_weight import gathered_rows, row_weight
from .stacked_heads import compact_cursor, compact_stacked, match_stacked, to_head_layout


def rewrite_head(graph: fx.Graph, head: HeadMatch, state: StateNodes, capacity: int) -> RewriteReport:
    """Replace every projection of ``head`` in ``graph`` (in place) and return what was done."""
    report = RewriteReport(head.name, head.module_path, head.vocab_size, head.hidden_size, len(head.nodes), [], [], [])
    # read over this head's set (a stacked head takes none: another projection added to it is another head's logits)
    found = None if head.stacked else lora_deltas(graph, head.nodes, head.vocab_size, head.hidden_size)
    if found is not None and found.ambiguous:
        raise DenseFallback(next(iter(found.ambiguous.values())))
    deltas = {} if found is None else found.of
    own = [*head.nodes, *found.all()] if found is not None else list(head.nodes)
    for proj, bias in zip(head.nodes, head.biases):
        _rewrite_projection(graph, proj, bias, state, head.vocab_size, capacity, report, own, deltas.get(proj, []),
                            bool(head.stacked))
    return report


def _rewrite_projection(graph, proj, bias, state, vocab, capacity, report, own: list, deltas: list,
                        stacked_head: bool = False) -> None:
    stacked = match_stacked(proj) if stacked_head else None  # K heads of one weight: the same einsum over the cache
    x, w, _ = projections.match_projection(proj) if stacked is None else (stacked.x, stacked.weight, None)
    derived = _value_downstream(proj)
    foreign = _other_heads_logits(graph, own, state, vocab)
    cache_w, cache_b = state.cache_w, state.cache_b if bias is not None else None
    rows = row_weight(w, vocab) if w.op not in ("placeholder", "get_attr") else None
    if rows is not None:  # a weight computed row by row (quantised, parametrised): only the active rows
        with graph.inserting_before(proj):
            safe_ids = graph.call_function(torch.clamp, (state.ids,), {"min": 0})
            set_example_value(safe_ids)
            cache_w = gathered_rows(graph, rows, state.cache_w, safe_ids, state.ids)
    with graph.inserting_before(proj):
        x, cache_w, cache_b = _autocast_operands(graph, proj, x, cache_w, cache_b)
        if stacked is not None:
            compact = compact_stacked(graph, stacked, x, cache_w, state.cursor, capacity, set_example_value)
            head_layout = to_head_layout(graph, stacked, compact, set_example_value)  # V where the head had it
        else:
            x, cache_b = _scaled_operands(graph, proj, x, cache_b)
            compact = op_call(graph, "compact_logits", x=x, cache_w=cache_w, cache_b=cache_b, cursor=state.cursor)
    stands_for(compact, proj)
    logits = patterns.example_value(proj)  # the head's [..., V] output as Dynamo traced it (strides included)
    compact.meta.update(
        {k: v for k, v in proj.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
    set_example_value(compact)
    proj.replace_all_uses_with(head_layout if stacked is not None else compact)
    graph.erase_node(proj)

    region = Region(graph, state, vocab, compact)
    region.eager = {n: patterns.example_value(n) for n in graph.nodes} | {
        head_layout if stacked is not None else compact: logits}
    region.capacity = capacity
    region.transforms = transforms.transform_regions(graph)
    region.derived = derived | {compact}
    region.foreign = foreign
    region.members[compact] = Member(compact)
    roots = [compact] + [_compact_delta(region, d) for d in deltas]
    nodes = list(graph.nodes)
    erased: set[fx.Node] = set()
    for n in nodes[min(nodes.index(r) for r in roots) + 1:]:
        if n in roots:
            continue
        if n in erased:
            continue
        for a in list(n.all_input_nodes):  # uses of an already materialised class read its [..., V] tensor
            if a in region.members and region.members[a].root in region.materialised:
                n.replace_input_with(a, region.dense(a, n))
        metadata = patterns.metadata_operands(n)  # ``bias.type_as(z)``: z's dtype only, no value of the chain
        for a in metadata & set(region.members):
            read_metadata(region, n, a)
        values = [a for a in n.all_input_nodes if a not in metadata]
        check_aliases(region, n)
        chain_inputs = [a for a in values if a in region.members or a in region.dense_masks or a in region.side]
        # column by column from chain values only (z > 0), not after a reduction (z < z.max(-1, keepdim=True))
        reads_chain = bool(chain_inputs) and not any(a in region.derived and a not in chain_inputs for a in values)
        compact_inputs = [a for a in values if a in region.members]
        if n.op == "output" and (compact_inputs or any(a in region.dense_masks for a in values)):
            report.chain_outputs += 1
        if compact_inputs:
            visit(region, n, compact_inputs, capacity, report, erased)
        else:
            dense_inputs = [a for a in values if a in region.dense_masks]
            if dense_inputs and n in region.transforms:  # reads the materialised logits: ends the chain
                if set(effects.mutated_inputs(n)) & set(dense_inputs):
                    raise DenseFallback(f"{describe(n)} ({where(n)}) writes the logits inside "
                                        f"{region.transforms[n]}; write them outside the transform")
            elif dense_inputs:
                visit_dense(region, n, dense_inputs)
        if reads_chain and n not in erased and n not in region.members and n not in region.dense_masks and (
                patterns.is_comparison(n) or patterns.is_elementwise(n) or vocab_views.is_reshape_or_permute(n)):
            region.side.add(n)
    scatters = [u for u in compact.users if is_op(u, "scatter_logits")]
    if len(compact.users) == 1 and scatters and is_op(compact, "compact_logits"):
        _fuse_plain_head(graph, compact, scatters[0], vocab)


def _value_downstream(node: fx.Node) -> set[fx.Node]:
    """Every node whose value is computed from ``node``'s values (not only from its shape, dtype or device:
    ``bias.type_as(z)`` and ``torch.zeros_like(z)`` are not; ``patterns.metadata_operands``), in graph order: a value
    written into another tensor (``torch.tanh(z, out=buf)``, ``buf.copy_(z)``) makes that tensor, and what reads it
    later, computed from ``node`` too."""
    seen: set[fx.Node] = {node}
    started = False
    for user in node.graph.nodes:
        if user is node:
            started = True
            continue
        if not started:
            continue
        values = [a for a in user.all_input_nodes if a not in patterns.metadata_operands(user)]
        if any(a in seen for a in values if a not in effects.mutated_inputs(user)) or any(
                a in seen for a in effects.mutated_inputs(user) if a is user.args[0] and not user.kwargs.get("out")):
            seen.add(user)
            seen.update(effects.mutated_inputs(user))
    seen.discard(node)
    return seen


def _other_heads_logits(graph: fx.Graph, own: list, state: StateNodes, vocab: int) -> set[fx.Node]:
    """Nodes computed from the logits of a projection onto the vocabulary other than ``own`` (this head's, which
    read its state): another head, rewritten (its nanospec ops read another state) or not."""
    others = [n for n in graph.nodes if n not in own and (
        compact_cursor(n) not in (None, state.cursor)  # another rewritten head's compact logits (a stacked one too)
        or (projections.match_projection(n) is not None or match_stacked(n) is not None) and patterns.tensor_shape(n)
        and patterns.tensor_shape(n)[-1] == vocab and n.meta.get(DELTA_OF) is not state.cursor)]
    if not others:
        return set()
    sources = heads_meet.logits_sources(graph, [list(own), others])
    return {n for n, heads in sources.items() if 1 in heads}


def _fuse_plain_head(graph: fx.Graph, compact: fx.Node, scatter: fx.Node, vocab: int) -> None:
    """``scatter_logits(compact_logits(x))`` with nothing in between -> one ``head_logits`` op."""
    with graph.inserting_before(scatter):
        fused = op_call(graph, "head_logits", **{n: op_arg(compact, n) for n in ("x", "cache_w", "cache_b", "cursor")},
                        ids=op_arg(scatter, "ids"), vocab_size=vocab)
    stands_for(fused, compact)  # computed where the head ran (the scatter's place may be in another grad mode)
    set_example_value(fused)
    scatter.replace_all_uses_with(fused)
    graph.erase_node(scatter)
    graph.erase_node(compact)


def _compact_delta(region: Region, delta: fx.Node) -> fx.Node:
    """A LoRA delta's projection ``B(a)`` over the head's set: ``linear(a, B[ids], b[ids])`` ``[..., C]``, the rows of
    ``B`` (and of its bias) gathered at the head's slots on every call (``lora_delta``); a root of the region. It
    and its steps (``* scaling``) move right before the ``add`` onto the head's logits, after the head's
    ``compact_logits``: an observe placed before that reads the set for both (``snapshot_state_reads`` keeps both
    on one slot table)."""
    graph, state = region.graph, region.state
    match, path = projections.match_projection(delta), delta_steps(delta)
    if match is None or path is None:  # lora_deltas gives each delta to one projection: never met
        raise DenseFallback(f"the LoRA delta {describe(delta)} ({where(delta)}) changed before its head's rewrite")
    (a, w, b), (steps, add) = match, path
    with graph.inserting_before(add):
        ids = region.tag(graph.call_function(torch.clamp, (state.ids,), {"min": 0}))
        rows = [region.tag(graph.call_function(torch.index_select, (t, 0, ids))) if t is not None else None
                for t in (w, b)]
        compact = region.tag(graph.call_function(torch._C._nn.linear, (a, *rows)))
    compact.meta[DELTA_OF] = state.cursor  # this head's, whatever its width (not another head's logits)
    for n in (ids, *[r for r in rows if r is not None], compact):
        stands_for(n, delta)
        set_example_value(n)
    for r in rows:
        if r is not None:
            r.meta["nanospec_active_rows"] = True  # reads rows of the active set: no token lookup to observe
    region.eager[compact] = patterns.example_value(delta)
    delta.replace_all_uses_with(compact)
    graph.erase_node(delta)
    for step in steps:  # each reads only the one before it and numbers: valid anywhere before the add
        add.prepend(step)
    region.members[compact] = Member(compact)
    region.derived |= _value_downstream(compact) | {compact}
    return compact


def _scaled_operands(graph: fx.Graph, proj: fx.Node, x, cache_b):
    """``alpha * x`` and ``beta * cache_b`` for an ``addmm``/``baddbmm`` head (``alpha * (x @ W.t()) + beta * b``, the
    same values up to the rounding of one product); no bias when ``beta == 0`` (torch ignores it then)."""
    alpha, beta = projections.projection_scales(proj)
    if beta == 0:
        cache_b = None
    scaled = []
    for t, by in ((x, alpha), (cache_b, beta)):
        if t is not None and by != 1:
            t = stands_for(graph.call_function(operator.mul, (t, by)), proj)
            set_example_value(t)
        scaled.append(t)
    return tuple(scaled)


def _autocast_operands(graph: fx.Graph, proj: fx.Node, x, cache_w, cache_b):
    """Cast the compact GEMM's operands to the dtype the dense head computed in (autocast)."""
    out, x_val = patterns.example_value(proj), patterns.example_value(x)
    if not (isinstance(out, torch.Tensor) and isinstance(x_val, torch.Tensor)):
        return x, cache_w, cache_b
    w_val = patterns.example_value(cache_w)
    if out.dtype == x_val.dtype and (not isinstance(w_val, torch.Tensor) or w_val.dtype == out.dtype):
        return x, cache_w, cache_b
    cast = []
    for t in (x, cache_w, cache_b):
        if t is None:
            cast.append(None)
            continue
        node = graph.call_method("to", (t, out.dtype))
        set_example_value(node)
        cast.append(node)
    return tuple(cast)
