"""The one declaration of the nanospec state tensors and of the ops' signatures.

Everything else follows from here: :mod:`kernels.ops` registers each op with the schema string
below, and a test checks that the Python signatures of the op bodies, of the reference
(:mod:`kernels.reference`) and of the Triton wrappers (:mod:`kernels.triton_kernels`) name the
same arguments in the same order. :class:`nanospec_fx.ActiveVocab` hands its tensors over in
:data:`STATE` order. The FX passes build and read op calls through :func:`op_call` / :func:`op_arg` with
the argument names declared here, never by position.
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

#: torch.library schema of every op (``Tensor?``: may be None; ``(x!)``: mutated in place). Every op ends with
#: ``rows``: None for the shared set (the state above), or the request row of each batch row for a per-request state
#: (the same fields with a leading request axis, :data:`REQUEST_STATE_FIELDS`; :mod:`kernels.request_rows`).
SCHEMAS: dict[str, str] = {
    "observe": (f"(Tensor token_ids, Tensor weight, Tensor? bias, {_STATE_ARGS}, int num_pinned, "
                "Tensor? rows=None) -> ()"),
    "compact_logits": "(Tensor x, Tensor cache_w, Tensor? cache_b, Tensor cursor, Tensor? rows=None) -> Tensor",
    "scatter_logits": "(Tensor compact, Tensor ids, Tensor cursor, int vocab_size, Tensor? rows=None) -> Tensor",
    "head_logits": "(Tensor x, Tensor cache_w, Tensor? cache_b, Tensor ids, Tensor cursor, int vocab_size, "
                   "Tensor? rows=None) -> Tensor",
    "compact_topk":
        "(Tensor compact, Tensor ids, Tensor cursor, int k, bool largest=True, Tensor? rows=None) -> (Tensor, Tensor)",
    "compact_argmax": "(Tensor compact, Tensor ids, Tensor cursor, Tensor? rows=None) -> Tensor",
}
OPS = tuple(SCHEMAS)

#: Per-request state (:class:`nanospec_fx.vocab.request_vocab.RequestVocabs`): the same fields with one row per request.
REQUEST_STATE_FIELDS = tuple(
    StateField(f.name, f.dtype, "[R]" if f.name == "cursor" else f"[R, {f.shape[1:-1]}]", f.meaning)
    for f in STATE_FIELDS
)


def schema_of(op: str) -> str:
    """The declared schema string of ``op``."""
    return SCHEMAS[op]


_ARG = re.compile(r"^\s*(?P<type>[\w?\[\]]+(?:\([a-z]!\))?)\s+(?P<name>\w+)(?P<default>\s*=.*)?$")


def _parsed(schema: str) -> list[re.Match]:
    return [_ARG.match(a) for a in schema.split("->")[0].strip()[1:-1].split(",")]


def arguments(op: str) -> tuple[str, ...]:
    """Argument names of ``op`` in order."""
    return tuple(m.group("name") for m in _parsed(schema_of(op)))


def mutated(op: str) -> tuple[str, ...]:
    """Arguments ``op`` writes in place."""
    return tuple(m.group("name") for m in _parsed(schema_of(op)) if "!)" in m.group("type"))


class OpSignature:
    """Builds and reads FX call nodes of one op by the argument names its schema declares, so the
    passes never write an argument position: a renamed or missing argument fails at the first build,
    a reordered one moves every emitted call and every read with it."""

    def __init__(self, op: str, schema: str | None = None):
        if op not in SCHEMAS and schema is None:
            raise KeyError(f"nanospec op {op!r} is not declared in kernels/schema.py (declared: {', '.join(OPS)})")
        self.op = op
        parsed = _parsed(SCHEMAS[op] if schema is None else schema)
        self.names = tuple(m.group("name") for m in parsed)
        self.optional = frozenset(m.group("name") for m in parsed if m.group("default"))

    @property
    def target(self):
        """The op's overload in the graph (``kernels.ops`` registers it)."""
        return getattr(torch.ops.nanospec, self.op).default

    def args(self, **given) -> tuple:
        """``given`` as the op's positional arguments, in declared order (a trailing default may be left out)."""
        unknown = [n for n in given if n not in self.names]
        if unknown:
            raise TypeError(f"nanospec.{self.op} declares no argument {', '.join(unknown)}; it takes {self.names}")
        last = max((self.names.index(n) for n in given), default=-1)
        missing = [n for i, n in enumerate(self.names) if n not in given and (i <= last or n not in self.optional)]
        if missing:
            raise TypeError(f"nanospec.{self.op}: argument(s) {', '.join(missing)} not given; it takes {self.names}")
        return tuple(given[n] for n in self.names[:last + 1])

    def call(self, graph, **given):
        """A ``call_function`` node of this op at ``graph``'s insertion point."""
        return graph.call_function(self.target, self.args(**given))

    def index(self, name: str) -> int:
        """Position of argument ``name`` in a call built by :meth:`call`."""
        if name not in self.names:
            raise TypeError(f"nanospec.{self.op} declares no argument {name}; it takes {self.names}")
        return self.names.index(name)


