"""What the nanospec passes match, and why, in one place.

All matchers work on Dynamo-level FX graphs (``torch.compile`` backends receive those):
parameters are placeholders, an ``nn.Linear`` is ``torch._C._nn.linear(x, w, b)``, and
``x @ W.t()`` is ``operator.matmul(x, t)`` with ``t = W.t()`` (or ``.T``, ``.transpose``).

* **Projections** turn a hidden state [..., H] into [..., N] with a 2-D weight [N, H]:
  ``linear``/``F.linear`` (bias optional, a tied embedding weight included) and
  ``matmul``/``@`` against a transposed 2-D weight; or with a parameter stored [H, N] (``x @ W``,
  ``F.linear(x, W.t())``: :func:`projection_transposed`); or with a weight computed in the graph row by
  row from stored tensors (quantised, parametrised: ``row_weight.py``). One whose N is the vocabulary size and
  whose output reaches the graph output is the LM head.
* **Post-ops** are elementwise steps drafters apply to logits (temperature ``/ t``, a bias
  ``+ b``, soft-capping ``cap * tanh(z / cap)``, dtype casts) and views that leave the
  vocabulary axis alone (``logits[:, -1]``, ``.view(-1, V)``). They run on the compact
  logits, so inactive tokens come out exactly -inf *after* them.
* **Consumers** read the vocabulary axis (softmax, top-k, argmax, ...). They see the
  full-vocabulary logits with -inf at inactive tokens, so they only pick active tokens.

How the rewrite stays sound
---------------------------
The *vocabulary region* is every value computed from the head's ``[..., V]`` output, aliases
and views included. ``rewrite_head`` walks it in graph order as a dataflow problem (not a list of
special cases): each value of the *chain* (the contract's post-op chain: elementwise steps whose
other operands are not computed from the logits, and views that keep each token's column) is held
either in compact form ``[..., C]`` or as a materialised ``[..., V]`` tensor with ``-inf`` at
inactive tokens, and every *use* of a chain value is exactly one of

1. **a step of the chain with exact compact semantics** - an elementwise post-op whose other
   operands are numbers, tensors with last dim 1, or ``[..., V]`` tensors outside the region
   (gathered at the active ids); a cast; a view that keeps the vocabulary axis last; the
   *in-place* forms of those post-ops, which then run in place on the compact tensor, so every
   compact alias sees the write just as the dense aliases would; or a compact consumer:
   ``topk(largest=True)``/``argmax`` (behind ``log_softmax`` over V or not), which read slots and map
   them to token ids (behind ``softmax`` they read the materialised probabilities: an inactive token's is 0);
2. **a materialisation point** - any other use. A reader that neither writes its input nor may
   return an alias of it (schemas say which: ``effects.py``) is the end of the chain: it gets its own
   ``scatter_logits`` right before it, i.e. the value as of that point, and what it computes is plain
   arithmetic, never re-masked (``exp(log_softmax(z))`` is 0 at inactive tokens). A use that writes
   the value (``z[..., bad] = v``, ``index_put_``, ``copy_``, ``out=z``) or may alias it materialises
   the value's whole alias class there: its root is scattered once, the views in between are replayed
   on that tensor, and every later use of every alias reads it. The chain goes on on that tensor: a
   write, and every later elementwise step of the chain, is followed by a re-mask of the inactive tokens
   to ``-inf``; views that keep the vocabulary axis whole (moved by a transpose or not, or cut to a
   padded vocabulary's real width) carry the mask (:func:`vocab_axis_after`);
3. **a reason to stay dense** - a write through a view that selects part of the vocabulary axis, an
   elementwise step or write on the result of an unknown op that may alias the logits, or anything
   else the walk cannot classify: the head is left dense with one ``NanoSpecWarning`` naming the op
   and its place (``contract.DenseFallback``).

Unknown ops are assumed to alias and write nothing the schema does not say; in-place ops with
no compact form are materialisation points, never dropped. Every dead-code elimination the
backend runs removes only unused nodes known to be pure (``effects.is_pure``, an allow-list): an
unknown call is kept. A use inside a functorch transform Dynamo inlined (``torch.vmap``:
``transforms.py``) is a materialisation point (no compact op runs on its batched tensors), and a
head inside one is left dense with a warning.
"""
from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx as fx

