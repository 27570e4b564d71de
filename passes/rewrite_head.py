"""Rewrite an LM head into nanospec ops: compact logits -> post-ops -> scatter to [..., V].

Before::

    logits = linear(x, W, b)            # reads all V rows of W
    out = cap * tanh(logits / cap)

After::

    compact = nanospec.compact_logits(x, cache_w, cache_b, cursor)   # [..., C], C = capacity
    out_c = cap * tanh(compact / cap)                                # post-ops on compact logits
    out = nanospec.scatter_logits(out_c, ids, cursor, V)            # -inf for inactive tokens

Post-ops and vocab-preserving views (``patterns.py``) stay in compact space; V-sized operands
of post-ops (a bias of shape [V]) are gathered at the active ids. Wherever a compact value
leaves that region (a consumer, the graph output) one scatter brings it back to [..., V], so
every consumer sees exactly -inf at inactive tokens, after the post-ops.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from . import patterns
from .find_head import HeadMatch


@dataclass
class StateNodes:
    """Placeholders through which the compiled graph receives one ActiveVocab's tensors."""

    ids: fx.Node
    slot_of: fx.Node
    cursor: fx.Node
    cache_w: fx.Node
    cache_b: fx.Node


@dataclass
class RewriteReport:
    """What the rewrite did to one head (shown by ``nanospec_fx.explain``)."""

    head: str  # the weight's parameter name
    module_path: str | None
    vocab_size: int
    hidden_size: int
    projections: int
    post_ops: list[str]  # ops run on the compact logits
    exits: list[str]  # users that read the [..., V] logits (after one scatter)
    consumers: list[str]  # top-k / argmax (/ softmax) run on the compact logits
    observers: int = 0  # observe ops inserted on token-id inputs


def rewrite_head(graph: fx.Graph, head: HeadMatch, state: StateNodes, capacity: int) -> RewriteReport:
    """Replace every projection of ``head`` in ``graph`` (in place) and return what was done."""
    ops = torch.ops.nanospec
    vocab = head.vocab_size
    post_ops: list[str] = []
    exits: list[str] = []
    consumers: list[str] = []

    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(head.nodes, key=order.__getitem__)
    with graph.inserting_before(first):
        safe_ids = graph.call_function(torch.clamp, (state.ids,), {"min": 0})

    for proj, bias in zip(head.nodes, head.biases):
        x = patterns.match_projection(proj)[0]
        with graph.inserting_before(proj):
            compact = graph.call_function(ops.compact_logits.default, (x, state.cache_w, state.cache_b if bias is not None else None, state.cursor))
        compact.meta.update({k: v for k, v in proj.meta.items() if k in ("nn_module_stack", "stack_trace", "source_fn_stack")})
        proj.replace_all_uses_with(compact)
        graph.erase_node(proj)

        # Grow the compact region over post-ops and views, in graph order.
        region = {compact}
        leaving: list[tuple[fx.Node, fx.Node]] = []  # (compact node, user that needs [..., V])
        worklist = [compact]
        while worklist:
            node = worklist.pop(0)
            for user in list(node.users):
                if user in region:
                    continue
                if patterns.elementwise_operands_ok(user, node, vocab, region):
                    _gather_vocab_operands(graph, user, node, vocab, safe_ids)
                    region.add(user)
                    worklist.append(user)
                    post_ops.append(_describe(user))
                elif patterns.view_keeps_vocab(user, node, vocab):
                    _retarget_view(user, capacity)
                    region.add(user)
                    worklist.append(user)
                    post_ops.append(_describe(user))
                elif patterns.reads_row_size(user, node):
                    continue
                elif handled := _compact_consumer(graph, user, node, state):
                    consumers.extend(handled)
                else:
                    leaving.append((node, user))
                    exits.append(_describe(user))
        scattered = _insert_scatters(graph, leaving, region, state, vocab)
        _fuse_plain_head(graph, compact, scattered.get(compact), vocab)
    return RewriteReport(head.name, head.module_path, head.vocab_size, head.hidden_size, len(head.nodes), post_ops, exits, consumers)