#: One signature per declared op (built at import: a malformed declaration fails here).
SIGNATURES: dict[str, OpSignature] = {op: OpSignature(op) for op in OPS}


def op_call(graph, op: str, **given):
    """``graph.call_function(torch.ops.nanospec.<op>.default, ...)`` with arguments named as in :data:`SCHEMAS`."""
    return signature(op).call(graph, **given)


def signature(op: str) -> OpSignature:
    """The declared signature of ``op`` (``KeyError`` naming the declared ops if there is none)."""
    if op not in SIGNATURES:
        raise KeyError(f"nanospec op {op!r} is not declared in kernels/schema.py (declared: {', '.join(OPS)})")
    return SIGNATURES[op]


def is_op(node, op: str) -> bool:
    """``node`` calls ``torch.ops.nanospec.<op>`` (checked against the declared names)."""
    signature(op)
    target = getattr(node, "target", None)
    return getattr(node, "op", None) == "call_function" and isinstance(target, torch._ops.OpOverload) \
        and target.namespace == "nanospec" and target._opname == op


def op_arg(node, name: str):
    """Argument ``name`` of a call node of a nanospec op, found by its declared position."""
    target = node.target
    if not (isinstance(target, torch._ops.OpOverload) and target.namespace == "nanospec"):
        raise TypeError(f"{node.name} does not call a nanospec op (it calls {target})")
    return node.args[signature(target._opname).index(name)]


def new_state(vocab: int, hidden: int, capacity: int, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Empty state tensors in :data:`STATE` order (tests and benchmarks; ActiveVocab builds its own)."""
    fill = {"ids": -1, "slot_of": -1, "cursor": 0, "cache_w": 0, "cache_b": 0}
    shape = {"ids": (capacity,), "slot_of": (vocab,), "cursor": (1,),
             "cache_w": (capacity, hidden), "cache_b": (capacity,)}
    return [torch.full(shape[f.name], fill[f.name], dtype=f.dtype or dtype, device=device) for f in STATE_FIELDS]


def check_num_pinned(num_pinned: int, capacity: int) -> None:
    """``observe`` needs a ring of at least one slot: a GPU would take a modulo by zero otherwise."""
    if not 0 <= num_pinned < capacity:
        raise ValueError(f"num_pinned must be in [0, capacity={capacity}), got {num_pinned}")


def new_request_state(
    requests: int, vocab: int, hidden: int, capacity: int, dtype: torch.dtype, device
) -> list[torch.Tensor]:
    """Empty per-request state tensors in :data:`STATE` order, one row per request (:data:`REQUEST_STATE_FIELDS`)."""
    one = new_state(vocab, hidden, capacity, dtype, device)
    one[STATE.index("cursor")] = one[STATE.index("cursor")].reshape(())
    return [t.expand(requests, *t.shape).contiguous() for t in one]