from .graph import call_arg

LINEAR_TARGETS = {torch._C._nn.linear, torch.nn.functional.linear}
MATMUL_TARGETS = {operator.matmul, torch.matmul}
EMBEDDING_TARGETS = {torch.nn.functional.embedding}

# Elementwise ops that may follow the head. The logits are one operand; any other operand must
# be a number or a tensor that does not depend on the logits and whose last dim is 1 or V.
_POINTWISE = (
    "add", "sub", "mul", "div", "true_divide", "tanh", "sigmoid", "neg", "abs", "exp", "log", "sqrt", "rsqrt",
    "square", "pow", "clamp", "clip", "clamp_min", "clamp_max", "masked_fill", "nan_to_num", "where",
    "maximum", "minimum", "reciprocal", "relu", "sign",
)
CAST_METHODS = {"float", "half", "bfloat16", "double", "to", "type_as", "contiguous"}
ELEMENTWISE_FUNCTIONS = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow,
    operator.iadd, operator.isub, operator.imul, operator.itruediv,
    *(getattr(torch, n) for n in _POINTWISE if hasattr(torch, n)),
    *(getattr(torch, n + "_") for n in _POINTWISE if hasattr(torch, n + "_")),
    torch.nn.functional.relu,
}
ELEMENTWISE_METHODS = {*_POINTWISE, *(n + "_" for n in _POINTWISE if n != "where"), *CAST_METHODS}
# Ops that gather several region values along a non-vocabulary axis (Medusa heads, stacked).
JOIN_FUNCTIONS = {torch.stack, torch.cat, torch.concat}

# Softmax and log_softmax over the vocabulary axis: the logits go on through them (find_head), and they
# may read compact logits (match_softmax). The one definition of this op set.
SOFTMAX_FUNCTIONS = {torch.softmax, torch.log_softmax, torch.nn.functional.softmax, torch.nn.functional.log_softmax}
SOFTMAX_METHODS = {"softmax", "log_softmax"}
# Ops that consume the vocabulary axis; what they return reaches the output "through the head".
CONSUMER_FUNCTIONS = {*SOFTMAX_FUNCTIONS, torch.topk, torch.argmax, torch.max, torch.sort, torch.argsort,
                      torch.multinomial}
CONSUMER_METHODS = {*SOFTMAX_METHODS, "topk", "argmax", "max", "sort", "argsort"}


def is_elementwise(node: fx.Node) -> bool:
    """An elementwise step with a floating result: the listed post-ops, or any op torch tags ``pointwise``
    (``log1p``, ``F.softplus``, ``F.silu``, ...), looked up by name among the ATen ops. Comparisons and
    other ops with a bool or integer result are not steps of the logits chain."""
    if is_call(node, ELEMENTWISE_FUNCTIONS, ELEMENTWISE_METHODS):
        return True
    if node.op not in ("call_function", "call_method"):
        return False
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    value = example_value(node)
    if not isinstance(name, str) or not (isinstance(value, torch.Tensor) and value.is_floating_point()):
        return False
    return _aten_pointwise(name)


@functools.lru_cache(maxsize=None)
def _aten_pointwise(name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    try:
        return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())
    except Exception:  # noqa: BLE001 - an overload that cannot be read: not known to be pointwise
        return False


def is_comparison(node: fx.Node) -> bool:
    """An elementwise op with a bool result (``z > 0``, ``torch.isinf(z)``): computed from the logits
    column by column, but not a step of the chain nanospec can run compact."""
    value = example_value(node)
    if (node.op not in ("call_function", "call_method") or not isinstance(value, torch.Tensor)
            or value.dtype != torch.bool):
        return False
    if node.op == "call_function" and node.target in (operator.lt, operator.le, operator.gt, operator.ge, operator.eq,
                                                      operator.ne, operator.and_, operator.or_, operator.xor,
                                                      operator.invert, operator.not_):
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    return isinstance(name, str) and _aten_pointwise(name)


def source_name(node: fx.Node) -> str:
    """Dynamo's source expression for a placeholder (``L['self']._modules['lm_head']...``), or ''."""
    source = node.meta["grapharg"].source if "grapharg" in node.meta else None
    if source is None:
        return ""
    name = source.name
    return name() if callable(name) else str(name)


