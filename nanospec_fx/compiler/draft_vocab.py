"""A head over a draft vocabulary that no option names: find EAGLE-3's ``d2t`` buffer so the warning can name it.

An EAGLE-3 drafter embeds target ids (V rows) but its head has R < V rows, a trained draft vocabulary, and the
module keeps ``d2t`` ([R], integer): head row i predicts target token ``i + d2t[i]``. Without
``options={"draft_to_target": ...}`` nothing in the graph says that the head's outputs are not token ids, so the
head runs dense with a warning. This finds such a buffer (in the graph, or on the module Dynamo is compiling) so
that warning names it and gives the option to pass. The buffer is never used on its own: its values may be loaded
after the first call (``load_state_dict``), and a row map built from them at compile time would then be stale with
nothing to tell.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from nanospec_fx.passes import patterns, projections
from nanospec_fx.passes.find_head import parameter_name, projections_reaching_output, token_tables


def draft_vocab_hint(gm: fx.GraphModule, example_inputs: list) -> str | None:
    """The remedy to name when a projection narrower than the token table reaches the output and an integer buffer of
    as many entries maps its rows to distinct target ids (``i + d2t[i]`` in [0, V)); None otherwise."""
    tables = token_tables(gm)
    if not tables:
        return None
    vocab = max(tables.values())
    widths = sorted({shape[0] for n in projections_reaching_output(gm)
                     if (shape := projections.projection_shape(n)) and isinstance(shape[0], int) and shape[0] < vocab})
    for rows in widths:
        for name, buffer in _buffers(gm, example_inputs):
            if _maps_rows(buffer, rows, vocab):
                return (f"the head has {rows} outputs and the token embedding {vocab} rows, and `{name}` is an integer "
                        f"buffer of {rows} entries with i + {name}[i] distinct token ids below {vocab}: if it is a "
                        "draft vocabulary (EAGLE-3's d2t: head row i is target token i + d2t[i]), pass "
                        f"options={{'draft_to_target': torch.arange({rows}) + model.{name}, "
                        f"'target_vocab_size': {vocab}}}")
    return None


def _maps_rows(buffer: torch.Tensor, rows: int, vocab: int) -> bool:
    if buffer.dim() != 1 or buffer.numel() != rows or buffer.dtype.is_floating_point or buffer.dtype == torch.bool \
            or buffer.is_complex() or buffer.device.type == "meta":
        return False
    ids = torch.arange(rows) + buffer.detach().to("cpu", torch.int64)
    return bool((ids >= 0).all() and (ids < vocab).all() and ids.unique().numel() == rows)


def _buffers(gm: fx.GraphModule, example_inputs: list):
    """(name, tensor) of the graph's buffer inputs, then of the buffers of the module Dynamo is compiling."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.Tensor) and "_buffers[" in patterns.source_name(node):
            yield parameter_name(node), value
    module = _compiled_module()
    if module is not None:
        yield from module.named_buffers()


def _compiled_module() -> nn.Module | None:
    """``self`` of the frame Dynamo is tracing (None outside Dynamo or for a plain function)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        code = tx.f_code
        first = tx.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
    except Exception:  # noqa: BLE001 - not called by Dynamo, or a Dynamo without these internals
        return None
    return first if isinstance(first, nn.Module) else None
