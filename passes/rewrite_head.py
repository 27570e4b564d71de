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
from dataclasses import dataclass

import torch
import torch.fx as fx

from nanospec_fx.kernels.schema import is_op, op_arg, op_call

from . import effects, heads_meet, patterns, transforms
from .contract import DenseFallback, RewriteReport, StateNodes
from .find_head import HeadMatch
from .grad_mode import stands_for
from .graph import describe, where
from .patterns import set_example_value
from .row_weight import gathered_rows, row_weight


@dataclass
class _Member:
    """A compact value: its alias root and how it derives from its parent (None for a root)."""

    root: fx.Node
    parent: fx.Node | None = None
    identity: bool = False  # same tensor as the parent (an in-place op's result, a no-op cast)


class _Region:
    """The compact part of one projection's vocabulary region while the walk runs."""

    def __init__(self, graph: fx.Graph, state: StateNodes, vocab: int, compact: fx.Node):
        self.graph, self.state, self.vocab, self.compact = graph, state, vocab, compact
        with graph.inserting_after(compact):
            self.safe_ids = self.tag(graph.call_function(torch.clamp, (state.ids,), {"min": 0}))
        set_example_value(self.safe_ids)
        self.members: dict[fx.Node, _Member] = {}
        self.original_args: dict[fx.Node, tuple] = {}  # views retargeted to C: their [..., V] arguments
        self.materialised: dict[fx.Node, dict[fx.Node, fx.Node]] = {}  # root -> {member: dense node}
        self.dense_masks: dict[fx.Node, Mask] = {}  # materialised chain value -> where its inactive tokens are
        self.derived: set[fx.Node] = set()  # every node computed from the head's output (before the rewrite)
        self.selections: set[fx.Node] = set()  # views selecting part of the vocabulary axis: no writes through them
        self.unknown: set[fx.Node] = set()  # results of unknown ops that may alias chain values
        self.side: set[fx.Node] = set()  # computed column by column from chain values, outside the chain (z > 0)
        # computed from another head's logits (``heads_meet``): never a chain operand
        self.foreign: set[fx.Node] = set()
        self.transforms: dict[fx.Node, str] = {}  # nodes inside torch.vmap & co (``transforms.transform_regions``)
        self.capacity = 0
        self._inactive: fx.Node | None = None
        self._mask_views: dict[tuple, fx.Node] = {}

    def mask_node(self, mask: "Mask", before: fx.Node) -> fx.Node:
        """Bool mask broadcastable to a value whose vocabulary axis has ``mask.trailing`` axes after it."""
        if not mask.trailing:
            return mask.base
        key = (mask.base, mask.trailing)
        if key not in self._mask_views:
            width = patterns.tensor_shape(mask.base)[-1]
            with self.graph.inserting_after(mask.base):
                node = self.graph.call_method("view", (mask.base, (width,) + (1,) * mask.trailing))
            set_example_value(node)
            self._mask_views[key] = node
        return self._mask_views[key]

    def tag(self, node: fx.Node) -> fx.Node:
        """Mark ``node`` as reading the slot table for this projection's compact logits: a later observe
        must not change what it reads (``observe_inputs.snapshot_state_reads``)."""
        node.meta["nanospec_compact"] = self.compact
        return node

    def inactive(self, before: fx.Node) -> fx.Node:
        """Bool [V]: True at inactive tokens (built once, before the first materialisation)."""
        if self._inactive is None:
            g, st = self.graph, self.state
            with g.inserting_before(before):
                zeros = g.call_method("new_zeros", (st.ids, (self.capacity,)), {"dtype": torch.float32})
                row = self.tag(op_call(g, "scatter_logits", compact=zeros, ids=st.ids, cursor=st.cursor,
                                       vocab_size=self.vocab))
                self._inactive = g.call_function(torch.isneginf, (row,))
            for n in (zeros, row, self._inactive):
                set_example_value(n)
        return self._inactive

    def scatter(self, value: fx.Node, before: fx.Node) -> fx.Node:
        with self.graph.inserting_before(before):
            node = self.tag(op_call(self.graph, "scatter_logits", compact=value, ids=self.state.ids,
                                    cursor=self.state.cursor, vocab_size=self.vocab))
        stands_for(node, value)  # the value where it was computed: in its grad mode, not its reader's
        set_example_value(node)
        return node

    def dense(self, member: fx.Node, before: fx.Node) -> fx.Node:
        """The [..., V] tensor of ``member``'s alias class (materialised once per class)."""
        info = self.members[member]
        done = self.materialised.setdefault(info.root, {})
        if member in done:
            return done[member]
        if info.parent is None:
            self.inactive(before)
            node = self.scatter(member, before)
        elif info.identity:
            node = self.dense(info.parent, before)
        else:  # replay the view on the dense parent, with its [..., V] arguments
            parent = self.dense(info.parent, before)
            args, kwargs = self.original_args.get(member, (member.args, member.kwargs))
            args, kwargs = fx.map_arg((args, kwargs), lambda a: parent if a is info.parent else a)
            with self.graph.inserting_before(before):
                node = stands_for(self.graph.create_node(member.op, member.target, args, kwargs), member)
            set_example_value(node)
        self.dense_masks[node] = Mask(self.inactive(before)) if info.parent is None \
            else self.dense_masks[self.dense(info.parent, before)]
        done[member] = node
        return node


