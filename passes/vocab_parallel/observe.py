"""Observers of a vocabulary-parallel head's replicated state: each ``nanospec.observe`` becomes a row fetch from
the owner shards, the slot bookkeeping, and the fetched rows written to their slots.

The head's shard holds ``V / tp`` rows, so ``observe`` cannot copy the rows of the ids it adds: each observer of
that state is replaced by ``fetch`` (traced: its collective becomes ``_c10d_functional`` nodes of the graph), then
``nanospec.observe`` over a zero table (built by name from ``kernels/schema.py``: it only moves the slots), then
``write``. ``fetch`` and ``write`` are the runtime's (``nanospec_fx.parallel.sharded_state``), handed in: the same code
runs eagerly in ``ActiveVocab.observe``, and this package stays free of the runtime. A graph cannot raise, so each
fetch's verdict (did the ranks fetch the same ids?) is added to a ``check`` input the call reads afterwards.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from nanospec_fx.kernels.schema import is_op, op_arg, op_call

from ..contract import ObserveInto
from ..patterns import example_value, set_example_value


def shard_observers(graph: fx.Graph, into: ObserveInto, zero: list[fx.Node], fetch: Callable,
                    write: Callable) -> list[str]:
    """Turn every ``nanospec.observe`` of ``into``'s state in ``graph`` into a checked fetch of its rows, the
    bookkeeping and the write, traced in place. ``zero``: the graph inputs of the state's ``graph_inputs()`` (the
    zero table, the zero bias with a bias, and the check). ``fetch(x, weight, bias, ids, cursor) -> (rows,
    bias_rows, verdict)`` and ``write(x, rows, bias_rows, slot_of, cache_w, cache_b)`` are traced with proxies.

    Returns their ids' shapes, one per observer (each fetch's all-reduce has that many rows: the ranks agree on them
    before they run)."""
    tracer = fx.proxy.GraphAppendingTracer(graph)

    def proxy(node):
        return fx.Proxy(node, tracer) if isinstance(node, fx.Node) else node

    zero_rows, zero_bias, check = zero[0], zero[1] if len(zero) > 2 else None, zero[-1]
    s = into.state
    observers = [n for n in graph.nodes if is_op(n, "observe") and op_arg(n, "cursor") is s.cursor]
    order = {n: i for i, n in enumerate(graph.nodes)}
    for shard_of in (into.weight, into.bias):  # a DTensor head's ``W.to_local()``: computed before the first observer
        if (shard_of is not None and shard_of.op != "placeholder" and observers
                and order[shard_of] > order[observers[0]]):
            observers[0].prepend(shard_of)
    shapes = [str(tuple(getattr(example_value(op_arg(n, "token_ids")), "shape", ()))) for n in observers]
    for node in observers:
        before = set(graph.nodes)
        with graph.inserting_before(node):
            x = proxy(op_arg(node, "token_ids")).reshape(-1).to(torch.int64)
            rows, bias_rows, verdict = fetch(x, proxy(into.weight), proxy(into.bias), proxy(s.ids), proxy(s.cursor))
            bookkeeping = op_call(graph, "observe", token_ids=x.node, weight=zero_rows, bias=zero_bias, ids=s.ids,
                                  slot_of=s.slot_of, cursor=s.cursor, cache_w=s.cache_w, cache_b=s.cache_b,
                                  num_pinned=into.num_pinned)
            bookkeeping.meta["val"] = bookkeeping.meta["example_value"] = None  # returns nothing; writes the state
            write(x, rows, bias_rows, proxy(s.slot_of), proxy(s.cache_w), proxy(s.cache_b))
            proxy(check).add_(verdict)
        for new in graph.nodes:
            if new not in before and new is not bookkeeping:
                set_example_value(new)
        graph.erase_node(node)
    return shapes
