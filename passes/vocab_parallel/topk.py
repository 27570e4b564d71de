"""A target observer's top-k over logits that stay sharded: local top-k, an exchange of k candidates, a global pick.

A vocabulary-parallel target that never gathers its logits (it selects on its own slice and exchanges (value, id)
candidates, or a DTensor ``ColwiseParallel()`` head whose output stays ``Shard(-1)``) has no ``[..., V]`` logits to
take a top-k of. Its top-k is computed from the slices instead::

    v, i = topk(sliced, k')                    # this rank's [..., V / tp] slice, k' = min(k, V / tp)
    i = i + rank * V / tp                      # global ids
    cv, ci = all_gather(stack([v, i.to(v.dtype)]))   # [..., tp * k'] each, rank-major: one small collective
    ids = ci.long().gather(-1, topk(cv, k).indices)  # the same on every rank: they pick from the same candidates

(two collectives where an id would not be exact in the logits' dtype: bfloat16 over 257 tokens). Every token of
the global top-k is in its shard's top-k', so ``ids`` are a top-k of ``cat(slices)``. The nodes are added next to
the target's own (its outputs do not change); ``ids`` are then observed like a one-device target's.

Ties: the observed values are exactly the k largest of the full logits, ids above the k-th value are all observed;
which of the ids tied at the k-th value are observed is torch.topk's choice (as on one device), the same on every
rank (every rank picks from the same gathered candidates with the same op).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import patterns
from ..contract import ObserveInto
from ..observe_inputs import insert_observe
from ..patterns import set_example_value
from .collectives import group_rank
from .id_dtypes import ids_round_trip

C10D = torch.ops._c10d_functional


def sharded_topk_ids(sliced: torch.Tensor, k: int, rows: int, offset: int, world: int, group_name: str,
                     dtype: torch.dtype):
    """The ids ``[..., k]`` of a top-k of the logits ``cat(slices of ranks 0..world-1)``, from this rank's
    ``sliced`` ``[..., rows]`` of ``dtype`` (its columns are tokens ``offset .. offset + rows - 1``). Exchanges
    ``[..., world * min(k, rows)]`` values and ids: in one all-gather, stacked, where every id is an exact integer
    of ``dtype`` (``ids_round_trip``), else in two. Traceable into an FX graph (``_c10d_functional`` ops, no host
    sync)."""
    top = torch.topk(sliced, min(k, rows), dim=-1)
    values, ids = top[0], top[1] + offset
    if ids_round_trip(world * rows, dtype):
        both = _gather_candidates(torch.stack([values, ids.to(dtype)]), world, group_name)  # [2, ..., world * k']
        values, ids = both[0], both[1].to(torch.int64)
    else:
        values, ids = (_gather_candidates(t, world, group_name) for t in (values, ids))
    picked = torch.topk(values, k, dim=-1)[1]
    return torch.gather(ids, -1, picked)


def _gather_candidates(t: torch.Tensor, world: int, group_name: str) -> torch.Tensor:
    """Every rank's ``t`` ``[..., k']`` side by side along the last axis, in rank order: ``[..., world * k']``."""
    stacked = C10D.wait_tensor.default(C10D.all_gather_into_tensor.default(t.contiguous(), world, group_name))
    pieces = torch.chunk(stacked, world, 0)  # [world * B, ..., k'] -> rank r's [B, ..., k']
    return torch.cat([pieces[r] for r in range(world)], -1)


def insert_sharded_topk_observers(graph: fx.Graph, slices: list[fx.Node], k: int, into: ObserveInto,
                                  world: int, group_name: str, rows: int) -> int:
    """After each of ``slices`` (this rank's ``[..., rows]`` slice of a vocabulary-parallel target's logits),
    observe the ids of the top-k of the full logits (:func:`sharded_topk_ids`). Returns how many."""
    offset = group_rank(group_name) * rows
    tracer = fx.proxy.GraphAppendingTracer(graph)
    for sliced in slices:
        before = set(graph.nodes)
        with graph.inserting_before(sliced.next):  # a fixed anchor keeps the new nodes in order
            dtype = patterns.example_value(sliced).dtype
            ids = sharded_topk_ids(fx.Proxy(sliced, tracer), k, rows, offset, world, group_name, dtype).node
            for new in list(graph.nodes):
                if new not in before:
                    set_example_value(new)
            insert_observe(graph, ids, into)
    return len(slices)
