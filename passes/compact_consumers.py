"""Consumers that read the compact logits directly: top-k and argmax over the vocabulary axis (behind
``log_softmax`` or not), mapping slots back to token ids, so the ``[..., V]`` logits are never built for them.

How EAGLE and tree drafters pick candidates. A consumer in any other form is a materialisation point
(:mod:`chain_walk`): exact either way, this one only skips the fill.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from nanospec_fx.kernels.schema import op_call

from . import patterns
from .grad_mode import stands_for
from .graph import describe
from .patterns import set_example_value
from .region import Region


def _mask_unfilled(region: Region, user: fx.Node, logits: fx.Node) -> None:
    """Make ``user`` read ``where(ids >= 0, logits, -inf)``: slots never filled weigh nothing."""
    graph = region.graph
    with graph.inserting_before(user):
        filled = region.tag(graph.call_function(operator.ge, (region.state.ids, 0)))
        masked = stands_for(graph.call_function(torch.where, (filled, logits, float("-inf"))), user)
    set_example_value(filled)
    set_example_value(masked)
    user.replace_input_with(logits, masked)


def _unfilled_already_inf(region: Region, user: fx.Node, logits: fx.Node) -> bool:
    """Whether ``user`` reads the projection's ``compact_logits`` as the op returned them, maybe cast to a floating
    dtype, with nothing else reading them (so nothing wrote them in place, ``clamp_``): every implementation returns
    -inf past the count, and the slots past the count are exactly those never filled (``ids < 0``: insertion k first
    fills slot k), so re-masking them would change nothing."""
    node, reader = logits, user
    while True:
        if list(node.users) != [reader]:
            return False
        if node is region.compact:
            return True
        if not (node.op == "call_method" and node.target in patterns.CAST_METHODS
                and node.all_input_nodes == [node.args[0]]):  # one input: type_as(other) reads another tensor
            return False
        value = patterns.example_value(node)
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            return False
        node, reader = node.args[0], node


def compact_consumer(region: Region, user: fx.Node, logits: fx.Node, erased: set) -> list[str]:
    """Run ``user`` (top-k / argmax, maybe behind a log_softmax) on the compact logits, if it is one;
    returns the names of the ops now running on compact logits (empty if none).

    Slots past the count may hold finite values after post-ops (tanh(-inf) is finite), so a
    log_softmax input is re-masked with ``ids >= 0`` (exactly the filled slots) unless it is the compact logits
    themselves, maybe cast (:func:`_unfilled_already_inf`); top-k and argmax ignore such slots themselves. Not behind
    a softmax: where k exceeds the active count, the compact top-k pads with -inf, but the probabilities of inactive
    tokens are 0.
    """
    graph, state = region.graph, region.state
    if patterns.match_log_softmax(user, logits):
        readers = list(user.users)
        if not readers or not all(_largest(patterns.match_topk(r, user)) or patterns.match_argmax(r, user) is not None
                                  for r in readers):
            return []
        if not _unfilled_already_inf(region, user, logits):
            _mask_unfilled(region, user, logits)
        set_example_value(user)
        names = [describe(user)]
        for r in readers:
            names += compact_consumer(region, r, user, erased)
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
