"""The one declaration of the nanospec state tensors and of the ops' signatures.

Everything else follows from here: :mod:`kernels.ops` registers each op with the schema string
below, and a test checks that the Python signatures of the op bodies, of the reference
(:mod:`kernels.reference`) and of the Triton wrappers (:mod:`kernels.triton_kernels`) name the
same arguments in the same order. :class:`nanospec_fx.ActiveVocab` hands its tensors over in
:data:`STATE` order.
"""
from __future__ import annotations

import re
from typing import NamedTuple

import torch


class StateField(NamedTuple):
    name: str
    dtype: torch.dtype | None  # None: the head's floating dtype
    shape: str
    meaning: str


#: The active-vocabulary state, in the order every op and ``ActiveVocab.tensors()`` use.
STATE_FIELDS = (
    StateField("ids", torch.int64, "[C]", "slot -> token id, -1 for a slot never filled"),
    StateField("slot_of", torch.int32, "[V]", "token id -> slot, -1 for an inactive token (the membership map)"),
    StateField("cursor", torch.int64, "[1]", "insertions ever made; count = min(cursor, C)"),
    StateField("cache_w", None, "[C, H]", "head rows of the active tokens, in slot order"),
    StateField("cache_b", None, "[C]", "bias entries of the active tokens (unused without a bias)"),
)
STATE = tuple(f.name for f in STATE_FIELDS)

_STATE_ARGS = ", ".join(f"Tensor({chr(ord('a') + i)}!) {name}" for i, name in enumerate(STATE))

#: torch.library schema of every op (``Tensor?``: may be None; ``(x!)``: mutated in place).
SCHEMAS: dict[str, str] = {
    "observe": f"(Tensor token_ids, Tensor weight, Tensor? bias, {_STATE_ARGS}, int num_pinned) -> ()",
    "compact_logits": "(Tensor x, Tensor cache_w, Tensor? cache_b, Tensor cursor) -> Tensor",
    "scatter_logits": "(Tensor compact, Tensor ids, Tensor cursor, int vocab_size) -> Tensor",
    "head_logits": "(Tensor x, Tensor cache_w, Tensor? cache_b, Tensor ids, Tensor cursor, int vocab_size) -> Tensor",
    "compact_topk": "(Tensor compact, Tensor ids, Tensor cursor, int k, bool largest=True) -> (Tensor, Tensor)",
    "compact_argmax": "(Tensor compact, Tensor ids, Tensor cursor) -> Tensor",
}
OPS = tuple(SCHEMAS)

_ARG = re.compile(r"^\s*(?P<type>[\w?\[\]]+(?:\([a-z]!\))?)\s+(?P<name>\w+)(?:\s*=.*)?$")


def arguments(op: str) -> tuple[str, ...]:
    """Argument names of ``op`` in order."""
    inner = SCHEMAS[op].split("->")[0].strip()[1:-1]
    return tuple(_ARG.match(a).group("name") for a in inner.split(","))


def mutated(op: str) -> tuple[str, ...]:
    """Arguments ``op`` writes in place."""
    inner = SCHEMAS[op].split("->")[0].strip()[1:-1]
    return tuple(m.group("name") for a in inner.split(",") if "!)" in a and (m := _ARG.match(a)))


def new_state(vocab: int, hidden: int, capacity: int, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Empty state tensors in :data:`STATE` order (tests and benchmarks; ActiveVocab builds its own)."""
    fill = {"ids": -1, "slot_of": -1, "cursor": 0, "cache_w": 0, "cache_b": 0}
    shape = {"ids": (capacity,), "slot_of": (vocab,), "cursor": (1,), "cache_w": (capacity, hidden), "cache_b": (capacity,)}
    return [torch.full(shape[f.name], fill[f.name], dtype=f.dtype or dtype, device=device) for f in STATE_FIELDS]


def check_num_pinned(num_pinned: int, capacity: int) -> None:
    """``observe`` needs a ring of at least one slot: a GPU would take a modulo by zero otherwise."""
    if not 0 <= num_pinned < capacity:
        raise ValueError(f"num_pinned must be in [0, capacity={capacity}), got {num_pinned}")
