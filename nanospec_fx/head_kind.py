"""What the backend does differently for a head on one device and for a vocabulary-parallel one, in one place.

The backend asks a head's kind (:func:`kind_of_head`, or :func:`kind_of_state` for the state a target observer
feeds) how to build the head's state, how its observers copy rows, what a compiled call passes and checks, and
whether the ranks must agree first; it never branches on the kind itself. :class:`DenseHeadKind` is the ordinary
case; :class:`ShardedHeadKind` the replicated state of a vocabulary-parallel head (``nanospec_fx.sharded_state``),
whose observers fetch rows with a collective and whose decisions are agreed by every rank (``consensus``).
"""
from __future__ import annotations

import functools

import torch

from nanospec_fx import consensus
from nanospec_fx.collectives import VocabShard, local_shard
from nanospec_fx.passes import insert_topk_observers
from nanospec_fx.passes.vocab_parallel import gather as vocab_parallel
from nanospec_fx.passes.vocab_parallel import heads as vocab_parallel_heads
from nanospec_fx.passes.vocab_parallel import topk as vocab_parallel_topk
from nanospec_fx.passes.vocab_parallel.observe import shard_observers
from nanospec_fx.sharded_state import ShardedActiveVocab, fetch_observed, sharded_state_for, write_observed
from nanospec_fx.state import ActiveVocab, state_for


class DenseHeadKind:
    """A head whose whole weight this process holds: nothing to fetch, nobody to agree with."""

    #: the passes' ``ObserveInto.sharded``: lookups into a ``V / tp``-row embedding shard are token lookups
    sharded = False
    #: a DTensor weight is a layout this kind does not rewrite
    takes_dtensor = False
    #: ids a prefill call of the same model embedded join before the head reads the set
    keeps_prefill_ids = True
    #: the process group whose ranks must take the same decisions (None: none)
    group: str | None = None

    def build_state(self, head, weight: torch.Tensor, bias: torch.Tensor | None, config) -> ActiveVocab:
        return state_for(weight, bias, config, name=head.name, transposed=head.transposed)

    def remap(self, builder, head):
        """``head``'s nodes in the builder's copy of the graph."""
        return builder.remap(head)

    def add_state(self, builder, state: ActiveVocab, weight, bias):
        """The state's graph inputs (and the head's weight/bias when the graph does not hold them)."""
        return builder.add_state(state, weight, bias)

    def insert_topk_observers(self, builder, head, into, opts) -> int:
        """A target's top-k observers after ``head``'s projections."""
        return insert_topk_observers(builder.graph, builder.remap(head).nodes, opts.observe_topk, into,
                                     observe_prompt=opts.observe_prompt)

    def finish_observers(self, builder, state: ActiveVocab, into, head=None, observers: int = 0) -> None:
        """After the observers are in: nothing to change."""

    def agree(self, decision: str, what: str = "drafter") -> None:
        """Every rank took ``decision``: one process, nothing to agree."""

    def weight_inputs(self, state: ActiveVocab) -> list[torch.Tensor]:
        """What a target observer passes for the drafter's head: its rows and bias."""
        return [state.head_rows] + ([state.bias] if state.bias is not None else [])

    def graph_inputs(self, state: ActiveVocab) -> list[torch.Tensor]:
        """Inputs the rewritten graph reads after the state's tensors."""
        return []

    def explain_failure(self, state: ActiveVocab, error: BaseException) -> None:
        """A compiled call raised: the error stands."""

    def after_call(self, state: ActiveVocab) -> None:
        """After a compiled call: nothing to check."""


class ShardedHeadKind(DenseHeadKind):
    """A vocabulary-parallel head (each rank holds ``V / tp`` rows, the logits gathered): a replicated state whose
    observers fetch rows from their owner shards, and decisions every rank of ``group`` must take together."""

    sharded = True
    takes_dtensor = True
    keeps_prefill_ids = False  # its observe is a collective every rank must make in step

    def __init__(self, group: str):
        self.group = group

    def build_state(self, head, weight, bias, config) -> ShardedActiveVocab:
        shard = VocabShard.of(head.group_name, head.world_size, head.shard_rows)
        return sharded_state_for(weight, bias, config, shard, name=head.name)

    def remap(self, builder, head):
        return vocab_parallel_heads.collapsed(builder.graph, head, builder.node_map)

    def add_state(self, builder, state, weight, bias):
        if weight is None:  # a target observer: the drafter's head shard (a DTensor's local tensor) as inputs
            nodes = builder.add_inputs(["weight"] + (["bias"] if state.bias is not None else []))
            builder.set_input_values(nodes, self.weight_inputs(state))
            weight, bias = nodes[0], nodes[1] if len(nodes) > 1 else None
        into = builder.add_state(state, weight, bias)
        into.sharded = True
        return into

    def insert_topk_observers(self, builder, head, into, opts) -> int:
        """The target's top-k read on the gathered logits, and on logits that stay sharded: a local top-k, an
        exchange of k candidates per rank, a global top-k."""
        full = [vocab_parallel.full_logits(builder.node_map[n]) for n in head.nodes if n not in head.exchanges]
        observed = insert_topk_observers(builder.graph, full, opts.observe_topk, into)
        slices = [builder.node_map[vocab_parallel_heads.sliced_logits(s)] for s in head.exchanges.values()]
        return observed + vocab_parallel_topk.insert_sharded_topk_observers(
            builder.graph, slices, opts.observe_topk, into, head.world_size, head.group_name, head.shard_rows)

    def finish_observers(self, builder, state, into, head=None, observers: int = 0) -> None:
        """Every observer of the state becomes a checked row fetch (``passes/vocab_parallel/observe.py``); a
        drafter's head records how many and their ids' shapes for :meth:`agree`."""
        zero = builder.add_inputs(state.graph_input_names())
        builder.set_input_values(zero, state.graph_inputs())
        shard_observers(builder.graph, into, zero, functools.partial(_fetch, shard=state.shard),
                        functools.partial(_write, vocab_size=state.shard.vocab_size))
        if head is not None:
            head.observers, head.observer_shapes = observers, into.observer_shapes

    def agree(self, decision: str, what: str = "drafter") -> None:
        consensus.agree(self.group, decision, what=what)

    def weight_inputs(self, state) -> list[torch.Tensor]:
        return [local_shard(t) for t in (state.weight, state.bias) if t is not None]

    def graph_inputs(self, state) -> list[torch.Tensor]:
        return state.graph_inputs()

    def explain_failure(self, state, error: BaseException) -> None:
        consensus.explain_failure(state.shard.group_name, error)  # another rank's nanospec error, if any

    def after_call(self, state) -> None:
        state.raise_if_diverged()


def _fetch(x, weight, bias, ids, cursor, *, shard: VocabShard):
    return fetch_observed(x, weight, bias, shard, ids, cursor)


def _write(x, rows, bias_rows, slot_of, cache_w, cache_b, *, vocab_size: int) -> None:
    write_observed(x, rows, bias_rows, slot_of, cache_w, cache_b, vocab_size)


DENSE = DenseHeadKind()


def kind_of_head(head) -> DenseHeadKind:
    """The kind of a head the passes found: a gathered vocabulary-parallel head, or an ordinary one."""
    return ShardedHeadKind(head.group_name) if isinstance(head, vocab_parallel_heads.GatheredHead) else DENSE


def kind_of_state(state: ActiveVocab) -> DenseHeadKind:
    """The kind of the head a state belongs to (what a target observer feeding it must do)."""
    shard = getattr(state, "shard", None)
    return ShardedHeadKind(shard.group_name) if isinstance(shard, VocabShard) else DENSE
