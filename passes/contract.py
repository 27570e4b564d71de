"""What the passes and the backend hand each other: the state's graph inputs, where observed ids go, what the
rewrite did, and the refusal that makes a head run dense. Types only: every stage imports them, they import no pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx


class DenseFallback(Exception):
    """The head cannot be rewritten soundly here; the message names the op and its place."""


class DenseHead(str):
    """A note of the head finder that is one head's dense reason (a projection onto the vocabulary whose weight is
    computed in the graph, not row-wise): the backend says it as that head's reason, not as a graph without a head."""

    head: str

    def __new__(cls, head: str, reason: str) -> "DenseHead":
        note = super().__new__(cls, reason)
        note.head = head
        return note


@dataclass
class StateNodes:
    """Placeholders through which the compiled graph receives one ActiveVocab's tensors."""

    ids: fx.Node
    slot_of: fx.Node
    cursor: fx.Node
    cache_w: fx.Node
    cache_b: fx.Node


@dataclass
class RewriteReport:
    """What the rewrite did to one head (shown by ``nanospec_fx.explain``)."""

    head: str  # the weight's parameter name
    module_path: str | None
    vocab_size: int
    hidden_size: int
    projections: int
    post_ops: list[str]  # ops run on the compact logits
    exits: list[str]  # users that read the [..., V] logits (after a scatter)
    consumers: list[str]  # top-k / argmax (/ softmax) run on the compact logits
    observers: int = 0  # observe ops inserted on token-id inputs
    materialised: list[str] = field(default_factory=list)  # ops that write or alias the logits: [..., V] built there
    chain_outputs: int = 0  # graph outputs that hold logits of the chain (-inf at inactive tokens)


@dataclass
class ObserveInto:
    """Where observed tokens go: an ActiveVocab's tensors and the head they copy rows from."""

    weight: fx.Node
    bias: fx.Node | None
    state: StateNodes
    num_pinned: int
    vocab_size: int  # size of the token-id space observed
    token_to_row: fx.Node | None = None  # token id -> head row map (EAGLE-3 draft vocabularies)
    transposed: bool = False  # ``weight`` is stored [H, V] (``h @ W``): observers copy its columns
    #: the state is a vocabulary-parallel head's (tensor_parallel): a lookup into a ``V / tp``-row table at
    #: ``ids - start`` is its token embedding's shard, and ``ids`` are tokens (:func:`sharded_token_lookups`)
    sharded: bool = False
    stacked: tuple = ()  # ``weight`` is K stacked heads (``stacked_heads``), its V, K, H axes: K rows per token
