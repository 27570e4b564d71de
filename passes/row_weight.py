"""A head weight computed in the graph row by row from stored tensors: compute only the active rows.

Weight-only quantised heads (``F.linear(h, W.to(h.dtype) * s[:, None])``, int8 or float8 ``W`` [V, H] and a
per-row scale ``s`` [V] or [V, 1], or a per-tensor scalar) and heads behind ``torch.nn.utils.parametrize``
(``W / W.norm(dim=-1, keepdim=True)``, ``weight_norm``) build their [V, H] weight in the graph on every call.
When every row ``i`` of that weight depends only on row ``i`` of its [V, ...] inputs, the rows of the active
tokens are the same expression evaluated on the gathered rows, bit for bit: the rewrite replays it on the
state's cached rows of the *base* (the stored [V, H] tensor the state is keyed on, e.g. the int8 weight) and on
the [V] / [V, 1] operands gathered at the active ids, and never builds the [V, H] weight.

Row-wise is proven per node, on shapes, never assumed (anything else: the head runs dense with a warning):

* leaves are tensors the graph receives; one with V rows is a *row* tensor ([V, k], gathered), a [V] vector
  is a per-row *vector*; any other tensor must broadcast the same to every row ([1, H], [H], a scalar);
* an elementwise op (casts included) of row tensors and constants is a row tensor (a [V] vector next to a
  [V, H] tensor would broadcast along H: not row-wise, refused); of vectors and scalars, a vector;
* ``v[:, None]``, ``v.unsqueeze(-1)``, ``v.view(-1, 1)`` / ``reshape(V, 1)`` turn a vector into a [V, 1] row
  tensor; a reduction over the last axis (``sum``, ``mean``, ``amax``, ``amin``, ``norm``,
  ``linalg.vector_norm``, ``logsumexp``, ``std``, ``var``) of a row tensor is a row tensor ([V, 1], keepdim)
  or a vector; ``F.normalize(W, dim=-1)`` and ``torch._weight_norm(v, g, 0)`` (``weight_norm``) are row-wise;
  ``contiguous``, ``clone`` and ``detach`` keep the kind. No op may write in place.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from . import effects, patterns
from .graph import node_name

_REDUCTIONS = {"sum", "mean", "amax", "amin", "norm", "vector_norm", "logsumexp", "std", "var"}
_KEEP = {"contiguous", "clone", "detach"}


@dataclass
class RowWeight:
    """How a computed head weight is made: its node, the base leaf whose rows the state caches, and every node
    of the expression in graph order (leaves excluded), with each leaf's kind (``"row"``/``"vec"``/``"const"``)."""

    weight: fx.Node
    base: fx.Node
    nodes: list[fx.Node]
    leaves: dict[fx.Node, str]


def row_weight(weight: fx.Node, rows: int) -> RowWeight | None:
    """The row-wise expression computing ``weight`` ([rows, H]) from tensors the graph receives, or None."""
    shape = patterns.tensor_shape(weight)
    if not isinstance(weight, fx.Node) or weight.op not in ("call_function", "call_method") or shape is None \
            or len(shape) != 2 or shape[0] != rows:
        return None
    kinds: dict[fx.Node, str] = {}
    order: list[fx.Node] = []
    if _kind(weight, rows, kinds, order) != "row":
        return None
    leaves = {n: k for n, k in kinds.items() if n.op in ("placeholder", "get_attr")}
    base = next((n for n, k in leaves.items() if k == "row" and patterns.tensor_shape(n) == shape), None)
    if base is None:
        return None
    return RowWeight(weight, base, order, leaves)


def _kind(node, rows: int, kinds: dict, order: list) -> str | None:
    """``"row"``, ``"vec"`` or ``"const"`` for ``node`` (memoised in ``kinds``; ``order`` gets computed nodes
    after their inputs), None when row-wise cannot be proven."""
    if not isinstance(node, fx.Node):
        return "const" if node is None or isinstance(node, (int, float, bool, torch.dtype, torch.device, str,
                                                           slice, type(Ellipsis))) else None
    if node in kinds:
        return kinds[node]
    shape = patterns.tensor_shape(node)
    if node.op in ("placeholder", "get_attr"):
        kind = _leaf_kind(shape, rows)
    elif node.op in ("call_function", "call_method") and not effects.mutated_inputs(node):
        operands = node.all_input_nodes
        if node.op == "call_method" and node.target in ("to", "type_as") and node.args and \
                isinstance(node.args[0], fx.Node):
            operands = [node.args[0]]  # ``W.to(h)``, ``W.type_as(h)``: h gives a dtype only
        inputs = {a: _kind(a, rows, kinds, order) for a in operands}
        kind = None if None in inputs.values() else _op_kind(node, inputs, shape, rows)
        if kind is not None:
            order.append(node)
    else:
        kind = None
    if kind is not None:
        kinds[node] = kind
    return kind


def _leaf_kind(shape, rows: int) -> str | None:
    if shape is None:
        return "const"  # a SymInt / number input
    if len(shape) == 2 and shape[0] == rows:
        return "row"
    if len(shape) == 1 and shape[0] == rows:
        return "vec"
    return "const" if _broadcasts_to_rows(shape) else None


