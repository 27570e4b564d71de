"""Medusa heads stacked in one weight: K heads ``[K, V, H]`` (or ``[K, H, V]``) applied by one einsum or matmul.

``torch.einsum("bh,kvh->bkv", h, W)`` (every head reads one hidden state), ``"bth,kvh->btkv"``, ``"kbh,kvh->kbv"``
(each head its own hidden state), ``"bh,khv->bkv"`` (stored [K, H, V]), ``"bh,kvh->bvk"`` (V not last),
``torch.matmul(h.unsqueeze(1), W.mT)`` / ``h[:, None] @ W.transpose(-1, -2)`` / ``torch.bmm(hk, W.transpose(1, 2))`` /
``h @ W`` (stored [K, H, V]): one contraction over H with a stored 3-D weight, the stacked axis K and the vocabulary
axis V both kept in the output (V the wider of the two). Each is written here as one einsum equation over the
weight's stored axes (:class:`StackedProjection`).

Head k of the stack is ``W[k]``; the K heads are one weight, so they read **one** active set (one state per head
weight, as every head): the state caches, for each active token v, the K rows ``W[:, v, :]`` (``cache_w [C, K, H]``,
:class:`nanospec_fx.ActiveVocab` with ``stacked=True``), and the compact head is the same equation over that cache,
with the slot axis last (:func:`compact_equation`; moved where the output holds V by :func:`to_head_layout`): logits
of head k at slot s are ``W[k, ids[s]] . h``, the same products as the dense head's at the active tokens, and -inf
past the count. A spelling this module does not read (the weight contracted over two axes, a diagonal, a weight
computed in the graph) is no head: the graph runs unchanged, with one warning naming the stacked weight
(``find_head``, :func:`stacked_operand`).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from nanospec_fx.kernels.schema import is_op, op_arg

from .graph import node_name
from .patterns import MATMUL_TARGETS, is_call, known_equal, tensor_shape
from .projections import EINSUM_TARGETS, BMM_TARGETS

#: meta of the compact einsum of a stacked head: the cursor of the state it reads (never matched as a head again)
COMPACT_OF = "nanospec_stacked_compact_of"


@dataclass(frozen=True)
class StackedProjection:
    """``einsum(f"{x_spec},{w_spec}->{out_spec}", x, weight)`` (``x`` squeezed at ``squeeze`` first when not None):
    ``weight`` the stored [K, V, H]-like tensor, ``w_spec`` its axes in stored order; ``k``, ``v``, ``h`` the letters
    of its stacked, vocabulary and hidden axes."""

    x: fx.Node
    weight: fx.Node
    x_spec: str
    w_spec: str
    out_spec: str
    k: str
    v: str
    h: str
    squeeze: int | None = None

    @property
    def axes(self) -> tuple:
        """The positions of the weight's V, K and H axes (``ActiveVocab(stacked=...)``: ``permute(*axes)`` is the
        weight as [V, K, H])."""
        return tuple(self.w_spec.index(c) for c in (self.v, self.k, self.h))

    @property
    def heads(self) -> int:
        return tensor_shape(self.weight)[self.w_spec.index(self.k)]

    @property
    def vocab_size(self) -> int:
        return tensor_shape(self.weight)[self.w_spec.index(self.v)]

    @property
    def hidden_size(self) -> int:
        return tensor_shape(self.weight)[self.w_spec.index(self.h)]


def compact_equation(p: StackedProjection) -> str:
    """The equation of the compact head over the state's cache ``[C, K, H]``, the slot axis last (the compact logits'
    vocabulary axis is last; :func:`compact_stacked` moves it where V was)."""
    return f"{p.x_spec},{p.v}{p.k}{p.h}->{p.out_spec.replace(p.v, '')}{p.v}"


def vocab_axis(p: StackedProjection) -> int:
    """Where the output holds V, counted from the end (-1: last)."""
    return p.out_spec.index(p.v) - len(p.out_spec)


def match_stacked(node: fx.Node) -> StackedProjection | None:
    """The stacked-head projection ``node`` computes, or None (see the module docstring)."""
    if node.meta.get(COMPACT_OF) is not None:
        return None
    if node.op == "call_function" and node.target in EINSUM_TARGETS and node.args and isinstance(node.args[0], str):
        operands = node.args[1:]
        if len(operands) == 1 and isinstance(operands[0], (tuple, list)):
            operands = tuple(operands[0])
        if len(operands) != 2 or not all(isinstance(o, fx.Node) for o in operands):
            return None
        eq = node.args[0].replace(" ", "")
        if eq.count("->") != 1 or eq.count(",") != 1:
            return None
        lhs, out = eq.split("->")
        a, b = lhs.split(",")
        found = [f for x, w, xs, ws in ((operands[0], operands[1], a, b), (operands[1], operands[0], b, a))
                 if (f := _from_specs(x, w, xs, ws, out)) is not None]
        stored = [f for f in found if f.weight.op in ("placeholder", "get_attr")]  # the weight is what is stored
        return (stored or found or [None])[0]
    if is_call(node, MATMUL_TARGETS | BMM_TARGETS, {"matmul", "__matmul__", "bmm"}) and len(node.args) == 2:
        return _from_matmul(node.args[0], node.args[1])
    return None


def _from_specs(x: Any, w: Any, xs: str, ws: str, out: str, squeeze: int | None = None) -> StackedProjection | None:
    w_shape, x_shape = tensor_shape(w), tensor_shape(x)
    if x_shape is not None and squeeze is not None:
        x_shape = tuple(x_shape[:squeeze]) + tuple(x_shape[squeeze + 1:])
    if w_shape is None or x_shape is None or len(w_shape) != 3 or len(ws) != 3 or "." in ws:
        return None
    x_letters = xs.replace("...", "")
    out_letters = out.replace("...", "")
    if not (ws + x_letters + out_letters).isalpha() or len(set(ws)) != 3 or len(set(x_letters)) != len(x_letters) \
            or len(set(out_letters)) != len(out_letters) or ("..." in xs) != ("..." in out) \
            or xs.count("...") > 1 or out.count("...") > 1:
        return None
    contracted = [c for c in ws if c not in out]
    if len(contracted) != 1 or contracted[0] not in x_letters or not all(isinstance(d, int) for d in w_shape):
        return None
    h = contracted[0]
    kept = [c for c in ws if c != h]  # both in the output: the vocabulary is the wider (K heads are a few; the finder
    if not all(c in out for c in kept):  # checks V against the token tables), the later output axis of a square one
        return None
    v = max(kept, key=lambda c: (w_shape[ws.index(c)], out.index(c)))
    k = next(c for c in kept if c != v)
    # every output axis is one of x's (but h and v) or k; x is summed over h and maybe over axes of its own
    # (``"bth,kvh->bkv"``: the same sum for every token, so over the cached rows too)
    if k not in out or v in x_letters or not set(out_letters) <= (set(x_letters) - {h}) | {k, v}:
        return None
    if h in x_letters and not _same(x_shape, xs, h, w_shape[ws.index(h)]):
        return None
    return StackedProjection(x, w, xs, ws, out, k, v, h, squeeze)


def _same(x_shape, xs: str, letter: str, size: int) -> bool:
    """x's axis ``letter`` has ``size`` entries (read from the end when the spec holds an ellipsis)."""
    if "..." in xs:
        before, after = xs.split("...")
        pos = before.index(letter) if letter in before else len(x_shape) - len(after) + after.index(letter)
    else:
        pos = xs.index(letter)
    return 0 <= pos < len(x_shape) and known_equal(x_shape[pos], size)