def example_value(node: Any) -> Any:
    """The FakeTensor (or value) Dynamo recorded for ``node``; numbers pass through."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def fake_value(node: fx.Node) -> Any:
    """``node``'s value computed on its inputs' FakeTensors (None when that is not possible)."""
    if node.op not in ("call_function", "call_method"):
        return None
    args, kwargs = fx.map_arg((node.args, node.kwargs), example_value)
    mode = None
    for v in node.all_input_nodes:
        value = example_value(v)
        if isinstance(value, torch._subclasses.FakeTensor):
            mode = value.fake_mode
            break
    if mode is None or any(example_value(v) is None for v in node.all_input_nodes):
        return None
    try:
        with mode:
            if node.op == "call_method":
                return getattr(args[0], node.target)(*args[1:], **kwargs)
            return node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - metadata is best effort; matchers then see no shape
        return None


def set_example_value(node: fx.Node) -> None:
    """Record ``node``'s FakeTensor value (``example_value`` and ``val``), computed from its inputs'."""
    value = fake_value(node)
    if value is not None:
        node.meta["example_value"] = value
        node.meta["val"] = value


def tensor_shape(node: Any) -> tuple | None:
    v = example_value(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def is_call(node: fx.Node, functions: set, methods: set = frozenset()) -> bool:
    return ((node.op == "call_function" and node.target in functions)
            or (node.op == "call_method" and node.target in methods))


# The 2-D transposes, however Dynamo spells them: a Tensor method (``call_method``), a torch function, a
# Tensor method used as a function (``torch.Tensor.t``), an aten op (torch >= 2.14 records ``W.T`` / ``W.mT``
# as ``aten.numpy_T`` / ``aten.mT``), or an attribute read (``getattr(W, "T")``). Names only; the arguments
# are checked below.
_SWAP_ALL = {"t", "T", "mT", "numpy_T", "t_copy"}  # of a 2-D tensor: swap both axes, no arguments
_SWAP_DIMS = {"transpose", "transpose_copy", "swapaxes", "swapdims"}  # (dim0, dim1)
_PERMUTE = {"permute", "permute_copy"}  # (dims...) or ((dims),)


def _op_name(node: fx.Node) -> str | None:
    """The op's bare name (``"t"``, ``"numpy_T"``, ``"transpose"``, ...) for a call of a method, a function
    or an aten overload, or the attribute name of a ``getattr``; None for anything else."""
    target = node.target
    if node.op == "call_method":
        return target
    if node.op != "call_function":
        return None
    if target is getattr:
        return node.args[1] if len(node.args) > 1 and isinstance(node.args[1], str) else None
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return target.__name__.split(".")[0]  # aten.numpy_T.default -> numpy_T
    if target in (getattr(torch, n, None) for n in (*_SWAP_ALL, *_SWAP_DIMS, *_PERMUTE)) or \
            target in (getattr(torch.Tensor, n, None) for n in (*_SWAP_ALL, *_SWAP_DIMS, *_PERMUTE)):
        return target.__name__
    return None


def transposed_weight(node: Any) -> fx.Node | None:
    """``W`` when ``node`` is ``W.t()``, ``W.T``, ``W.mT``, ``W.transpose(0, 1)`` (``swapaxes``, negative dims),
    ``W.permute(1, 0)`` of a 2-D ``W``, in any of the spellings :func:`_op_name` reads."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    name, args = (_op_name(node),
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
        w = transposed_weight(node.args[1])
        if w is not None:
            return node.args[0], w, None, False
        w, x_shape, w_shape = node.args[1], tensor_shape(node.args[0]), tensor_shape(node.args[1])
        if _stored(w) and w_shape is not None and len(w_shape) == 2 and x_shape and len(x_shape) >= 1 \
                and _known_equal(x_shape[-1], w_shape[0]):  # x @ W, W [H, N]
            return node.args[0], w, None, True
    if is_call(node, ADDMM_TARGETS, {"addmm"}):
        return _match_addmm(node)
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