def _broadcasts_to_rows(shape) -> bool:
    """The same value for every row of a [V, H] tensor: a scalar, [H] / [1], or [1, H] / [1, 1]."""
    return len(shape) <= 1 or (len(shape) == 2 and shape[0] == 1)


_RANDOM = {"rrelu", "bernoulli", "dropout", "alpha_dropout", "feature_alpha_dropout", "native_dropout", "normal",
           "uniform", "exponential", "poisson", "cauchy", "geometric", "log_normal", "rand_like", "randn_like",
           "randint_like", "multinomial"}


def _op_kind(node: fx.Node, inputs: dict, shape, rows: int) -> str | None:
    name = node_name(node, attribute=True) or ""
    if shape is None or name.rstrip("_") in _RANDOM:  # rrelu is pointwise, but not the same twice
        return None
    kinds = set(inputs.values())
    first = node.args[0] if node.args else None
    if name in _KEEP and len(inputs) == 1:
        return inputs[first]
    if patterns.is_elementwise(node) or patterns.is_call(node, set(), {"to", "type", "type_as"}):
        if "row" in kinds:
            return "row" if "vec" not in kinds and len(shape) == 2 and shape[0] == rows else None
        if "vec" in kinds:
            scalars = all(k == "vec" or _scalar(a) for a, k in inputs.items())
            return "vec" if scalars and tuple(shape) == (rows,) else None
        return "const" if _broadcasts_to_rows(shape) else None
    if inputs.get(first) == "vec" and tuple(shape) == (rows, 1) and _column_of(node):
        return "row"
    if inputs.get(first) == "row" and kinds == {"row"} and _reduces_last_axis(node, name):
        return "row" if tuple(shape) == (rows, 1) else "vec" if tuple(shape) == (rows,) else None
    if node.op == "call_function" and node.target is torch.nn.functional.normalize and kinds == {"row"}:
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 1)
        return "row" if dim in (1, -1) and len(shape) == 2 else None
    if node.op == "call_function" and node.target is torch._weight_norm and kinds == {"row"}:
        dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
        return "row" if dim == 0 and len(shape) == 2 and shape[0] == rows else None
    if kinds == {"const"} and _broadcasts_to_rows(shape):
        return "const"
    return None


def _scalar(node) -> bool:
    shape = patterns.tensor_shape(node)
    return not isinstance(node, fx.Node) or shape is None or len(shape) == 0


def _column_of(node: fx.Node) -> bool:
    """``v[:, None]``, ``v.unsqueeze(1 | -1)``, ``v.view(-1, 1)`` / ``reshape``: a [V] vector as [V, 1]."""
    name = node_name(node, attribute=True)
    args = node.args[1:]
    if node.op == "call_function" and node.target is operator.getitem:
        idx = node.args[1]
        return isinstance(idx, tuple) and len(idx) == 2 and idx[0] == slice(None) and idx[1] is None
    if name == "unsqueeze":
        dim = node.kwargs.get("dim", args[0] if args else None)
        return dim in (1, -1)
    if name in ("view", "reshape"):
        dims = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        return len(dims) == 2 and dims[1] == 1
    return False


def _reduces_last_axis(node: fx.Node, name: str | None) -> bool:
    if name not in _REDUCTIONS:
        return False
    args = node.args[1:]
    if name == "norm":  # Tensor.norm(p, dim, keepdim) / torch.norm(input, p, dim, keepdim)
        dim = node.kwargs.get("dim", args[1] if len(args) > 1 else None)
    elif name == "vector_norm":  # linalg.vector_norm(x, ord, dim, keepdim)
        dim = node.kwargs.get("dim", args[1] if len(args) > 1 else None)
    else:
        dim = node.kwargs.get("dim", args[0] if args else None)
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    return dim in (1, -1)


def gathered_rows(graph: fx.Graph, rw: RowWeight, cached: fx.Node, safe_ids: fx.Node, ids: fx.Node) -> fx.Node:
    """Replay ``rw`` at the graph's insertion point on the active rows: the base is ``cached`` (the state's
    [C, H] rows of it), every other row tensor and vector is gathered at ``safe_ids``; returns the [C, H] rows,
    zero at slots never filled (``ids`` -1: a zero cached row through ``W / W.norm()`` is NaN, and a NaN row
    would reach the hidden state's gradient through the masked slot: 0 * NaN)."""
    env: dict[fx.Node, fx.Node] = {}
    for leaf, kind in rw.leaves.items():
        if leaf is rw.base:
            env[leaf] = cached
        elif kind in ("row", "vec"):
            env[leaf] = graph.call_function(torch.index_select, (leaf, 0, safe_ids))
            env[leaf].meta["nanospec_active_rows"] = True  # reads rows of the active set: no token lookup to observe
            patterns.set_example_value(env[leaf])
    for node in rw.nodes:
        env[node] = graph.node_copy(node, lambda a: env.get(a, a))
        patterns.set_example_value(env[node])
    unfilled = graph.call_function(operator.lt, (ids, 0))
    column = graph.call_method("unsqueeze", (unfilled, -1))
    rows = graph.call_method("masked_fill", (env[rw.weight], column, 0))
    for node in (unfilled, column, rows):
        patterns.set_example_value(node)
    return rows
