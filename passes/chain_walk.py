"""One step of the rewrite's walk over the vocabulary region: what a use of a chain value becomes.

A use of a compact value is an exact compact op (post-op, cast, vocabulary-keeping view, in-place post-op), a
compact consumer (:mod:`compact_consumers`), or a materialisation point; a use of a materialised value is a step
of the chain on that tensor (re-masked after every write and elementwise step) or the end of the chain. Anything
else the walk cannot classify raises ``DenseFallback`` with the reason: the head then stays dense. So does a chain step
whose other operand needs gradients (:func:`refuse_trainable_operands`).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from . import effects, patterns, vocab_views
from .compact_consumers import compact_consumer
from .contract import DenseFallback, RewriteReport
from .find_head import parameter_name
from .graph import describe, downstream, node_name, where
from .patterns import set_example_value
from .region import Mask, Member, Region


def _trainable_sources(node: fx.Node) -> str:
    """``, computed from temp_proj.weight, ...``: the graph inputs needing gradients that ``node`` is computed
    from, nearest first."""
    names, seen, frontier = [], {node}, [node]
    while frontier:
        frontier = [a for n in frontier for a in n.all_input_nodes if a not in seen and not seen.add(a)]
        names += [parameter_name(a) for a in frontier if a.op == "placeholder" and isinstance(
            v := patterns.example_value(a), torch.Tensor) and v.requires_grad]
    return f", computed from {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}" if names else ""


def _chain_operands_ok(region: Region, n: fx.Node, inputs: list, width: int, values: set) -> bool:
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
    if any(a in region.derived or a in region.foreign for a in others):
        return False
    refuse_trainable_operands(n, others)
    return True


def refuse_trainable_operands(n: fx.Node, others: list) -> None:
    """A chain step whose other operand needs gradients (a learned temperature ``z * exp(-log_t)``, ``z / t(h)``, a
    trainable soft-cap or logit bias) where autograd records it (``n``'s own value requires grad: grad mode is on
    there) raises ``DenseFallback``. Its gradient reads the logits (``mul``/``div``: ``sum(grad * z)``; an op after
    a trainable ``add`` may read them too), and the compact logits hold -inf at the slots no token uses, which
    autograd multiplies by their zero gradient: NaN in the operand and in every weight it is computed from, where
    eager's are finite. One simple rule for every op: the head runs dense."""
    value = patterns.example_value(n)
    if not (isinstance(value, torch.Tensor) and value.requires_grad):
        return
    metadata = patterns.metadata_operands(n)  # ``z.type_as(h)`` reads only ``h``'s dtype: no gradient reaches it
    for a in others:
        if a in metadata:
            continue
        operand = patterns.example_value(a)
        if isinstance(operand, torch.Tensor) and operand.requires_grad:
            name = parameter_name(a) if a.op == "placeholder" else f"{describe(a)} ({where(a)}{_trainable_sources(a)})"
            raise DenseFallback(
                f"{describe(n)} ({where(n)}) combines the logits with {name}, which needs gradients here (grad mode is "
                "on, and it is trainable or computed from trainable weights): its gradient would read the -inf the "
                "compact logits hold at unused slots (NaN). Detach it or freeze it (requires_grad_(False)) to have "
                "the head rewritten, or call the drafter under torch.no_grad()")


def check_aliases(region: Region, n: fx.Node) -> None:
    """Uses of views of the logits that nanospec cannot map to the vocabulary axis.

    A selection of part of the vocabulary axis (``z[..., 5]``, ``z.narrow(-1, ...)``) ends the chain:
    reading it is plain arithmetic on the masked logits, but a write through it would change the
    logits themselves. The result of an op nanospec does not know that may alias the logits may be a
    column-keeping view (the chain goes on: later steps must keep inactive tokens at -inf) or not; a
    later elementwise step or write there cannot be proven either way.
    """
    values = [a for a in n.all_input_nodes if a not in patterns.metadata_operands(n)]
    selections = [a for a in values if a in region.selections]
    unknown = [a for a in values if a in region.unknown]
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