def _match_addmm(node: fx.Node) -> tuple | None:
    """``torch.addmm(b, x, W.t())`` (``b.addmm(x, W.t())``): ``x @ W.t() + b`` with ``alpha = beta = 1`` and a bias of
    one value per output ([N]); or ``addmm(b, x, W)`` with a stored ``W`` [H, N]."""
    b, x, m2 = call_arg(node, 0, "input"), call_arg(node, 1, "mat1"), call_arg(node, 2, "mat2")
    if any(call_arg(node, 99, k, 1) != 1 for k in ("alpha", "beta")) or not isinstance(m2, fx.Node):
        return None
    w, transposed = transposed_weight(m2), False
    if w is None and _stored(m2) and tensor_shape(m2) is not None and len(tensor_shape(m2)) == 2:
        w, transposed = m2, True
    if w is None:
        return None
    width = tensor_shape(w)[1 if transposed else 0]
    if not isinstance(b, fx.Node) or tensor_shape(b) != (width,):
        return None  # a bias per row of x, or a broadcast scalar: not a head bias
    return x, w, b, transposed


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


def _last_dim(shape: tuple | None) -> Any:
    return shape[-1] if shape else None


def elementwise_operands_ok(node: fx.Node, logits: fx.Node | list, vocab_size: int, region: set) -> bool:
    """Whether ``node`` is a post-op of ``logits`` (one node or several) that can run on compact logits.

    The region operands are the logits (all in one compact space, each with the vocabulary
    axis last); every other operand is a number or dtype, or a tensor outside the region whose
    last dim is 1 or V (V-sized ones are gathered).
    """
    if not is_elementwise(node):
        return False
    inputs = set(logits) if isinstance(logits, (list, tuple, set)) else {logits}
    operands = list(node.args) + list(node.kwargs.values())
    if not any(isinstance(a, fx.Node) and a in inputs for a in operands):
        return False
    for a in operands:
        if isinstance(a, fx.Node) and a in inputs:
            continue
        if isinstance(a, (int, float, bool, torch.dtype, torch.device, str)) or a is None:
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
        return (len(dims) > 0 and dims[-1] == vocab_size and tensor_shape(node) is not None
                and _last_dim(tensor_shape(node)) == vocab_size)
    if node.op == "call_method" and node.target in ("squeeze", "unsqueeze") and len(node.args) == 2:
        d = node.args[1]
        return isinstance(d, int) and 0 <= d < ndim - (node.target == "squeeze")
    return False


def is_basic_indexing(node: fx.Node, logits: fx.Node) -> bool:
    """``logits[...]`` with ints, slices, ``...`` and ``None`` only (a view, any axis)."""
    if not (node.op == "call_function" and node.target is operator.getitem and node.args[0] is logits):
        return False
    idx = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    return all(i is Ellipsis or i is None or isinstance(i, (int, slice)) or
               (isinstance(i, fx.Node) and tensor_shape(i) is None) for i in idx)


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
# log_softmax over it when only those feed them (how EAGLE and tree drafters pick candidates;
# SOFTMAX_FUNCTIONS above).
TOPK_FUNCTIONS = {torch.topk}
ARGMAX_FUNCTIONS = {torch.argmax}


def _is_last_dim(dim: Any, ndim: int) -> bool:
    return isinstance(dim, int) and ndim > 0 and dim % ndim == ndim - 1


def match_topk(user: fx.Node, logits: fx.Node) -> tuple[int, bool] | None:
    """``(k, largest)`` when ``user`` is a top-k of ``logits`` over the last dim."""
    if not is_call(user, TOPK_FUNCTIONS, {"topk"}) or user.args[0] is not logits:
        return None
    shape = tensor_shape(logits)
    k, dim, largest = call_arg(user, 1, "k"), call_arg(user, 2, "dim", -1), call_arg(user, 3, "largest", True)
    if shape is None or not isinstance(k, int) or not isinstance(largest, bool) or not _is_last_dim(dim, len(shape)):
        return None
    return k, largest


