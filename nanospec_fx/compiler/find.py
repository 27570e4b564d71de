"""Which heads a drafter's graph has, and what to say when it has none.

:func:`drafter_heads` asks the head kinds for vocabulary-parallel heads first, then the head finder
(``passes/find_head.py``), with the width the options or the model declare; :func:`headless_notes` words why a
graph without a head runs unchanged (or says nothing: a prefill, an embedding-only piece of a split call).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from nanospec_fx.diagnostics import diagnosis
from nanospec_fx.compiler.draft_vocab import draft_vocab_hint
from nanospec_fx.compiler.head_kind import gathered_heads
from nanospec_fx.compiler.runtime import held_tensors
from nanospec_fx.passes import DenseHead, HeadMatch, find_heads, patterns
from nanospec_fx.passes.find_head import projections_reaching_output, token_tables
from nanospec_fx.passes.lookups import embedding_lookups, one_hot_internals


def drafter_heads(gm: fx.GraphModule, example_inputs: list, *, head: str | None,
                  width: int | None) -> tuple[list[HeadMatch], list[str]]:
    """``(heads, notes)``: the heads to decide on (of ``width`` outputs, or named ``head``), and the finder's notes:
    beside the heads found, the projections onto the vocabulary it could not take (:class:`DenseHead`: a head's
    reason); without one, why none was found."""
    notes: list[str] = []
    heads = [h for h in gathered_heads(gm, example_inputs, head=head, notes=notes)
             if width is None or h.vocab_size == width]
    if heads:
        return heads, []
    found: list[str] = []
    heads = find_heads(gm, example_inputs, vocab_size=width, head=head, notes=found)
    declared = _declared_vocab_size(gm, example_inputs) if not heads and width is None and head is None else None
    if declared is not None:  # the model says its vocabulary (config.vocab_size, get_output_embeddings)
        heads = find_heads(gm, example_inputs, vocab_size=declared, notes=[])
        found = [] if heads else found
    if heads:
        return heads, found
    # a vocabulary-parallel head's note says why its gather is not followed (its shard is no padded/draft head)
    if not notes:
        notes.extend(found)
        if hint := draft_vocab_hint(gm, example_inputs):  # an EAGLE-3 head compiled without the option
            notes.insert(0, hint)
    return [], notes


def headless_notes(gm: fx.GraphModule, notes: list[str], position) -> list[str]:
    """The warnings of a graph without a head to rewrite, beside its :class:`DenseHead` notes (said as those heads'
    reasons). In a piece of a split call, only a projection nanospec cannot take as the head is worth a warning (an
    embedding-only or a post-op-only piece: the piece with the head says why it is dense); a whole call that embeds
    tokens and computes nothing vocabulary-wide is a prefill, not a head nanospec missed."""
    said = []
    embeds = position.whole_call and is_prefill(gm)
    dense_heads = any(isinstance(n, DenseHead) for n in notes)
    if dense_heads:
        said.extend(f"nanospec: {n}" for n in notes if not isinstance(n, DenseHead))
    elif notes or projections_reaching_output(gm) or (position.whole_call and not embeds):
        said.append(
            "nanospec: no LM head found in this graph (a linear/matmul/einsum with a parameter or buffer weight "
            "whose vocabulary-sized output reaches the output, with the vocabulary of the token embedding"
            + (f"; {'; '.join(notes)}" if notes else "")
            + ("" if position.whole_call else f"; {position.describe()}") + "); this graph runs unchanged. "
            "If the head is in it, pass options={'vocab_size': V} or {'head': '<weight name>'}."
        )
    # ids the eager caller embeds are never seen
    if position.eager_caller and not said and not dense_heads and token_tables(gm):
        said.append(f"nanospec: this graph looks up token ids but is one piece of a call ({position.describe()}): "
                    "the ids that code embeds are not observed, so the model's head may read an active set "
                    "without them. Move the graph break out of the loop Dynamo skipped, or feed the set with "
                    "nanospec_fx.active_vocab(model).observe(ids)")
    return said


def _declared_vocab_size(gm: fx.GraphModule, example_inputs: list) -> int | None:
    """The vocabulary the model whose frame is compiled says it has: its ``get_output_embeddings()``'s rows, else
    ``config.vocab_size`` (a hidden-states drafter with several wide projections names its head this way)."""
    model = diagnosis.model_of_frame(held_tensors(gm, example_inputs))
    if model is None:
        return None
    try:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    except Exception:  # noqa: BLE001 - a model's own method: it may not apply here
        head = None
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None




def is_prefill(gm: fx.GraphModule) -> bool:
    """A graph that looks up token ids and computes nothing as wide as their table along any axis (a head
    nanospec missed would, whatever reads its logits)."""
    lookups = embedding_lookups(gm.graph)
    rows = {r for *_, r in lookups}
    lookup_parts = {t for _, _, t, _ in lookups} | {n for lk, *_ in lookups for n in one_hot_internals(lk)}
    for node in gm.graph.nodes:
        value = patterns.example_value(node)
        if node not in lookup_parts and isinstance(value, torch.Tensor) and any(
                isinstance(d, int) and d in rows for d in value.shape):
            return False
    return bool(rows)


