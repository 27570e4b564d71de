"""A graph with no head to rewrite: run unchanged, or, for a prefill, with the ids it embeds kept for the head.

A whole call that looks up token ids in a table it receives and has no head (a prefill) is compiled with the ids as
extra outputs, recorded for the heads of the same model (:mod:`nanospec_fx.vocab.prefill`); a head-less graph that looks
up ids has its calls counted for the diagnosis of a model whose head nanospec never sees.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from nanospec_fx.diagnostics import diagnosis
from nanospec_fx.compiler import lowering
from nanospec_fx.compiler.lowering import GraphCopy
from nanospec_fx.compiler.runtime import weight_positions
from nanospec_fx.passes import transforms
from nanospec_fx.passes.lookups import embedding_lookups
from nanospec_fx.vocab.prefill import RecordingCall
from nanospec_fx.diagnostics.warning import warn_once


def recording_prefill(gm: fx.GraphModule, example_inputs: list, inductor: bool, patches: dict) -> Callable | None:
    """A head-less whole call that looks up token ids in a table it receives (a prefill): compiled with the
    ids as extra outputs, recorded under their table and the call's other parameters and buffers, for the heads
    of the same model (:mod:`prefill`).
    None when it looks up nothing."""
    builder = GraphCopy(gm)
    lookups = [(builder.user_input_position(table), ids) for _, ids, table, _ in embedding_lookups(builder.graph)]
    lookups = [(pos, ids) for pos, ids in lookups if pos is not None and isinstance(example_inputs[pos], torch.Tensor)]
    if not lookups:
        return None
    out = builder.graph.output_node()
    outputs = out.args[0]
    if not isinstance(outputs, (tuple, list)):
        return None
    extra, tables = [], []
    regions = transforms.transform_regions(builder.graph)
    for pos, ids in lookups:
        if isinstance(ids, fx.Node) and ids in regions:  # inside torch.vmap & co: the unbatched ids, if any
            inside, ids = regions[ids], transforms.outside_value(ids, regions)
            if ids is None:
                warn_once(f"nanospec: the ids this head-less call looks up inside {inside} are computed inside the "
                          "transform, so they are not kept for the next call's head (tokens only this call embeds "
                          "stay inactive there); compute them outside the transform, or feed them with "
                          "nanospec_fx.active_vocab(model).observe(ids)")
                continue
        if not isinstance(ids, fx.Node):  # ids written in the code: a constant tensor
            with builder.graph.inserting_before(out):
                ids = builder.graph.call_function(torch.tensor, (list(ids),), {"dtype": torch.int64})
        tables.append((pos, len(outputs) + len(extra)))
        extra.append(ids)
    out.args = (tuple(outputs) + tuple(extra),)
    builder.gm.recompile()
    compiled = lowering.compile_graph(builder.gm, example_inputs, inductor, patches)
    recording = RecordingCall(compiled, len(outputs), tables, weight_positions(gm, example_inputs))
    return counted(recording, gm, example_inputs)


def counted(compiled: Callable, gm: fx.GraphModule, example_inputs: list) -> Callable:
    """A head-less graph that looks up token ids in tables it receives, its calls counted per table for the
    diagnosis of a model whose head never runs in a graph nanospec sees (:class:`diagnosis.HeadlessCalls`)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    positions = sorted({placeholders.index(table) for _, _, table, _ in embedding_lookups(gm.graph)
                        if table in placeholders and isinstance(example_inputs[placeholders.index(table)],
                                                                 torch.Tensor)})
    if not positions:
        return compiled
    model = diagnosis.model_of_frame([example_inputs[p] for p in positions])
    return diagnosis.HeadlessCalls(compiled, positions, model, example_inputs)


