"""The vocabulary-parallel heads of a graph: projections whose slices are gathered into ``[..., V]``
(:mod:`.gather`) or selected from and exchanged as (value, id) candidates (:mod:`.exchange`), found in Dynamo's
graph and collapsed in the backend's copy into plain ``[..., V]`` projections for ``rewrite_head``."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch.fx as fx

from .. import patterns, projections
from ..find_head import HeadMatch, module_path, name_matches, parameter_name, reaches_output
from ..graph import map_nodes
from .collapse import collapse_exchange, collapse_gather
from .exchange import match_exchange
from .exchange_values import Exchange
from .gather import Gather, ShardedOutput, match_dtensor, match_gather


@dataclass(eq=False)
class GatheredHead(HeadMatch):
    """A vocabulary-parallel head: ``weight`` is this rank's shard ``[V / tp, H]``, ``nodes`` the local projections,
    ``vocab_size`` the whole vocabulary V."""

    world_size: int = 1
    group_name: str = ""
    shard_rows: int = 0
    exchanges: dict = field(default_factory=dict)  # projection -> its Exchange (a selection, not a gather)

    __hash__ = object.__hash__


def gathered_heads(gm: fx.GraphModule, example_inputs: list, head: str | None = None,
                   notes: list[str] | None = None, exchanges: bool = True,
                   sharded_outputs: bool = False) -> list[GatheredHead]:
    """The vocabulary-parallel heads of ``gm``: projections with a parameter/buffer weight ``[V / tp, H]`` whose
    output is gathered into ``[..., V]`` (see :func:`match_gather`) and reaches the graph output. A gather that
    cannot be followed adds a note (the head then runs dense with a warning). ``head`` keeps the one it names.
    With ``exchanges``, a slice read by a local selection whose candidates are exchanged
    (:mod:`.exchange`) is such a head too. With ``sharded_outputs`` (a target observer, which only
    reads the slice), a DTensor head whose output stays ``Shard(-1)`` is one whatever reads its slice: the DTensor
    layout says which tokens its columns are. ``exchanges`` maps each such projection to its
    :class:`.Exchange` or :class:`.ShardedOutput`."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    example_of = dict(zip(placeholders, example_inputs))
    found: dict[fx.Node, GatheredHead] = {}
    for node in gm.graph.nodes:
        m = projections.match_projection(node)
        if m is None:
            continue
        x, w, b = m
        shape = patterns.tensor_shape(w)
        if not shape or not all(isinstance(d, int) for d in shape) or not patterns.is_weight_like(w, example_of.get(w)):
            continue
        if projections.projection_scales(node) != (1, 1):  # the collapsed projection would lose alpha / beta
            if notes is not None:
                notes.append(f"the projection {node.name} onto {parameter_name(w)} scales its product or bias "
                             "(addmm/baddbmm alpha, beta): not taken as a vocabulary-parallel head")
            continue
        gather = match_dtensor(node) or match_gather(node)
        sharded = gather if isinstance(gather, ShardedOutput) else None
        if (gather is None or sharded) and exchanges:
            gather = match_exchange(sharded.local if sharded else node, example_of, sharded)
            if sharded_outputs and sharded is not None and not isinstance(gather, Exchange):
                gather = sharded
            elif isinstance(gather, str):
                gather = f"its slice is selected from and the candidates exchanged, but {gather}"
            elif gather is None and sharded:
                gather = ("its DTensor output stays sharded (Shard(-1)) and is read by no local top-k/max whose "
                          "candidates are exchanged (all-gathered) and picked from")
        elif sharded:
            gather = "its DTensor output stays sharded (Shard(-1)): each rank keeps its own slice"
        if gather is None:
            continue
        if isinstance(gather, str):
            if notes is not None:
                notes.append(f"the vocabulary-parallel head {parameter_name(w)} is gathered, but {gather}; gather "
                             "into fresh tensors, or write funcol.all_gather_tensor(local, gather_dim=local.dim() - 1, "
                             "group=g) (the forms docs/tensor-parallel.md lists)"
                             if not gather.startswith("its slice") else
                             f"the vocabulary-parallel head {parameter_name(w)}: {gather}")
            continue
        selected = not isinstance(gather, Gather)  # an exchange of candidates: its selection reaches the output
        vocab = gather.world_size * shape[0] if gather.dtensor_input is None else shape[0]
        if not selected and not reaches_output(gather.full, vocab):
            continue
        match = found.get(w)
        if match is None:
            match = found[w] = GatheredHead(w, [], parameter_name(w), vocab, shape[1], module_path=module_path(node),
                                            world_size=gather.world_size, group_name=gather.group_name,
                                            shard_rows=vocab // gather.world_size)
        elif (match.world_size, match.group_name) != (gather.world_size, gather.group_name):
            if notes is not None:
                notes.append(f"the vocabulary-parallel head {match.name} is gathered over two different groups")
            found.pop(w)
            continue
        match.nodes.append(node)
        match.biases.append(b)
        match.reach = "selection" if selected else "logits"
        if selected:
            match.exchanges[node] = gather
    heads = list(found.values())
    if head is not None:
        heads = [h for h in heads if name_matches(head, h.name, h.module_path)]
    return heads


def sliced_logits(selection: Exchange | ShardedOutput) -> fx.Node:
    """This rank's ``[..., V / tp]`` slice of the logits a selection reads (after its casts and scalings)."""
    if isinstance(selection, ShardedOutput):
        return selection.local
    return selection.prefix[-1] if selection.prefix else selection.local


def collapsed(graph: fx.Graph, head: GatheredHead, node_map: dict[fx.Node, fx.Node]) -> HeadMatch:
    """``head`` (found in Dynamo's graph) in the backend's copy ``graph``, with every gather collapsed: a plain
    HeadMatch over ``[..., V]`` projections that ``rewrite_head`` takes as it is, every other field of the head
    kept (mapped by :func:`~nanospec_fx.passes.graph.map_nodes`)."""
    mapped = map_nodes(head, node_map)
    nodes = [collapse_exchange(graph, mapped.exchanges[n]) if n in mapped.exchanges else collapse_gather(graph, n)
             for n in mapped.nodes]
    weight, bias = projections.match_projection(nodes[0])[1:]  # a DTensor head's: its to_local() shards
    plain = {f.name: getattr(mapped, f.name) for f in dataclasses.fields(HeadMatch)}
    return HeadMatch(**{**plain, "weight": weight, "nodes": nodes, "biases": [bias] * len(nodes)})