@dataclass(frozen=True)
class Mask:
    """Where a materialised chain value's inactive tokens are: a bool ``[V']`` row (True = inactive)
    and how many axes follow the vocabulary axis in the value (0: it is the last axis)."""

    base: fx.Node
    trailing: int = 0


def rewrite_head(graph: fx.Graph, head: HeadMatch, state: StateNodes, capacity: int) -> RewriteReport:
    """Replace every projection of ``head`` in ``graph`` (in place) and return what was done."""
    report = RewriteReport(head.name, head.module_path, head.vocab_size, head.hidden_size, len(head.nodes), [], [], [])
    for proj, bias in zip(head.nodes, head.biases):
        _rewrite_projection(graph, proj, bias, state, head.vocab_size, capacity, report, head.nodes)
    return report


def _rewrite_projection(graph, proj, bias, state, vocab, capacity, report, own: list) -> None:
    x, w, _ = patterns.match_projection(proj)
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
        compact = op_call(graph, "compact_logits", x=x, cache_w=cache_w, cache_b=cache_b, cursor=state.cursor)
    stands_for(compact, proj)
    compact.meta.update(
        {k: v for k, v in proj.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
    set_example_value(compact)
    proj.replace_all_uses_with(compact)
    graph.erase_node(proj)

    region = _Region(graph, state, vocab, compact)
    region.capacity = capacity
    region.transforms = transforms.transform_regions(graph)
    region.derived = derived | {compact}
    region.foreign = foreign
    region.members[compact] = _Member(compact)
    nodes = list(graph.nodes)
    erased: set[fx.Node] = set()
    for n in nodes[nodes.index(compact) + 1:]:
        if n in erased:
            continue
        for a in list(n.all_input_nodes):  # uses of an already materialised class read its [..., V] tensor
            if a in region.members and region.members[a].root in region.materialised:
                n.replace_input_with(a, region.dense(a, n))
        _check_aliases(region, n)
        chain_inputs = [a for a in n.all_input_nodes if a in region.members or a in region.dense_masks
                        or a in region.side]
        # column by column from chain values only (z > 0), not after a reduction (z < z.max(-1, keepdim=True))
        reads_chain = bool(chain_inputs) and not any(a in region.derived and a not in chain_inputs
                                                     for a in n.all_input_nodes)
        compact_inputs = [a for a in n.all_input_nodes if a in region.members]
        if n.op == "output" and (compact_inputs or any(a in region.dense_masks for a in n.all_input_nodes)):
            report.chain_outputs += 1
        if compact_inputs:
            _visit(region, n, compact_inputs, capacity, report, erased)
        else:
            dense_inputs = [a for a in n.all_input_nodes if a in region.dense_masks]
            if dense_inputs and n in region.transforms:  # reads the materialised logits: ends the chain
                if set(effects.mutated_inputs(n)) & set(dense_inputs):
                    raise DenseFallback(f"{describe(n)} ({where(n)}) writes the logits inside "
                                        f"{region.transforms[n]}; write them outside the transform")
            elif dense_inputs:
                _visit_dense(region, n, dense_inputs)
        if reads_chain and n not in erased and n not in region.members and n not in region.dense_masks and (
                patterns.is_comparison(n) or patterns.is_elementwise(n) or patterns.is_reshape_or_permute(n)):
            region.side.add(n)
    scatters = [u for u in compact.users if is_op(u, "scatter_logits")]
    if len(compact.users) == 1 and scatters:
        _fuse_plain_head(graph, compact, scatters[0], vocab)


_METADATA_ONLY = {"empty_like", "zeros_like", "ones_like", "full_like", "new_empty", "new_zeros", "new_ones",
                  "new_full", "size", "dim", "numel", "sym_size", "sym_numel", "stride", "rand_like", "randn_like",
                  "randint_like"}


def _value_downstream(node: fx.Node) -> set[fx.Node]:
    """Every node whose value is computed from ``node``'s values (not only from its shape or dtype), in graph
    order: a value written into another tensor (``torch.tanh(z, out=buf)``, ``buf.copy_(z)``) makes that tensor,
    and what reads it later, computed from ``node`` too."""
    seen: set[fx.Node] = {node}
    started = False
    for user in node.graph.nodes:
        if user is node:
            started = True
            continue
        if not started or describe(user) in _METADATA_ONLY or (
                user.op == "call_function" and user.target is getattr and user.args[1] in ("shape", "dtype", "device")):
            continue
        if any(a in seen for a in user.all_input_nodes if a not in effects.mutated_inputs(user)) or any(
                a in seen for a in effects.mutated_inputs(user) if a is user.args[0] and not user.kwargs.get("out")):
            seen.add(user)
            seen.update(effects.mutated_inputs(user))
    seen.discard(node)
    return seen


def _chain_operands_ok(region: _Region, n: fx.Node, inputs: list, width: int, values: set) -> bool:
    """``n`` is a step of the logits chain: elementwise, and its other operands are not computed from
    the logits (``z - z.logsumexp(-1, keepdim=True)`` is a normalisation: it ends the chain)."""
    if not patterns.elementwise_operands_ok(n, inputs, width, values):
        return False
    out = n.kwargs.get("out")
    others = [a for a in n.all_input_nodes if a not in inputs and a is not out]
    side = next((a for a in others if a in region.side), None)
    if side is not None:
        raise DenseFallback(
            f"{describe(n)} ({where(n)}) combines the logits with {describe(side)} ({where(side)}), which is computed "
            "from the logits column by column but is no step nanospec runs compact (a comparison such as z > 0, or an "
            "op it does not know): it cannot prove what inactive tokens hold after it. Use masked_fill/clamp/where "
            "with a mask that does not depend on the logits")
    # another head's logits (its own active set, or dense): the chain ends here, whatever the op (heads_meet.py)
    return not any(a in region.derived or a in region.foreign for a in others)


def _other_heads_logits(graph: fx.Graph, own: list, state: StateNodes, vocab: int) -> set[fx.Node]:
    """Nodes computed from the logits of a projection onto the vocabulary other than ``own`` (this head's, which
    read its state): another head, rewritten (its nanospec ops read another state) or not."""
    others = [n for n in graph.nodes if n not in own and (
        (is_op(n, "compact_logits") or is_op(n, "head_logits")) and op_arg(n, "cursor") is not state.cursor
        or patterns.match_projection(n) is not None and patterns.tensor_shape(n)
        and patterns.tensor_shape(n)[-1] == vocab)]
    if not others:
        return set()
    sources = heads_meet.logits_sources(graph, [list(own), others])
    return {n for n, heads in sources.items() if 1 in heads}


def _check_aliases(region: _Region, n: fx.Node) -> None:
    """Uses of views of the logits that nanospec cannot map to the vocabulary axis.

    A selection of part of the vocabulary axis (``z[..., 5]``, ``z.narrow(-1, ...)``) ends the chain:
    reading it is plain arithmetic on the masked logits, but a write through it would change the
    logits themselves. The result of an op nanospec does not know that may alias the logits may be a
    column-keeping view (the chain goes on: later steps must keep inactive tokens at -inf) or not; a
    later elementwise step or write there cannot be proven either way.
    """
    selections = [a for a in n.all_input_nodes if a in region.selections]
    unknown = [a for a in n.all_input_nodes if a in region.unknown]
    if not (selections or unknown):
        return
    written = set(effects.mutated_inputs(n))
    if written & set(selections + unknown):
        raise DenseFallback(f"{describe(n)} ({where(n)}) writes through a view of the logits that does not keep the "
                            "vocabulary axis whole; write the logits themselves (z[..., ids] = v, masked_fill_)")
    if unknown and patterns.is_elementwise(n):
        origin = next(iter(unknown))
        raise DenseFallback(f"{describe(n)} ({where(n)}) is an elementwise step on the result of {describe(origin)} "
                            f"({where(origin)}), which may be a view of the logits nanospec cannot map to the "
                            "vocabulary axis; use a view it knows (view/reshape/flatten/transpose/permute/indexing)")
    if effects.may_alias_input(n):
        (region.unknown if unknown else region.selections).add(n)


def _visit(
    region: _Region, n: fx.Node, compact_inputs: list, capacity: int, report: RewriteReport, erased: set
) -> None:
    """Classify one use of compact values (see the module docstring) and rewrite it accordingly."""
    graph, vocab = region.graph, region.vocab
    a = compact_inputs[0]
    all_writes = effects.mutated_inputs(n)
    writes = [w for w in all_writes if w in region.members]
    if len(compact_inputs) == 1 and patterns.reads_row_size(n, a):
        return
    if n in region.transforms:  # a read inside torch.vmap & co: no compact op may run on its wrapped tensors
        return _exit(region, n, compact_inputs, writes, report)
    if len(writes) == len(all_writes) and _chain_operands_ok(region, n, compact_inputs, vocab, set(region.members)):
        _gather_vocab_operands(graph, n, set(region.members), vocab, region.safe_ids)
        target = writes[0] if writes else a
        if writes and (len(writes) > 1 or (n.args and n.args[0] is not target)):
            return _materialise(region, n, compact_inputs, report)
        if writes or _is_noop_cast(n, a):
            region.members[n] = _Member(region.members[target].root, target, identity=True)
        else:
            region.members[n] = _Member(n)
        set_example_value(n)
        report.post_ops.append(describe(n))
        return
    if not writes and len(compact_inputs) == 1 and patterns.view_keeps_vocab(n, a, vocab):
        region.original_args[n] = (n.args, n.kwargs)
        _retarget_view(n, capacity)
        region.members[n] = _Member(region.members[a].root, a)
        set_example_value(n)
        report.post_ops.append(describe(n))
        return
    if not writes and len(compact_inputs) == 1:
        handled = _compact_consumer(region, n, a, erased)
        if handled:
            report.consumers.extend(handled)
            return
    if patterns.is_write_like(n) and n.args[0] is a:  # ``z.scatter(-1, ban, -inf)``: a step, on [..., V]
        return _materialise(region, n, compact_inputs, report)
    _exit(region, n, compact_inputs, writes, report)


def _exit(region: _Region, n: fx.Node, compact_inputs: list, writes: list, report: RewriteReport) -> None:
    """``n`` ends the chain: it reads the materialised logits (its own scatter, or the alias class's when it
    writes them or may return an alias of them)."""
    if writes or effects.may_alias_input(n) and not _elementwise_into(n):
        _materialise(region, n, compact_inputs, report)
        return
    for c in compact_inputs:  # a plain reader: the value as of this point
        n.replace_input_with(c, region.scatter(c, n))
    report.exits.append(describe(n))
    if _elementwise_into(n) and _chain_operands_ok(region, n, [n.args[0]], region.vocab, set()):
        _region_written_out(region, n, Mask(region.inactive(n)))  # ``torch.tanh(z, out=buf)``: buf is in the chain


def _elementwise_into(n: fx.Node) -> bool:
    """An elementwise post-op writing its result into ``out=`` (another tensor)."""
    return isinstance(n.kwargs.get("out"), fx.Node) and patterns.is_elementwise(n)


def _region_written_out(region: _Region, n: fx.Node, mask: Mask) -> None:
    out = n.kwargs["out"]
    region.dense_masks[out] = mask
    _remask_after(region, n, [out])
    region.dense_masks[n] = mask


def _visit_dense(region: _Region, n: fx.Node, dense_inputs: list) -> None:
    """A use of a materialised chain value: the chain goes on on the [..., V] tensor.

    Inactive tokens are -inf after every step of the chain, as on the compact path: an elementwise
    step is followed by a re-mask (in place for an in-place op), a write into a chain value re-masks
    what it wrote, and views that keep the vocabulary axis whole (anywhere: transpose, flatten,
    permute, a vocabulary slice) carry the mask. Anything else reads the masked tensor and ends the
    chain there: what it computes is plain arithmetic, never re-masked.
    """
    graph = region.graph
    a = dense_inputs[0]
    mask = region.dense_masks[a]
    width = patterns.tensor_shape(mask.base)[-1]
    writes = [w for w in effects.mutated_inputs(n) if w in region.dense_masks]
    other_writes = [w for w in effects.mutated_inputs(n) if w not in region.dense_masks]
    aligned = all(region.dense_masks[d] == mask for d in dense_inputs)
    if not other_writes and aligned and _dense_operands_ok(region, n, dense_inputs, width, mask.trailing):
        if writes:
            _remask_after(region, n, writes)
            if effects.may_alias_input(n):
                region.dense_masks[n] = region.dense_masks[writes[0]]
            return
        with graph.inserting_after(n):
            remasked = graph.call_method("masked_fill", (n, region.mask_node(mask, n), float("-inf")))
        n.replace_all_uses_with(remasked, delete_user_cb=lambda u: u is not remasked)
        set_example_value(remasked)
        region.dense_masks[remasked] = mask
        return
    if not writes and not other_writes and n.args and n.args[0] is a and patterns.is_write_like(n):
        with graph.inserting_after(n):  # a ban written out of place: the chain goes on in its result
            remasked = graph.call_method("masked_fill", (n, region.mask_node(mask, n), float("-inf")))
        n.replace_all_uses_with(remasked, delete_user_cb=lambda u: u is not remasked)
        set_example_value(remasked)
        region.dense_masks[remasked] = mask
        return
    if _elementwise_into(n) and n.kwargs["out"] not in dense_inputs and len(dense_inputs) == 1 \
            and _chain_operands_ok(region, n, [a], width, set(region.dense_masks)):
        _region_written_out(region, n, mask)
        return
    if not writes and len(dense_inputs) == 1 and n.args and n.args[0] is a and patterns.tensor_shape(a):
        ndim = len(patterns.tensor_shape(a))
        axis = patterns.vocab_axis_after(n, a, ndim - 1 - mask.trailing)
        if axis is not None:
            region.dense_masks[n] = Mask(mask.base, len(patterns.tensor_shape(n)) - 1 - axis)
            return
        cut = _vocabulary_slice(n, a, width) if not mask.trailing else None
        if cut is not None:
            with graph.inserting_before(n):
                sliced = graph.call_function(operator.getitem, (mask.base, slice(None, cut)))
            set_example_value(sliced)
            region.dense_masks[n] = Mask(sliced)
            return
    if writes:
        _remask_after(region, n, writes)
    elif effects.may_alias_input(n) and isinstance(patterns.example_value(n), torch.Tensor):
        known_view = n.op in ("call_function", "call_method") and (
            patterns.is_call(n, patterns.RESHAPE_FUNCTIONS | patterns.PERMUTE_FUNCTIONS,
                             patterns.RESHAPE_METHODS | patterns.PERMUTE_METHODS
                             | {"narrow", "select", "split", "chunk", "unbind", "unfold", "diagonal"})
            or n.target in (operator.getitem, getattr))
        (region.selections if known_view else region.unknown).add(n)


def _dense_operands_ok(region: _Region, n: fx.Node, inputs: list, width: int, trailing: int) -> bool:
    """An elementwise chain step on [..., V] values whose vocabulary axis has ``trailing`` axes after it."""
    if not trailing:
        return _chain_operands_ok(region, n, inputs, width, set(region.dense_masks))
    if not patterns.is_elementwise(n):
        return False
    out = patterns.tensor_shape(n)
    for arg in n.all_input_nodes:
        if arg in inputs:
            continue
        if arg in region.derived:
            return False
        shape = patterns.tensor_shape(arg)
        if shape is None:
            continue  # a SymInt/SymFloat scalar
        if n.op == "call_method" and n.target in ("type_as", "to"):
            continue
        if len(shape) > trailing and shape[len(shape) - 1 - trailing] not in (1, width):
            return False
    return out is not None and len(out) > trailing and out[len(out) - 1 - trailing] == width


def _remask_after(region: _Region, n: fx.Node, written: list) -> None:
    anchor = n
    for w in written:
        with region.graph.inserting_after(anchor):
            anchor = region.graph.call_method("masked_fill_", (w, region.mask_node(region.dense_masks[w], anchor),
                                                               float("-inf")))
        set_example_value(anchor)


def _vocabulary_slice(n: fx.Node, logits: fx.Node, width: int) -> int | None:
    """V' when ``n`` is ``logits[..., :V']`` (rows untouched or basic-indexed), else None."""
    if not patterns.is_basic_indexing(n, logits):
        return None
    idx = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    shape = patterns.tensor_shape(logits)
    last = idx[-1]
    if (not isinstance(last, slice) or last.start not in (None, 0) or last.step not in (None, 1)
            or not isinstance(last.stop, int)):
        return None
    if Ellipsis not in idx and len(idx) != len(shape):
        return None
    stop = last.stop if last.stop >= 0 else width + last.stop
    return stop if 0 < stop <= width else None


def _materialise(region: _Region, n: fx.Node, compact_inputs: list, report: RewriteReport) -> None:
    """``n`` writes or aliases compact values: their classes become [..., V] tensors from here on."""
    for c in compact_inputs:
        n.replace_input_with(c, region.dense(c, n))
    # From here the use is one of a [..., V] chain value: column-keeping views carry the mask,
    # writes and elementwise steps are re-masked, anything else ends the chain.
    _visit_dense(region, n, [a for a in n.all_input_nodes if a in region.dense_masks])
    report.materialised.append(f"{describe(n)} ({where(n)})")
    report.exits.append(f"{describe(n)} (writes or aliases the logits: materialised there)")


def _is_noop_cast(n: fx.Node, a: fx.Node) -> bool:
    """A cast or ``contiguous`` that returns its input itself (same dtype): an alias, not a copy."""
    if not (n.op == "call_method" and n.target in patterns.CAST_METHODS):
        return False
    before, after = patterns.example_value(a), patterns.example_value(n)
    return isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.dtype == after.dtype


def _mask_unfilled(region: _Region, user: fx.Node, logits: fx.Node) -> None:
    """Make ``user`` read ``where(ids >= 0, logits, -inf)``: slots never filled weigh nothing."""
    graph = region.graph
    with graph.inserting_before(user):
        filled = region.tag(graph.call_function(operator.ge, (region.state.ids, 0)))
        masked = stands_for(graph.call_function(torch.where, (filled, logits, float("-inf"))), user)
    set_example_value(filled)
    set_example_value(masked)
    user.replace_input_with(logits, masked)


def _compact_consumer(region: _Region, user: fx.Node, logits: fx.Node, erased: set) -> list[str]:
    """Run ``user`` (top-k / argmax, maybe behind a log_softmax) on the compact logits, if it is one;
    returns the names of the ops now running on compact logits (empty if none).

    Slots past the count may hold finite values after post-ops (tanh(-inf) is finite), so a
    log_softmax input is re-masked with ``ids >= 0`` (exactly the filled slots); top-k and argmax
    ignore such slots themselves. Not behind a softmax: where k exceeds the active count, the compact
    top-k pads with -inf, but the probabilities of inactive tokens are 0.
    """
    graph, state = region.graph, region.state
    if patterns.match_log_softmax(user, logits):
        readers = list(user.users)
        if not readers or not all(_largest(patterns.match_topk(r, user)) or patterns.match_argmax(r, user) is not None
                                  for r in readers):
            return []
        _mask_unfilled(region, user, logits)
        set_example_value(user)
        names = [describe(user)]
        for r in readers:
            names += _compact_consumer(region, r, user, erased)
        return names
    topk = patterns.match_topk(user, logits)
    if _largest(topk):  # the k smallest are inactive tokens (-inf): read on the [..., V] logits
        k, largest = topk
        with graph.inserting_before(user):
            new = region.tag(op_call(graph, "compact_topk", compact=logits, ids=state.ids, cursor=state.cursor, k=k,
                                     largest=largest))
        stands_for(new, user)
        set_example_value(new)
    else:
        keepdim = patterns.match_argmax(user, logits)
        if keepdim is None:
            return []
        with graph.inserting_before(user):
            new = stands_for(region.tag(op_call(graph, "compact_argmax", compact=logits, ids=state.ids,
                                                cursor=state.cursor)), user)
            set_example_value(new)
            if keepdim:
                new = graph.call_function(torch.unsqueeze, (new, -1))
                set_example_value(new)
    name = describe(user)
    user.replace_all_uses_with(new)
    graph.erase_node(user)
    erased.add(user)
    return [name]


def _largest(topk: tuple | None) -> bool:
    return topk is not None and topk[1] is True


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


def _gather_vocab_operands(graph: fx.Graph, user: fx.Node, region: set, vocab: int, safe_ids: fx.Node) -> None:
    """Make a post-op's V-sized operands compact: ``b`` -> ``b.index_select(-1, ids)``."""
    if user.op == "call_method" and user.target in ("type_as", "to"):
        return
    for arg in list(user.all_input_nodes):
        if arg in region:
            continue
        shape = patterns.tensor_shape(arg)
        if shape and shape[-1] == vocab:
            with graph.inserting_before(user):
                gathered = graph.call_function(torch.index_select, (arg, -1, safe_ids))
            set_example_value(gathered)
            user.replace_input_with(arg, gathered)


def _retarget_view(user: fx.Node, capacity: int) -> None:
    """A ``view``/``reshape`` to [..., V] becomes one to [..., C]; the row dims are unchanged."""
    if user.op == "call_method" and user.target in ("view", "reshape"):
        dims = list(user.args[1:])
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = list(dims[0])
        dims[-1] = capacity
        user.args = (user.args[0], *dims)