def stacked_operand(node: fx.Node) -> fx.Node | None:
    """The stored 3-D tensor an ``einsum``/``matmul``/``bmm`` ``node`` reads (directly or through a transpose of its
    last two axes), whether or not :func:`match_stacked` reads the call: for the warning of one it does not."""
    if node.op == "call_function" and node.target in EINSUM_TARGETS:
        operands = node.args[1:]
        if len(operands) == 1 and isinstance(operands[0], (tuple, list)):
            operands = tuple(operands[0])
    elif is_call(node, MATMUL_TARGETS | BMM_TARGETS, {"matmul", "__matmul__", "bmm"}):
        operands = node.args
    else:
        return None
    for o in operands:
        w = _stacked_transpose(o) or o
        shape = tensor_shape(w) if isinstance(w, fx.Node) else None
        if shape is not None and len(shape) == 3 and w.op in ("placeholder", "get_attr"):
            return w
    return None


def _stacked_transpose(node: Any) -> fx.Node | None:
    """``W`` when ``node`` swaps the last two axes of a 3-D ``W`` (``W.transpose(-1, -2)``, ``.transpose(1, 2)``,
    ``.mT``, ``.permute(0, 2, 1)``, ``swapaxes``)."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    src, name = node.args[0], node_name(node, attribute=True)
    shape = tensor_shape(src)
    if shape is None or len(shape) != 3:
        return None
    if node.op == "call_function" and node.target is getattr:
        return src if name == "mT" else None
    if name == "mT" and len(node.args) == 1 and not node.kwargs:
        return src
    args = node.args[1:]
    if name in ("transpose", "swapaxes", "swapdims"):
        dims = [node.kwargs.get(n, a) for n, a in zip(("dim0", "dim1"), list(args) + [None] * 2)]
        return src if all(isinstance(d, int) for d in dims) and sorted(d % 3 for d in dims) == [1, 2] else None
    if name == "permute":
        dims = tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else tuple(args)
        dims = node.kwargs.get("dims", dims)
        return src if all(isinstance(d, int) for d in dims) and tuple(d % 3 for d in dims) == (0, 2, 1) else None
    return None


def _from_matmul(x: Any, m2: Any) -> StackedProjection | None:
    """``x @ W.mT`` (W stored [K, V, H]) or ``x @ W`` (W stored [K, H, V], a parameter or buffer): batched matmul
    with the stack as the last batch axis; x [m, H], [..., K, m, H] (each head its own rows) or [..., 1, m, H]
    (every head the same rows: squeezed)."""
    w = _stacked_transpose(m2)
    ws = "kvh" if w is not None else "khv"
    if w is None:
        w = m2 if isinstance(m2, fx.Node) and m2.op in ("placeholder", "get_attr") else None
    x_shape = tensor_shape(x)
    if w is None or x_shape is None or len(x_shape) < 2 or len(x_shape) > 8 or tensor_shape(w) is None:
        return None
    heads = tensor_shape(w)[0]
    batch = "abcdefg"[:len(x_shape) - 3] if len(x_shape) >= 3 else ""
    if len(x_shape) == 2:
        return _from_specs(x, w, "mh", ws, "kmv")
    if known_equal(x_shape[-3], heads):
        return _from_specs(x, w, f"{batch}kmh", ws, f"{batch}kmv")
    if known_equal(x_shape[-3], 1):
        return _from_specs(x, w, f"{batch}mh", ws, f"{batch}kmv", squeeze=len(x_shape) - 3)
    return None


def compact_stacked(graph: fx.Graph, p: StackedProjection, x: fx.Node, cache_w: Any, cursor: fx.Node,
                    capacity: int, set_example_value) -> fx.Node:
    """At the insertion point: the stacked head over the cache, ``[..., C]`` (the slot axis last), -inf at slots past
    the count (what ``compact_logits`` gives a one-weight head). When the head's output holds V elsewhere, the
    caller reads it through :func:`to_head_layout` (a ``movedim``: the chain then goes on along the moved axis)."""
    if p.squeeze is not None:
        x = graph.call_method("squeeze", (x, p.squeeze))
        set_example_value(x)
    first = x if p.squeeze is not None else None
    z = graph.call_function(torch.einsum, (compact_equation(p), x, cache_w))
    set_example_value(z)
    device = getattr(getattr(cursor, "meta", {}).get("example_value"), "device", None)
    slots = graph.call_function(torch.arange, (capacity,), {"device": device})
    valid = graph.call_function(operator.lt, (slots, cursor))
    out = graph.call_function(torch.where, (valid, z, float("-inf")))
    for n in (slots, valid, out):
        set_example_value(n)
    parts = [n for n in (first, z, slots, valid) if n is not None]
    for n in (*parts, out):
        n.meta[COMPACT_OF] = cursor
    out.meta[_PARTS] = parts
    return out


_PARTS = "nanospec_stacked_parts"


def to_head_layout(graph: fx.Graph, p: StackedProjection, compact: fx.Node, set_example_value) -> fx.Node:
    """``compact`` with its slot axis moved where the head's output holds V (``compact`` itself when V is last)."""
    axis = vocab_axis(p)
    if axis == -1:
        return compact
    moved = graph.call_method("movedim", (compact, -1, axis))
    set_example_value(moved)
    return moved


def stacked_parts(compact: fx.Node) -> list[fx.Node]:
    """The nodes computing a stacked head's compact logits before ``compact`` (the mask), in graph order, the first
    one first (state snapshots go before it); empty for any other node."""
    return [n for n in compact.meta.get(_PARTS, ()) if n.graph is compact.graph]


def compact_cursor(node: fx.Node) -> fx.Node | None:
    """The cursor of the state a head's compact logits read: a ``compact_logits`` or ``head_logits`` op's argument,
    or a stacked head's compact einsum's (its meta); None for any other node."""
    if node.meta.get(COMPACT_OF) is not None:
        return node.meta[COMPACT_OF]
    if is_op(node, "compact_logits") or is_op(node, "head_logits"):
        return op_arg(node, "cursor")
    return None


def stacked_call(node: fx.Node) -> bool:
    """Whether ``node`` is a stacked head's compact einsum (or its mask) inserted by the rewrite."""
    return node.meta.get(COMPACT_OF) is not None
