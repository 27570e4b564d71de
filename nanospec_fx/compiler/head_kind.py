"""What differs between a head on one device and a vocabulary-parallel one, in one place: the compiler's one seam
with tensor parallelism.

The compiler asks a head's kind (:func:`kind_of_head`, or :func:`kind_of_state` for the state a target observer
feeds) questions - which heads of a graph are vocabulary-parallel, how to build the head's state, what its graph
reads, how its observers copy rows, what a compiled call passes and checks, whether the ranks must agree - and
never branches on the kind, nor names a tensor-parallel module itself. A kind works on the FX graph it is given and
returns what the compiler needs (an observer count, their ids' shapes); it never calls back into the compiler.
:class:`DenseHeadKind` is the ordinary case; :class:`ShardedHeadKind` the replicated state of a vocabulary-parallel
head (``nanospec_fx.parallel.sharded_state``), whose observers fetch rows with a collective and whose decisions every
rank
agrees on (``consensus``). :func:`request_vocabs` is the same choice for the per-request sets of an engine (vLLM).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.fx as fx

from nanospec_fx.parallel import consensus
from nanospec_fx.parallel.collectives import VocabShard, local_shard
from nanospec_fx.passes import HeadMatch, insert_topk_observers
from nanospec_fx.passes.graph import map_nodes
from nanospec_fx.passes.vocab_parallel import gather as vocab_parallel
from nanospec_fx.passes.vocab_parallel import heads as vocab_parallel_heads
from nanospec_fx.passes.vocab_parallel import topk as vocab_parallel_topk
from nanospec_fx.passes.vocab_parallel.observe import shard_observers
from nanospec_fx.parallel.sharded_state import ShardedActiveVocab, fetch_observed, sharded_state_for, write_observed
from nanospec_fx.vocab.state import ActiveVocab, state_for


@dataclasses.dataclass(frozen=True)
class Observers:
    """What a rewritten head's observers do, for the ranks' agreement: how many, and their ids' shapes (each runs a
    fetch of that many rows on a vocabulary-parallel head; None on one device, where nothing is fetched)."""

    count: int
    shapes: tuple[str, ...] | None = None


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

    def state_for(self, head, weight: torch.Tensor, bias: torch.Tensor | None, config) -> ActiveVocab:
        """The head's registered state (looked up, or created): once its graph's stages succeeded."""
        return state_for(weight, bias, config, name=head.name, transposed=head.transposed,
                         stacked=getattr(head, "stacked", ()))

    def layout_of(self, head, weight: torch.Tensor, bias: torch.Tensor | None, config) -> ActiveVocab:
        """A state of the head's layout that no registry holds (no seeds: only its tensors' shapes matter), for the
        graph's inputs while its stages run; the registered one is made only if they all succeed."""
        layout = {"stacked": head.stacked} if getattr(head, "stacked", ()) else {"transposed": head.transposed}
        return self.factory(head)(weight, bias, **dataclasses.replace(config, seed_ids=None).keywords(), **layout)

    def factory(self, head):
        return ActiveVocab

    def remap(self, graph: fx.Graph, node_map: dict, head: HeadMatch) -> HeadMatch:
        """``head`` in a copy of its graph (``node_map``: old node -> new), every field kept."""
        return map_nodes(head, node_map)

    def head_inputs(self, state: ActiveVocab) -> tuple[list[str], list[torch.Tensor]]:
        """What a target observer passes for the drafter's head: its rows and bias (names, tensors)."""
        tensors = [state.head_rows] + ([state.bias] if state.bias is not None else [])
        return ["weight", "bias"][:len(tensors)], tensors

    def observer_inputs(self, state: ActiveVocab) -> tuple[list[str], list[torch.Tensor]]:
        """Inputs the state's observers read after the state's tensors (names, tensors): none."""
        return [], []

    def insert_topk_observers(self, graph: fx.Graph, node_map: dict, head, into, topk: int,
                              observe_prompt: bool) -> int:
        """A target's top-k observers after ``head``'s projections; how many."""
        return insert_topk_observers(graph, self.remap(graph, node_map, head).nodes, topk, into,
                                     observe_prompt=observe_prompt)

    def finish_observers(self, graph: fx.Graph, state: ActiveVocab, into, inputs: list[fx.Node],
                         count: int) -> Observers:
        """After the observers are in: nothing to change; what they are."""
        return Observers(count)

    def agree(self, decision: str, what: str = "drafter") -> None:
        """Every rank took ``decision``: one process, nothing to agree."""

    def graph_inputs(self, state: ActiveVocab) -> list[torch.Tensor]:
        """Inputs the rewritten graph reads after the state's tensors."""
        return []

    def explain_failure(self, state: ActiveVocab, error: BaseException) -> None:
        """A compiled call raised: the error stands."""

    def after_call(self, state: ActiveVocab) -> None:
        """After a compiled call: nothing to check."""

    def request_vocabs(self, weight: torch.Tensor, max_requests: int, rows: int, **state):
        """Per-request sets over ``weight``'s first ``rows`` rows (an engine's head, padded past its vocabulary)."""
        from nanospec_fx.vocab.request_vocab import RequestVocabs

        return RequestVocabs(weight[:rows], None, max_requests, **state)


