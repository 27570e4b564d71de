"""The compact part of one projection's vocabulary region while the rewrite walks it, and its materialisation.

Every value of the post-op chain is held either compact (``[..., C]``, a :class:`Member` of its alias class) or as
a materialised ``[..., V]`` tensor with ``-inf`` at inactive tokens, whose :class:`Mask` says where those are. An
alias class is materialised once (its root scattered, the views in between replayed on it), so every later use
of every alias reads the same tensor and no write is lost.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from nanospec_fx.kernels.schema import op_call

from . import patterns
from .contract import StateNodes
from .grad_mode import stands_for
from .patterns import set_example_value


@dataclass
class Member:
    """A compact value: its alias root and how it derives from its parent (None for a root)."""

    root: fx.Node
    parent: fx.Node | None = None
    identity: bool = False  # same tensor as the parent (an in-place op's result, a cast that returned its input)


class Region:
    """The compact part of one projection's vocabulary region while the walk runs."""

    def __init__(self, graph: fx.Graph, state: StateNodes, vocab: int, compact: fx.Node):
        self.graph, self.state, self.vocab, self.compact = graph, state, vocab, compact
        with graph.inserting_after(compact):
            self.safe_ids = self.tag(graph.call_function(torch.clamp, (state.ids,), {"min": 0}))
        set_example_value(self.safe_ids)
        self.members: dict[fx.Node, Member] = {}
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
        # each region node's value as Dynamo traced it, before the walk gave it a compact one: whether an op that
        # returns its input, a view of it or a copy (``contiguous``, ``reshape``, a cast) copied in eager
        self.eager: dict[fx.Node, object] = {}
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
