"""Which calls project a hidden state onto a weight: the LM head's candidates, in every spelling Dynamo records.

``linear``/``F.linear`` (bias optional), ``matmul``/``@``/``mm`` against a transposed 2-D weight, ``addmm`` with a
bias per output (scaled by ``alpha``/``beta`` or not), ``bmm``/``baddbmm`` with the weight broadcast along the
batch, a head ``einsum``, and the same with a parameter stored [H, N] (``x @ W``, ``F.linear(x, W.t())``).
The weight returned is always the stored tensor's node: the state is keyed on it (a view is a new object every
call), and :func:`projection_transposed` says whether its columns are the head's rows.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from .graph import call_arg, node_name
from .patterns import LINEAR_TARGETS, MATMUL_TARGETS, is_call, known_equal, tensor_shape

# The 2-D transposes, however Dynamo spells them: a Tensor method (``call_method``), a torch function, a
# Tensor method used as a function (``torch.Tensor.t``), an aten op (torch >= 2.14 records ``W.T`` / ``W.mT``
# as ``aten.numpy_T`` / ``aten.mT``), or an attribute read (``getattr(W, "T")``). Names only; the arguments
# are checked below.
_SWAP_ALL = {"t", "T", "mT", "numpy_T", "t_copy"}  # of a 2-D tensor: swap both axes, no arguments
_SWAP_DIMS = {"transpose", "transpose_copy", "swapaxes", "swapdims"}  # (dim0, dim1)
_PERMUTE = {"permute", "permute_copy"}  # (dims...) or ((dims),)
_TORCH_TRANSPOSES = {getattr(owner, n) for owner in (torch, torch.Tensor) for n in (*_SWAP_ALL, *_SWAP_DIMS, *_PERMUTE)
                     if hasattr(owner, n)}


def _transpose_name(node: fx.Node) -> str | None:
    """The name a transpose is called by (``"t"``, ``"numpy_T"``, ``"transpose"``...) in any spelling above; None
    for a call of any other function (a user's own function named ``t`` is no transpose)."""
    if node.op == "call_function" and node.target is not getattr and node.target not in _TORCH_TRANSPOSES \
            and not isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return None
    return node_name(node, attribute=True)


def transposed_weight(node: Any) -> fx.Node | None:
    """``W`` when ``node`` is ``W.t()``, ``W.T``, ``W.mT``, ``W.transpose(0, 1)`` (``swapaxes``, negative dims),
    ``W.permute(1, 0)`` of a 2-D ``W``, in any of the spellings :func:`_transpose_name` reads."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    name, args = (_transpose_name(node),
                  node.args[2:] if node.op == "call_function" and node.target is getattr else node.args[1:])
    src = node.args[0]
    if name in _SWAP_ALL:
        ok = not args and not node.kwargs
    elif name in _SWAP_DIMS:
        dims = [node.kwargs.get(k, a) for k, a in zip(("dim0", "dim1"), list(args) + [None] * 2)]
        ok = all(isinstance(d, int) for d in dims) and sorted(d % 2 for d in dims) == [0, 1]
    elif name in _PERMUTE:
        dims = tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else tuple(args)
        dims = node.kwargs.get("dims", dims)
        ok = all(isinstance(d, int) for d in dims) and tuple(d % 2 for d in dims) == (1, 0)
    else:
        ok = False
    if ok and tensor_shape(src) is not None and len(tensor_shape(src)) == 2:
        return src
    return None


def match_projection(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """``(x, weight, bias)`` when ``node`` projects x [..., H] with a 2-D weight: stored [N, H] (``F.linear(x, W)``,
    ``x @ W.t()``) or, see :func:`projection_transposed`, a parameter/buffer stored [H, N] (``x @ W``,
    ``torch.matmul(x, W)``, ``F.linear(x, W.t())`` in any spelling of the transpose). ``weight`` is the stored
    tensor's node: the state is keyed on it (a view is a new object every call)."""
    m = _match_projection(node)
    return m[:3] if m is not None else None


def projection_transposed(node: fx.Node) -> bool:
    """Whether the weight :func:`match_projection` returns for ``node`` is stored [H, N] (its columns are the
    head's rows)."""
    m = _match_projection(node)
    return m is not None and m[3]


def projection_shape(node: fx.Node) -> tuple | None:
    """``(N, H)`` of the projection ``node`` (outputs, inputs), whatever its weight's layout."""
    m = _match_projection(node)
    shape = tensor_shape(m[1]) if m is not None else None
    if shape is None or len(shape) != 2:
        return None
    return (shape[1], shape[0]) if m[3] else tuple(shape)


def _stored(node: Any) -> bool:
    """A tensor the graph receives (parameter, buffer, input), not one it computes."""
    return isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr")


def _match_projection(node: fx.Node) -> tuple | None:
    """``(x, weight, bias, transposed)``: :func:`match_projection` and :func:`projection_transposed` in one."""
    if node.op == "call_function" and node.target in LINEAR_TARGETS:
        args = list(node.args) + [None] * 3
        x = node.kwargs.get("input", args[0])
        w = node.kwargs.get("weight", args[1])
        b = node.kwargs.get("bias", args[2])
        if isinstance(w, fx.Node) and tensor_shape(w) is not None and len(tensor_shape(w)) == 2:
            stored = transposed_weight(w)
            if _stored(stored):  # F.linear(x, W.t()): W [H, N]
                return x, stored, b if isinstance(b, fx.Node) else None, True
            return x, w, b if isinstance(b, fx.Node) else None, False
        return None
    if is_call(node, MATMUL_TARGETS | {torch.mm}, {"matmul", "__matmul__", "mm"}) and len(node.args) == 2:
        return _match_matmul(node.args[0], node.args[1])
    if is_call(node, BMM_TARGETS, {"bmm"}) and len(node.args) == 2:  # bmm(x, W.t().expand(B, H, N))
        return _match_matmul(node.args[0], _unbatched(node.args[1]))
    if is_call(node, ADDMM_TARGETS, {"addmm"}):
        return _match_addmm(node)
    if is_call(node, BADDBMM_TARGETS, {"baddbmm"}):
        return _match_addmm(node, batched=True)
    if node.op == "call_function" and node.target in EINSUM_TARGETS and node.args and isinstance(node.args[0], str):
        operands = node.args[1:]
        if len(operands) == 1 and isinstance(operands[0], (tuple, list)):
            operands = tuple(operands[0])
        if len(operands) == 2:
            x, w = _head_operands(node.args[0], *operands)
            if isinstance(w, fx.Node) and tensor_shape(w) is not None and len(tensor_shape(w)) == 2:
                return x, w, None, False
    return None


ADDMM_TARGETS = {torch.addmm}
BADDBMM_TARGETS = {torch.baddbmm}
BMM_TARGETS = {torch.bmm}


def _match_matmul(x: Any, m2: Any) -> tuple | None:
    """``x @ m2`` as a projection: ``m2`` a transposed 2-D weight (``W.t()``), or a stored ``W`` [H, N]."""
    if not isinstance(m2, fx.Node):
        return None
    w = transposed_weight(m2)
    if w is not None:
        return x, w, None, False
    x_shape, w_shape = tensor_shape(x), tensor_shape(m2)
    if _stored(m2) and w_shape is not None and len(w_shape) == 2 and x_shape and len(x_shape) >= 1 \
            and known_equal(x_shape[-1], w_shape[0]):  # x @ W, W [H, N]
        return x, m2, None, True
    return None


def _unbatched(node: Any) -> fx.Node | None:
    """``M`` when ``node`` is the 2-D ``M`` broadcast along a new leading batch axis (``M.expand(B, H, N)``,
    ``M[None].expand(B, -1, -1)``, ``M.unsqueeze(0).expand(...)``, ``torch.broadcast_to``): every batch entry of a
    ``bmm``/``baddbmm`` operand is then ``M`` itself, so the batched product is ``x @ M``."""
    if not isinstance(node, fx.Node) or node_name(node) not in ("expand", "broadcast_to") or not node.args:
        return None
    src, out = node.args[0], tensor_shape(node)
    shape = tensor_shape(src)
    if isinstance(src, fx.Node) and shape is not None and len(shape) == 3 and shape[0] == 1 and src.args and (
            node_name(src) == "unsqueeze" and call_arg(src, 1, "dim") == 0
            or node_name(src) == "getitem" and src.args[1] in ((None,), None, (None, Ellipsis))):
        src = src.args[0]
        shape = tensor_shape(src)
    if shape is None or len(shape) != 2 or out is None or len(out) != 3 or tuple(out[1:]) != tuple(shape):
        return None
    return src


def _scale(value: Any) -> bool:
    """A finite number ``alpha``/``beta`` can be (a symbolic one is not read)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def projection_scales(node: fx.Node) -> tuple:
    """``(alpha, beta)`` of an ``addmm``/``baddbmm`` projection, ``alpha * (x @ W.t()) + beta * b``; ``(1, 1)`` for
    every other projection. The rewrite scales the compact head's input by ``alpha`` and its bias by ``beta``."""
    if is_call(node, ADDMM_TARGETS | BADDBMM_TARGETS, {"addmm", "baddbmm"}):
        return call_arg(node, 99, "alpha", 1), call_arg(node, 99, "beta", 1)
    return 1, 1


def _match_addmm(node: fx.Node, batched: bool = False) -> tuple | None:
    """``torch.addmm(b, x, W.t(), beta=, alpha=)`` (``b.addmm(...)``): ``alpha * (x @ W.t()) + beta * b`` with
    numbers ``alpha``/``beta`` and a bias of one value per output ([N]; any ``b`` when ``beta == 0``: torch ignores
    it); or ``addmm(b, x, W)`` with a stored ``W`` [H, N]. ``batched``: ``torch.baddbmm`` over ``x`` [B, n, H]
    with the weight broadcast along the batch (:func:`_unbatched`)."""
    b, x, m2 = (call_arg(node, 0, "input"), call_arg(node, 1, "batch1" if batched else "mat1"),
                call_arg(node, 2, "batch2" if batched else "mat2"))
    alpha, beta = projection_scales(node)
    if not (_scale(alpha) and _scale(beta)):
        return None
    m = _match_matmul(x, _unbatched(m2) if batched else m2)
    if m is None:
        return None
    w, transposed = m[1], m[3]
    if beta == 0:
        return x, w, None, transposed
    width = tensor_shape(w)[1 if transposed else 0]
    if not isinstance(b, fx.Node) or tensor_shape(b) != (width,):
        return None  # a bias per row of x, or a broadcast scalar: not a head bias
    return x, w, b, transposed


def unmatched_reason(node: fx.Node) -> str | None:
    """Why an ``addmm``/``baddbmm`` onto a weight is no projection nanospec rewrites (its bias or scales), for the
    warning of a head left dense; None for any other node."""
    if not is_call(node, ADDMM_TARGETS | BADDBMM_TARGETS, {"addmm", "baddbmm"}) or _match_projection(node):
        return None
    batched = node_name(node) == "baddbmm"
    m2 = call_arg(node, 2, "batch2" if batched else "mat2")
    if _match_matmul(call_arg(node, 1, "batch1" if batched else "mat1"), _unbatched(m2) if batched else m2) is None:
        return None
    alpha, beta = projection_scales(node)
    if not (_scale(alpha) and _scale(beta)):
        return (f"its {node_name(node)} scales the product or the bias by a value known only at run time "
                f"({alpha}, {beta})")
    return (f"its {node_name(node)} adds a tensor that is not one bias value per output token (a [V] vector): "
            "nanospec cannot gather it at the active tokens")


def _head_operands(equation: str, a: Any, b: Any) -> tuple:
    """``(x, W)`` of a head einsum in either operand order (``"...h,vh->...v"`` with ``(h, W)``, or
    ``"vh,...h->...v"`` with ``(W, h)``), ``(None, None)`` when it is none."""
    eq = equation.replace(" ", "")
    if _is_head_equation(eq):
        return a, b
    if eq.count("->") == 1 and eq.count(",") == 1:
        lhs, out = eq.split("->")
        first, second = lhs.split(",")
        if _is_head_equation(f"{second},{first}->{out}"):
            return b, a
    return None, None


EINSUM_TARGETS = {torch.einsum, torch.functional.einsum}


def _is_head_equation(equation: str) -> bool:
    """``"...h,vh->...v"`` / ``"bth,vh->btv"``: x's last axis contracted with W's second, W's first appended."""
    eq = equation.replace(" ", "")
    if eq.count("->") != 1 or eq.count(",") != 1:
        return False
    lhs, out = eq.split("->")
    a, b = lhs.split(",")
    if len(b) != 2 or not a or b[1] != a[-1] or b[0] == b[1] or b[0] in a:
        return False
    return out == a[:-1] + b[0]