class ShardedHeadKind(DenseHeadKind):
    """A vocabulary-parallel head (each rank holds ``V / tp`` rows, the logits gathered): a replicated state whose
    observers fetch rows from their owner shards, and decisions every rank of ``group`` must take together."""

    sharded = True
    takes_dtensor = True
    keeps_prefill_ids = False  # its observe is a collective every rank must make in step

    def __init__(self, group: str, shard: VocabShard | None = None):
        self.group, self.shard = group, shard

    def state_for(self, head, weight, bias, config) -> ShardedActiveVocab:
        return sharded_state_for(weight, bias, config, _shard_of(head), name=head.name)

    def factory(self, head):
        return functools.partial(ShardedActiveVocab, shard=_shard_of(head))

    def layout_of(self, head, weight, bias, config) -> ShardedActiveVocab:
        return self.factory(head)(weight, bias, **dataclasses.replace(config, seed_ids=None).keywords())

    def remap(self, graph, node_map, head):
        return vocab_parallel_heads.collapsed(graph, head, node_map)

    def head_inputs(self, state):
        """The drafter's head shard (a DTensor's local tensor) and its bias."""
        tensors = [local_shard(t) for t in (state.weight, state.bias) if t is not None]
        return ["weight", "bias"][:len(tensors)], tensors

    def observer_inputs(self, state):
        return state.graph_input_names(), state.graph_inputs()

    def insert_topk_observers(self, graph, node_map, head, into, topk, observe_prompt) -> int:
        """The target's top-k read on the gathered logits, and on logits that stay sharded: a local top-k, an
        exchange of k candidates per rank, a global top-k."""
        full = [vocab_parallel.full_logits(node_map[n]) for n in head.nodes if n not in head.exchanges]
        observed = insert_topk_observers(graph, full, topk, into)
        slices = [node_map[vocab_parallel_heads.sliced_logits(s)] for s in head.exchanges.values()]
        return observed + vocab_parallel_topk.insert_sharded_topk_observers(
            graph, slices, topk, into, head.world_size, head.group_name, head.shard_rows)

    def finish_observers(self, graph, state, into, inputs, count) -> Observers:
        """Every observer of the state becomes a checked row fetch (``passes/vocab_parallel/observe.py``) reading
        ``inputs`` (the state's zero tables and fetch verdicts)."""
        shapes = shard_observers(graph, into, inputs, functools.partial(_fetch, shard=state.shard),
                                 functools.partial(_write, vocab_size=state.shard.vocab_size))
        return Observers(count, tuple(shapes))

    def agree(self, decision: str, what: str = "drafter") -> None:
        consensus.agree(self.group, decision, what=what)

    def graph_inputs(self, state) -> list[torch.Tensor]:
        return state.graph_inputs()

    def explain_failure(self, state, error: BaseException) -> None:
        consensus.explain_failure(state.shard.group_name, error)  # another rank's nanospec error, if any

    def after_call(self, state) -> None:
        state.raise_if_diverged()

    def request_vocabs(self, weight, max_requests, rows, **state):
        """Replicated per-request sets over this rank's shard of the head (``rows``: the head's real rows)."""
        from nanospec_fx.parallel.sharded_state import ShardedRequestVocabs

        return ShardedRequestVocabs(weight, max_requests, shard=self.shard, rows=rows, **state)


def _shard_of(head) -> VocabShard:
    return VocabShard.of(head.group_name, head.world_size, head.shard_rows)


def _fetch(x, weight, bias, ids, cursor, *, shard: VocabShard):
    return fetch_observed(x, weight, bias, shard, ids, cursor)


def _write(x, rows, bias_rows, slot_of, cache_w, cache_b, *, vocab_size: int) -> None:
    write_observed(x, rows, bias_rows, slot_of, cache_w, cache_b, vocab_size)


DENSE = DenseHeadKind()


def gathered_heads(gm: fx.GraphModule, example_inputs: list, *, head: str | None, notes: list,
                   sharded_outputs: bool = False) -> list[HeadMatch]:
    """The graph's vocabulary-parallel heads (a gather of the logits of ``V / tp``-row shards); ``notes`` gains why a
    gather is not followed (``passes/vocab_parallel/heads.py``)."""
    return vocab_parallel_heads.gathered_heads(gm, example_inputs, head=head, notes=notes,
                                               sharded_outputs=sharded_outputs)


def kind_of_head(head) -> DenseHeadKind:
    """The kind of a head the passes found: a gathered vocabulary-parallel head, or an ordinary one."""
    return ShardedHeadKind(head.group_name) if isinstance(head, vocab_parallel_heads.GatheredHead) else DENSE


def kind_of_state(state) -> DenseHeadKind:
    """The kind of the head a state belongs to (what a target observer feeding it must do)."""
    return kind_of_shard(getattr(state, "shard", None))


def kind_of_shard(shard: VocabShard | None) -> DenseHeadKind:
    """The kind of a head this rank holds ``shard`` of (None: the whole head)."""
    return ShardedHeadKind(shard.group_name, shard) if isinstance(shard, VocabShard) else DENSE


def request_vocabs(weight: torch.Tensor, max_requests: int, rows: int, shard: VocabShard | None = None, **state):
    """Per-request sets of an engine's head (vLLM; ``rows``: its real rows), replicated over the ranks when ``shard``
    is one."""
    return kind_of_shard(shard).request_vocabs(weight, max_requests, rows, **state)