def visit(
    region: Region, n: fx.Node, compact_inputs: list, capacity: int, report: RewriteReport, erased: set
) -> None:
    """Classify one use of compact values (see the module docstring) and rewrite it accordingly."""
    graph, vocab = region.graph, region.vocab
    a = compact_inputs[0]
    all_writes = effects.mutated_inputs(n)
    writes = [w for w in all_writes if w in region.members]
    if len(compact_inputs) == 1 and vocab_views.reads_row_size(n, a):
        return
    if n in region.transforms:  # a read inside torch.vmap & co: no compact op may run on its wrapped tensors
        return _exit(region, n, compact_inputs, writes, report)
    if len(writes) == len(all_writes) and _chain_operands_ok(region, n, compact_inputs, vocab, set(region.members)):
        _gather_vocab_operands(graph, n, set(region.members), vocab, region.safe_ids)
        target = writes[0] if writes else a
        if writes and (len(writes) > 1 or (n.args and n.args[0] is not target)):
            return _materialise(region, n, compact_inputs, report)
        set_example_value(n)
        if writes or _is_cast(n) and _returns_input(region, n, a):
            region.members[n] = Member(region.members[target].root, target, identity=True)
        else:
            region.members[n] = Member(n)
        report.post_ops.append(describe(n))
        return
    if not writes and len(compact_inputs) == 1 and vocab_views.view_keeps_vocab(n, a, vocab):
        region.original_args[n] = (n.args, n.kwargs)
        _retarget_view(n, capacity)
        set_example_value(n)
        # a view of its parent's class (replayed on the dense parent when the class is materialised), or, where eager
        # copied (``reshape`` of a layout no view has), a value of its own: a write to one never reaches the other
        region.members[n] = Member(region.members[a].root, a) if _returns_input(region, n, a) else Member(n)
        report.post_ops.append(describe(n))
        return
    if not writes and len(compact_inputs) == 1:
        handled = compact_consumer(region, n, a, erased)
        if handled:
            report.consumers.extend(handled)
            return
    if patterns.is_write_like(n) and n.args[0] is a:  # ``z.scatter(-1, ban, -inf)``: a step, on [..., V]
        return _materialise(region, n, compact_inputs, report)
    _exit(region, n, compact_inputs, writes, report)


def _exit(region: Region, n: fx.Node, compact_inputs: list, writes: list, report: RewriteReport) -> None:
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


def read_metadata(region: Region, n: fx.Node, a: fx.Node) -> None:
    """``n`` reads the compact value ``a`` for its dtype, device or shape only (``bias.type_as(z)``,
    ``torch.zeros_like(z)``, ``z.size(-1)``): no step of the chain, and its result is no chain value. The compact
    value has the logits' dtype, device and rows; a read of its width gets the [..., V] value as of this point."""
    if patterns.reads_shape(n) and not vocab_views.reads_row_size(n, a):
        n.replace_input_with(a, region.scatter(a, n))


def _elementwise_into(n: fx.Node) -> bool:
    """An elementwise post-op writing its result into ``out=`` (another tensor)."""
    return isinstance(n.kwargs.get("out"), fx.Node) and patterns.is_elementwise(n)


def _region_written_out(region: Region, n: fx.Node, mask: Mask) -> None:
    out = n.kwargs["out"]
    region.dense_masks[out] = mask
    _remask_after(region, n, [out])
    region.dense_masks[n] = mask


def visit_dense(region: Region, n: fx.Node, dense_inputs: list) -> None:
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
    if not writes and not other_writes and dense_inputs == [a] and n.args[0] is a and _is_cast(n) \
            and getattr(patterns.example_value(n), "is_floating_point", lambda: False)():
        region.dense_masks[n] = mask  # a copy or ``a`` itself, as in eager: -inf stays -inf in every floating dtype
        return
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
        axis = vocab_views.vocab_axis_after(n, a, ndim - 1 - mask.trailing)
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
            patterns.is_call(n, vocab_views.RESHAPE_FUNCTIONS | vocab_views.PERMUTE_FUNCTIONS,
                             vocab_views.RESHAPE_METHODS | vocab_views.PERMUTE_METHODS
                             | {"narrow", "select", "split", "chunk", "unbind", "unfold", "diagonal"})
            or n.target in (operator.getitem, getattr))
        (region.selections if known_view else region.unknown).add(n)


def _dense_operands_ok(region: Region, n: fx.Node, inputs: list, width: int, trailing: int) -> bool:
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
        if arg in patterns.metadata_operands(n):
            continue
        if len(shape) > trailing and shape[len(shape) - 1 - trailing] not in (1, width):
            return False
    if out is None or len(out) <= trailing or out[len(out) - 1 - trailing] != width:
        return False
    refuse_trainable_operands(n, [a for a in n.all_input_nodes if a not in inputs])
    return True


