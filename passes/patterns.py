"""What the nanospec passes match, and why, in one place.

All matchers work on Dynamo-level FX graphs (``torch.compile`` backends receive those):
parameters are placeholders, an ``nn.Linear`` is ``torch._C._nn.linear(x, w, b)``, and
``x @ W.t()`` is ``operator.matmul(x, t)`` with ``t = W.t()`` (or ``.T``, ``.transpose``).

* **Projections** turn a hidden state [..., H] into [..., N] with a 2-D weight [N, H]:
  ``linear``/``F.linear`` (bias optional, a tied embedding weight included) and
  ``matmul``/``@`` against a transposed 2-D weight. One whose N is the vocabulary size and
  whose output reaches the graph output is the LM head.
* **Post-ops** are elementwise steps drafters apply to logits (temperature ``/ t``, a bias
  ``+ b``, soft-capping ``cap * tanh(z / cap)``, dtype casts) and views that leave the
  vocabulary axis alone (``logits[:, -1]``, ``.view(-1, V)``). They run on the compact
  logits, so inactive tokens come out exactly -inf *after* them.
* **Consumers** read the vocabulary axis (softmax, top-k, argmax, ...). They see the
  full-vocabulary logits with -inf at inactive tokens, so they only pick active tokens.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

LINEAR_TARGETS = {torch._C._nn.linear, torch.nn.functional.linear}
MATMUL_TARGETS = {operator.matmul, torch.matmul}
EMBEDDING_TARGETS = {torch.nn.functional.embedding}

# Elementwise ops that may follow the head. The logits are one operand; any other operand must
# be a number or a tensor that does not depend on the logits and whose last dim is 1 or V.
ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv,
    torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.tanh,
}
ELEMENTWISE_METHODS = {
    "add", "sub", "mul", "div", "true_divide", "tanh", "add_", "sub_", "mul_", "div_", "tanh_",
    "float", "half", "bfloat16", "double", "to", "type_as", "contiguous",
}

# Ops that consume the vocabulary axis; what they return reaches the output "through the head".
CONSUMER_FUNCTIONS = {
    torch.softmax, torch.log_softmax, torch.nn.functional.softmax, torch.nn.functional.log_softmax,
    torch.topk, torch.argmax, torch.max, torch.sort, torch.argsort, torch.multinomial,
}
CONSUMER_METHODS = {"softmax", "log_softmax", "topk", "argmax", "max", "sort", "argsort"}


def example_value(node: Any) -> Any:
    """The FakeTensor (or value) Dynamo recorded for ``node``; numbers pass through."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def tensor_shape(node: Any) -> tuple | None:
    v = example_value(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def is_call(node: fx.Node, functions: set, methods: set = frozenset()) -> bool:
    return (node.op == "call_function" and node.target in functions) or (node.op == "call_method" and node.target in methods)


def transposed_weight(node: Any) -> fx.Node | None:
    """``W`` when ``node`` is ``W.t()``, ``W.T``, ``W.transpose(0, 1)`` or ``W.permute(1, 0)`` of a 2-D ``W``."""
    if not isinstance(node, fx.Node):
        return None
    src = None
    if node.op == "call_method" and node.target == "t" or (node.op == "call_function" and node.target is torch.t):
        src = node.args[0]
    elif node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT"):
        src = node.args[0]
    elif (node.op == "call_method" and node.target == "transpose") or (node.op == "call_function" and node.target is torch.transpose):
        if sorted(a % 2 for a in node.args[1:3] if isinstance(a, int)) == [0, 1]:
            src = node.args[0]
    elif node.op == "call_method" and node.target == "permute" and tuple(node.args[1:]) in ((1, 0), ((1, 0),)):
        src = node.args[0]
    if isinstance(src, fx.Node) and tensor_shape(src) is not None and len(tensor_shape(src)) == 2:
        return src
    return None


def match_projection(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """``(x, weight, bias)`` when ``node`` projects x [..., H] with a 2-D weight [N, H]."""
    if node.op == "call_function" and node.target in LINEAR_TARGETS:
        args = list(node.args) + [None] * 3
        x = node.kwargs.get("input", args[0])
        w = node.kwargs.get("weight", args[1])
        b = node.kwargs.get("bias", args[2])
        if isinstance(w, fx.Node) and tensor_shape(w) is not None and len(tensor_shape(w)) == 2:
            return x, w, b if isinstance(b, fx.Node) else None
        return None
    if is_call(node, MATMUL_TARGETS, {"matmul", "__matmul__"}) and len(node.args) == 2:
        w = transposed_weight(node.args[1])
        if w is not None:
            return node.args[0], w, None
    return None


def _last_dim(shape: tuple | None) -> Any:
    return shape[-1] if shape else None


def elementwise_operands_ok(node: fx.Node, logits: fx.Node, vocab_size: int, region: set) -> bool:
    """Whether ``node`` is a post-op of ``logits`` that can run on compact logits.

    Exactly one operand is in the region (the logits); every other operand is a number or
    dtype, or a tensor outside the region whose last dim is 1 or V (V-sized ones are gathered).
    """
    if not is_call(node, ELEMENTWISE_FUNCTIONS, ELEMENTWISE_METHODS):
        return False
    operands = list(node.args) + list(node.kwargs.values())
    if sum(1 for a in operands if a is logits) != 1:
        return False
    for a in operands:
        if a is logits or isinstance(a, (int, float, bool, torch.dtype, torch.device, str)) or a is None:
            continue
        if not isinstance(a, fx.Node) or a in region:
            return False
        shape = tensor_shape(a)
        if shape is None:  # a SymInt/SymFloat scalar
            if isinstance(example_value(a), (torch.SymInt, torch.SymFloat, int, float)):
                continue
            return False
        if node.op == "call_method" and node.target in ("type_as", "to"):
            continue  # a tensor used only for its dtype/device
        if len(shape) and shape[-1] not in (1, vocab_size):
            return False
    return True


def view_keeps_vocab(node: fx.Node, logits: fx.Node, vocab_size: int) -> bool:
    """Whether ``node`` is a view of ``logits`` that leaves the last (vocabulary) axis whole."""
    shape = tensor_shape(logits)
    if shape is None or node.args[0] is not logits:
        return False
    ndim = len(shape)
    if node.op == "call_function" and node.target is operator.getitem:
        idx = node.args[1]
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(i is Ellipsis or i is None or isinstance(i, fx.Node) and tensor_shape(i) is not None for i in idx):
            return False
        if not all(isinstance(i, (int, slice, fx.Node)) for i in idx):
            return False
        return len(idx) < ndim or (len(idx) == ndim and idx[-1] == slice(None))
    if node.op == "call_method" and node.target in ("view", "reshape"):
        dims = node.args[1:]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        return len(dims) > 0 and dims[-1] == vocab_size and tensor_shape(node) is not None and _last_dim(tensor_shape(node)) == vocab_size
    if node.op == "call_method" and node.target in ("squeeze", "unsqueeze") and len(node.args) == 2:
        d = node.args[1]
        return isinstance(d, int) and 0 <= d < ndim - (node.target == "squeeze")
    return False


def reads_row_size(node: fx.Node, logits: fx.Node) -> bool:
    """``logits.size(d)`` / ``sym_size(logits, d)`` for a non-vocabulary dim d (same in compact space)."""
    shape = tensor_shape(logits)
    if shape is None:
        return False
    is_size = (node.op == "call_method" and node.target == "size") or (
        node.op == "call_function" and node.target is torch.ops.aten.sym_size.int
    )
    if not is_size or len(node.args) < 2 or not isinstance(node.args[1], int):
        return False
    d = node.args[1] % len(shape)
    return d != len(shape) - 1


# ---------------------------------------------------------------------------- compact consumers
# Consumers that can read the compact logits directly, mapping slots back to token ids, so the
# [..., V] logits are never built: top-k and argmax over the vocabulary axis, and softmax /
# log_softmax over it when only those feed them (how EAGLE and tree drafters pick candidates).
TOPK_FUNCTIONS = {torch.topk}
ARGMAX_FUNCTIONS = {torch.argmax}
SOFTMAX_FUNCTIONS = {torch.softmax, torch.log_softmax, torch.nn.functional.softmax, torch.nn.functional.log_softmax}


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` of a call, positional index counted without ``self``/``input``."""
    args = node.args[1:]
    if name in node.kwargs:
        return node.kwargs[name]
    return args[index] if index < len(args) else default


def _is_last_dim(dim: Any, ndim: int) -> bool:
    return isinstance(dim, int) and ndim > 0 and dim % ndim == ndim - 1


def match_topk(user: fx.Node, logits: fx.Node) -> tuple[int, bool] | None:
    """``(k, largest)`` when ``user`` is a top-k of ``logits`` over the last dim."""
    if not is_call(user, TOPK_FUNCTIONS, {"topk"}) or user.args[0] is not logits:
        return None
    shape = tensor_shape(logits)
    k, dim, largest = _arg(user, 0, "k"), _arg(user, 1, "dim", -1), _arg(user, 2, "largest", True)
    if shape is None or not isinstance(k, int) or not isinstance(largest, bool) or not _is_last_dim(dim, len(shape)):
        return None
    return k, largest


def match_argmax(user: fx.Node, logits: fx.Node) -> bool | None:
    """``keepdim`` when ``user`` is an argmax of ``logits`` over the last dim."""
    if not is_call(user, ARGMAX_FUNCTIONS, {"argmax"}) or user.args[0] is not logits:
        return None
    shape = tensor_shape(logits)
    dim, keepdim = _arg(user, 0, "dim"), _arg(user, 1, "keepdim", False)
    if shape is None or not _is_last_dim(dim, len(shape)) or not isinstance(keepdim, bool):
        return None
    return keepdim


def match_softmax(user: fx.Node, logits: fx.Node) -> bool:
    """``user`` is a softmax/log_softmax of ``logits`` over the last dim (no dtype change)."""
    if not is_call(user, SOFTMAX_FUNCTIONS, {"softmax", "log_softmax"}) or user.args[0] is not logits:
        return False
    shape = tensor_shape(logits)
    dtype = user.kwargs.get("dtype", user.args[3] if user.op == "call_function" and len(user.args) > 3 else None)
    return shape is not None and dtype is None and _is_last_dim(_arg(user, 0, "dim"), len(shape))