def match_argmax(user: fx.Node, logits: fx.Node) -> bool | None:
    """``keepdim`` when ``user`` is an argmax of ``logits`` over the last dim."""
    if not is_call(user, ARGMAX_FUNCTIONS, {"argmax"}) or user.args[0] is not logits:
        return None
    shape = tensor_shape(logits)
    dim, keepdim = call_arg(user, 1, "dim"), call_arg(user, 2, "keepdim", False)
    if shape is None or not _is_last_dim(dim, len(shape)) or not isinstance(keepdim, bool):
        return None
    return keepdim


def match_log_softmax(user: fx.Node, logits: fx.Node) -> bool:
    """``user`` is a log_softmax of ``logits`` over the last dim (no dtype change)."""
    return match_softmax(user, logits) and (user.target in (torch.log_softmax, torch.nn.functional.log_softmax)
                                            or user.target == "log_softmax")


def match_softmax(user: fx.Node, logits: fx.Node) -> bool:
    """``user`` is a softmax/log_softmax of ``logits`` over the last dim (no dtype change)."""
    if not is_call(user, SOFTMAX_FUNCTIONS, SOFTMAX_METHODS) or user.args[0] is not logits:
        return False
    shape = tensor_shape(logits)
    dtype = user.kwargs.get("dtype", user.args[3] if user.op == "call_function" and len(user.args) > 3 else None)
    return shape is not None and dtype is None and _is_last_dim(call_arg(user, 1, "dim"), len(shape))


# ---------------------------------------------------------------------------- column-keeping views
# Views and reshapes that keep every token's column whole: the vocabulary axis survives as one axis
# of the result (maybe at another position), in order. Elementwise steps after them are still steps
# of the logits chain; anything else reading them ends the chain.
RESHAPE_METHODS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "contiguous", "detach",
                   "expand", "expand_as", "view_as", "reshape_as"}