def _remask_after(region: Region, n: fx.Node, written: list) -> None:
    anchor = n
    for w in written:
        with region.graph.inserting_after(anchor):
            anchor = region.graph.call_method("masked_fill_", (w, region.mask_node(region.dense_masks[w], anchor),
                                                               float("-inf")))
        set_example_value(anchor)


def _vocabulary_slice(n: fx.Node, logits: fx.Node, width: int) -> int | None:
    """V' when ``n`` is ``logits[..., :V']`` (rows untouched or basic-indexed), else None."""
    if not vocab_views.is_basic_indexing(n, logits):
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


def _materialise(region: Region, n: fx.Node, compact_inputs: list, report: RewriteReport) -> None:
    """``n`` writes or aliases compact values: their classes become [..., V] tensors from here on."""
    for c in compact_inputs:
        n.replace_input_with(c, region.dense(c, n))
    # From here the use is one of a [..., V] chain value: column-keeping views carry the mask,
    # writes and elementwise steps are re-masked, anything else ends the chain.
    visit_dense(region, n, [a for a in n.all_input_nodes if a in region.dense_masks])
    report.materialised.append(f"{describe(n)} ({where(n)})")
    report.exits.append(f"{describe(n)} (writes or aliases the logits: materialised there)")


def _is_cast(n: fx.Node) -> bool:
    """A cast or ``contiguous``: its input itself or a copy of it (``patterns.CAST_METHODS``)."""
    return n.op == "call_method" and n.target in patterns.CAST_METHODS


# Ops that return their input (or a view of it) or a copy, as its layout allows: ``contiguous`` copies a
# non-contiguous tensor, ``reshape`` / ``flatten`` copy when no view has the shape, a cast copies when the dtype
# changes or ``copy=True``. The others the walk keeps in the chain (indexing, ``view``, squeeze) always return a view.
_VIEW_OR_COPY = {"contiguous", "reshape", "reshape_as", "flatten", "unflatten", *patterns.CAST_METHODS}


def _returns_input(region: Region, n: fx.Node, a: fx.Node) -> bool:
    """Whether ``n`` (a cast or view of the chain value ``a``, its compact value set) shares ``a``'s storage, as it
    did in eager: read from the values Dynamo traced (their strides are the eager tensors'), and then required of the
    compact values too where they are known, so that an in-place step on either reaches the other in both or in
    neither (the compact head's output is laid out as the head's, so they agree but at sizes of 1). Where eager
    copied, ``n`` is a value of its own (a write to it never reaches ``a``: ``z[:, -1].contiguous()`` banned)."""
    if node_name(n) not in _VIEW_OR_COPY:
        return True
    eager = _same_storage(region.eager.get(n), region.eager.get(a))
    compact = _same_storage(patterns.example_value(n), patterns.example_value(a))
    if eager is not None and compact not in (None, eager) and not _written(region, a):
        return eager  # nothing writes the logits' values in place: an alias and a copy cannot be told apart
    if eager is None or compact not in (None, eager):
        raise DenseFallback(
            f"{describe(n)} ({where(n)}) returns its input or a copy of it as the input's layout allows, and nanospec "
            "cannot prove that it does the same on the compact logits as on the logits "
            f"({'unknown' if eager is None else 'a copy' if not eager else 'the input'} in eager); use clone() for a "
            "copy, or view() for a view")
    return eager


def _written(region: Region, a: fx.Node) -> bool:
    """Whether any op of the graph may write in place a value computed from the logits ``a`` belongs to (a chain
    value, a view or a copy of one, anything read after them)."""
    root = region.members[a].root
    computed = downstream(root) | {root}
    return any(not computed.isdisjoint(effects.mutated_inputs(x)) for x in computed)


def _same_storage(x, y) -> bool | None:
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        return None
    try:
        return StorageWeakRef(x.untyped_storage()) == StorageWeakRef(y.untyped_storage())
    except Exception:  # noqa: BLE001 - a tensor with no storage to read (a functorch wrapper): unknown
        return None


def _gather_vocab_operands(graph: fx.Graph, user: fx.Node, region: set, vocab: int, safe_ids: fx.Node) -> None:
    """Make a post-op's V-sized operands compact: ``b`` -> ``b.index_select(-1, ids)`` (not one read for its dtype
    only: ``z.type_as(b)``)."""
    metadata = patterns.metadata_operands(user)
    for arg in list(user.all_input_nodes):
        if arg in region or arg in metadata:
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