def _insert_scatters(graph: fx.Graph, leaving: list, region: set, state: StateNodes, vocab: int) -> dict:
    """One ``scatter_logits`` per compact value, just before its first reader outside the region.

    With in-place post-ops (``z.div_(t)``) a value read at two places may differ between them,
    so then each reader gets its own scatter, placed right before it.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    in_place = any(n.op == "call_method" and n.target.endswith("_") for n in region)
    scattered: dict[fx.Node, fx.Node] = {}
    for node, user in sorted(leaving, key=lambda pair: order[pair[1]]):
        if in_place or node not in scattered:
            with graph.inserting_before(user):
                scattered[node] = graph.call_function(torch.ops.nanospec.scatter_logits.default, (node, state.ids, state.cursor, vocab))
        user.replace_input_with(node, scattered[node])
    return scattered


def _compact_consumer(graph: fx.Graph, user: fx.Node, logits: fx.Node, state: StateNodes) -> list[str]:
    """Run ``user`` (top-k / argmax, maybe behind a softmax) on the compact logits, if it is one;
    returns the names of the ops now running on compact logits (empty if none).

    Slots past the count may hold finite values after post-ops (tanh(-inf) is finite), so the
    softmax input is re-masked with ``ids >= 0`` (exactly the filled slots); top-k and argmax
    ignore such slots themselves.
    """
    ops = torch.ops.nanospec
    if patterns.match_softmax(user, logits):
        readers = list(user.users)
        if not readers or not all(patterns.match_topk(r, user) or patterns.match_argmax(r, user) is not None for r in readers):
            return []
        with graph.inserting_before(user):
            filled = graph.call_function(operator.ge, (state.ids, 0))
            masked = graph.call_function(torch.where, (filled, logits, float("-inf")))
        user.replace_input_with(logits, masked)
        return [_describe(user)] + [name for r in readers for name in _compact_consumer(graph, r, user, state)]
    topk = patterns.match_topk(user, logits)
    if topk is not None:
        k, largest = topk
        with graph.inserting_before(user):
            new = graph.call_function(ops.compact_topk.default, (logits, state.ids, state.cursor, k, largest))
    else:
        keepdim = patterns.match_argmax(user, logits)
        if keepdim is None:
            return []
        with graph.inserting_before(user):
            new = graph.call_function(ops.compact_argmax.default, (logits, state.ids, state.cursor))
            if keepdim:
                new = graph.call_function(torch.unsqueeze, (new, -1))
    name = _describe(user)
    user.replace_all_uses_with(new)
    graph.erase_node(user)
    return [name]


def _fuse_plain_head(graph: fx.Graph, compact: fx.Node, scatter: fx.Node | None, vocab: int) -> None:
    """``scatter_logits(compact_logits(x))`` with nothing in between -> one ``head_logits`` op."""
    if scatter is None or len(compact.users) != 1:
        return
    x, cache_w, cache_b, cursor = compact.args
    _, ids, _, _ = scatter.args
    with graph.inserting_before(scatter):
        fused = graph.call_function(torch.ops.nanospec.head_logits.default, (x, cache_w, cache_b, ids, cursor, vocab))
    scatter.replace_all_uses_with(fused)
    graph.erase_node(scatter)
    graph.erase_node(compact)


def _gather_vocab_operands(graph: fx.Graph, user: fx.Node, logits: fx.Node, vocab: int, safe_ids: fx.Node) -> None:
    """Make a post-op's V-sized operands compact: ``b`` -> ``b.index_select(-1, ids)``."""
    if user.op == "call_method" and user.target in ("type_as", "to"):
        return
    for arg in list(user.all_input_nodes):
        if arg is logits:
            continue
        shape = patterns.tensor_shape(arg)
        if shape and shape[-1] == vocab:
            with graph.inserting_before(user):
                gathered = graph.call_function(torch.index_select, (arg, -1, safe_ids))
            user.replace_input_with(arg, gathered)


def _retarget_view(user: fx.Node, capacity: int) -> None:
    """A ``view``/``reshape`` to [..., V] becomes one to [..., C]; the row dims are unchanged."""
    if user.op == "call_method" and user.target in ("view", "reshape"):
        dims = list(user.args[1:])
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = list(dims[0])
        dims[-1] = capacity
        user.args = (user.args[0], *dims)


def _describe(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