RESHAPE_FUNCTIONS = {torch.reshape, torch.flatten, torch.unflatten, torch.squeeze, torch.unsqueeze, torch.detach}
PERMUTE_METHODS = {"transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "t"}
PERMUTE_FUNCTIONS = {torch.transpose, torch.swapaxes, torch.swapdims, torch.permute, torch.movedim, torch.moveaxis,
                     torch.t}


def _known_equal(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - a size nanospec cannot compare: not provably equal
        return False


def _product(dims) -> Any:
    out = 1
    for d in dims:
        out = out * d
    return out


def _call_name(node: fx.Node) -> str | None:
    """:func:`_op_name`, or the bare name of any other called function (``torch.movedim``)."""
    return _op_name(node) or (getattr(node.target, "__name__", None) if node.op == "call_function" else None)


def _ints(args) -> list | None:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = tuple(args[0])
    return list(args) if all(isinstance(a, int) for a in args) else None


def _permutation(node: fx.Node, ndim: int) -> list[int] | None:
    """``perm`` with ``out axis i = in axis perm[i]`` when ``node`` only permutes axes, else None."""
    name = _call_name(node)
    args = node.args[1:]
    if node.op == "call_function" and node.target is getattr:
        attr = node.args[1]
        if attr in ("T", "H"):
            return list(reversed(range(ndim)))
        if attr in ("mT", "mH") and ndim >= 2:
            return list(range(ndim - 2)) + [ndim - 1, ndim - 2]
        return None
    if name in ("numpy_T",):
        return list(reversed(range(ndim)))
    if name in ("mT", "mH", "adjoint") and ndim >= 2:
        return list(range(ndim - 2)) + [ndim - 1, ndim - 2]
    if not is_call(node, PERMUTE_FUNCTIONS, PERMUTE_METHODS):
        return None
    if name == "t":
        return list(reversed(range(ndim))) if ndim <= 2 else None
    if name in ("transpose", "swapaxes", "swapdims"):
        dims = _ints(args[:2])
        if dims is None or len(dims) != 2:
            return None
        a, b = (d % ndim for d in dims)
        perm = list(range(ndim))
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    if name == "permute":
        dims = _ints(args)
        return [d % ndim for d in dims] if dims is not None and len(dims) == ndim else None
    if name in ("movedim", "moveaxis") and len(args) == 2:
        src, dst = ([a] if isinstance(a, int) else list(a) if isinstance(a, (tuple, list)) else None for a in args)
        if src is None or dst is None or len(src) != len(dst):
            return None
        src, dst = [s % ndim for s in src], [d % ndim for d in dst]
        perm: list = [None] * ndim
        for s, d in zip(src, dst):
            perm[d] = s
        rest = iter(i for i in range(ndim) if i not in src)
        return [p if p is not None else next(rest) for p in perm]
    return None


def _index_axis(index: Any, in_shape: tuple, axis: int) -> int | None:
    """Where basic indexing ``x[index]`` puts ``x``'s axis ``axis`` (None: it is selected or cut)."""
    idx = index if isinstance(index, tuple) else (index,)
    if not all(i is Ellipsis or i is None or isinstance(i, (int, slice)) or
               (isinstance(i, fx.Node) and tensor_shape(i) is None) for i in idx):
        return None  # a tensor index: advanced indexing copies and reorders
    consumed = sum(1 for i in idx if i is not None and i is not Ellipsis)
    in_dim = out_dim = 0
    for i in idx:
        if i is None:
            out_dim += 1
        elif i is Ellipsis:
            n = len(in_shape) - consumed
            if in_dim <= axis < in_dim + n:
                return out_dim + axis - in_dim
            in_dim, out_dim = in_dim + n, out_dim + n
        elif isinstance(i, slice):
            if in_dim == axis:
                return out_dim if i == slice(None) else None
            in_dim, out_dim = in_dim + 1, out_dim + 1
        else:  # an int (or a SymInt): selects one entry of this axis
            if in_dim == axis:
                return None
            in_dim += 1
    return out_dim + axis - in_dim if axis >= in_dim else None


def vocab_axis_after(node: fx.Node, src: fx.Node, axis: int) -> int | None:
    """The axis of ``node`` that holds axis ``axis`` of ``src`` whole and in order, when ``node`` is a
    view, reshape or permutation of ``src`` (its first argument) that keeps each column of that axis."""
    in_shape, out_shape = tensor_shape(src), tensor_shape(node)
    if in_shape is None or out_shape is None or not node.args or node.args[0] is not src or not in_shape:
        return None
    axis %= len(in_shape)
    if node.op == "call_function" and node.target is operator.getitem:
        return _index_axis(node.args[1], in_shape, axis)
    perm = _permutation(node, len(in_shape))
    if perm is not None:
        return perm.index(axis) if sorted(perm) == list(range(len(in_shape))) else None
    if node.op == "call_function" and node.target is getattr and node.args[1] == "data":
        return axis
    if not is_call(node, RESHAPE_FUNCTIONS, RESHAPE_METHODS):
        return None
    if _call_name(node) in ("expand", "expand_as"):
        shift = len(out_shape) - len(in_shape)
        return axis + shift if shift >= 0 and _known_equal(out_shape[axis + shift], in_shape[axis]) else None
    prefix = _product(in_shape[:axis])
    for k, d in enumerate(out_shape):
        if _known_equal(d, in_shape[axis]) and _known_equal(_product(out_shape[:k]), prefix):
            return k
    return None


def is_reshape_or_permute(node: fx.Node) -> bool:
    """A view, reshape or permutation of its first argument (``x.T``/``x.mT`` included)."""
    if node.op == "call_function" and node.target is getattr:
        return node.args[1] in ("T", "mT", "H", "mH")
    return is_call(node, RESHAPE_FUNCTIONS | PERMUTE_FUNCTIONS, RESHAPE_METHODS | PERMUTE_METHODS) or \
        _op_name(node) in ("numpy_T", "mT", "mH", "adjoint")


# Writes of values at positions, returned as a new tensor (``z.scatter(-1, ids, -inf)``, ``z.index_fill(-1, ids, 0)``):
# each entry keeps its column, so on logits they are steps of the chain (bans), like their in-place forms.
WRITE_LIKE = {"scatter", "scatter_add", "scatter_reduce", "index_fill", "index_put", "index_add", "index_copy",
              "masked_scatter", "slice_scatter", "select_scatter", "diagonal_scatter"}


def is_write_like(node: fx.Node) -> bool:
    """An out-of-place positional write of its first argument (its result has the argument's shape)."""
    name = _call_name(node) if node.op in ("call_function", "call_method") else None
    return name in WRITE_LIKE and bool(node.args) and tensor_shape(node) is not None
