"""What the nanospec passes match, and why, in one place.

Projections are matched in ``projections.py``, the views that keep the vocabulary axis in ``vocab_views.py``;
this module holds the node values every matcher reads, the post-ops, the consumers and the writes.

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
   (gathered at the active ids; ``bias.type_as(z)`` is such a tensor: an op that reads the logits
   for their dtype or shape only computes nothing from them, :func:`metadata_operands`); a cast; a
   view that keeps the vocabulary axis last (a cast, ``contiguous`` or ``reshape`` is an alias of
   its input where eager returned the input or a view of it, a value of its own where eager copied);
   the *in-place* forms of those post-ops, which then run in place on the compact tensor, so every
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
import re
from typing import Any

import torch
import torch.fx as fx

from .graph import call_arg, node_name

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
    other ops with a bool or integer result are not steps of the logits chain.

    Elementwise in the form called, not by name: ``torch.max(z, other)`` is (``aten::max.other`` is tagged
    pointwise), ``z.max()`` is a reduction that ends the chain, and ``torch.where(z)`` returns indices. Which overload a
    name's tag belongs to does not say it (``aten::rsub.Tensor`` is elementwise and untagged); what every
    elementwise form does, and no other form of these names does, is return one tensor that drops no axis of the
    tensors it reads the values of (:func:`_reduces`)."""
    if node.op not in ("call_function", "call_method") or _reduces(node):
        return False
    if is_call(node, ELEMENTWISE_FUNCTIONS, ELEMENTWISE_METHODS):
        return True
    name = node_name(node)
    value = example_value(node)
    if not isinstance(name, str) or not (isinstance(value, torch.Tensor) and value.is_floating_point()):
        return False
    return _aten_pointwise(name)


def _reduces(node: fx.Node) -> bool:
    """Not one tensor, or one of lower rank than a tensor it reads the values of: no elementwise op (broadcasting
    never drops an axis) returns that; ``z.max()``, ``torch.min(z)`` and ``z.max(-1)`` do. Shapes are compared by
    rank only: while the rewrite walks the chain a node's inputs may hold compact values ``[..., C]`` and the node its
    own ``[..., V]`` one."""
    value = example_value(node)
    if not isinstance(value, torch.Tensor):
        return True
    metadata = metadata_operands(node)
    return any(isinstance(v := example_value(a), torch.Tensor) and v.dim() > value.dim()
               for a in node.all_input_nodes if a not in metadata)


@functools.lru_cache(maxsize=None)
def _aten_pointwise(name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    try:
        return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())
    except Exception:  # noqa: BLE001 - an overload that cannot be read: not known to be pointwise
        return False


# Ops that read some tensor operands only for their dtype and device (``bias.type_as(z)``, ``bias.to(z)``,
# ``z.new_zeros(n)``) or also their shape (``bias.expand_as(z)``, ``torch.zeros_like(z)``, ``z.size()``), never their
# values: what they return is not computed from those operands (``bias.type_as(z)`` is the bias, not the logits).
# Method -> the positions read so (0: self; None: every tensor operand but self).
_DTYPE_READS = {"type_as": None, "to": None, "new_empty": 0, "new_zeros": 0, "new_ones": 0, "new_full": 0,
                "new_empty_strided": 0, "new_tensor": 0}
_SHAPE_READS = {"view_as": None, "reshape_as": None, "expand_as": None, "size": 0, "dim": 0, "ndimension": 0,
                "numel": 0, "nelement": 0, "stride": 0, "sym_size": 0, "sym_numel": 0, "sym_stride": 0}
_LIKE_FUNCTIONS = {"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like"}
_METADATA_ATTRIBUTES = {"shape", "dtype", "device", "ndim", "is_cuda", "layout"}


def metadata_operands(node: fx.Node) -> set[fx.Node]:
    """The tensor operands ``node`` reads only for their dtype, device or shape, not for any value (and not also
    as a value operand: in ``z.type_as(z)`` z is the value cast)."""
    if node.op not in ("call_function", "call_method"):
        return set()
    name = node_name(node, attribute=True)
    if node.op == "call_function" and node.target is getattr:
        return {node.args[0]} if name in _METADATA_ATTRIBUTES and isinstance(node.args[0], fx.Node) else set()
    positions = {**_DTYPE_READS, **_SHAPE_READS}
    args, kwargs = list(node.args), dict(node.kwargs)
    if name in _LIKE_FUNCTIONS and node.op == "call_function":
        read = [args.pop(0)] if args else [kwargs.pop("input", None)]
    elif name in positions and (node.op == "call_method" or positions[name] == 0):  # ``torch.numel(z)``, sym_size
        if positions[name] == 0:
            read = [args.pop(0)] if args else []
        else:
            read, args, kwargs = [*args[1:], *kwargs.values()], args[:1], {}
    else:
        return set()
    read_nodes: set[fx.Node] = set()
    value_nodes: set[fx.Node] = set()
    fx.map_arg(read, read_nodes.add)
    fx.map_arg((args, kwargs), value_nodes.add)
    return read_nodes - value_nodes


def reads_shape(node: fx.Node) -> bool:
    """``node``'s metadata operands (:func:`metadata_operands`) are read for their sizes too, not only for their
    dtype, device and rank (which compact logits share with the logits)."""
    name = node_name(node, attribute=True)
    return not (name in _DTYPE_READS or name in ("dim", "ndimension") and node.op == "call_method"
                or node.op == "call_function" and node.target is getattr and name != "shape")


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
    name = node_name(node)
    return isinstance(name, str) and not _reduces(node) and _aten_pointwise(name)


def source_name(node: fx.Node) -> str:
    """Dynamo's source expression for a placeholder (``L['self']._modules['lm_head']...``), or ''."""
    source = node.meta["grapharg"].source if "grapharg" in node.meta else None
    if source is None:
        return ""
    name = source.name
    return name() if callable(name) else str(name)


_MODULE_ATTRIBUTE = re.compile(r"^[LG]\['[^']+'\](\._modules\['[^']+'\])*\.[A-Za-z_]\w*$")  # an object's tensor


def is_weight_like(node: fx.Node, example: object) -> bool:
    """A tensor the model holds: a parameter or buffer (fixed across calls), or a plain tensor attribute of the
    module (``self.W = torch.randn(V, H)``, which ``active_vocab`` accepts too: ``module_heads.module_tensors``), not
    an arbitrary tensor argument. The one test of it, for heads, lookup tables and what tells two instances of a
    class apart."""
    if node.op == "get_attr":
        return True
    if node.op != "placeholder":
        return False
    if isinstance(example, torch.nn.Parameter):
        return True
    source = source_name(node)
    return "_buffers[" in source or bool(_MODULE_ATTRIBUTE.match(source))


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


def elementwise_operands_ok(node: fx.Node, logits: fx.Node | list, vocab_size: int, region: set) -> bool:
    """Whether ``node`` is a post-op of ``logits`` (one node or several) that can run on compact logits.

    The region operands are the logits (all in one compact space, each with the vocabulary
    axis last); every other operand is a number or dtype, or a tensor outside the region whose
    last dim is 1 or V (V-sized ones are gathered).
    """
    if not is_elementwise(node):
        return False
    inputs = set(logits) if isinstance(logits, (list, tuple, set)) else {logits}
    metadata = metadata_operands(node)  # ``bias.type_as(z)``: a cast of the bias, no step of the logits
    operands = [a for a in (*node.args, *node.kwargs.values()) if not (isinstance(a, fx.Node) and a in metadata)]
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
        if len(shape) and shape[-1] not in (1, vocab_size):
            return False
    return True


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


def known_equal(a: Any, b: Any) -> bool:
    """Sizes provably equal (symbolic ones compared without adding a guard)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - a size nanospec cannot compare: not provably equal
        return False


# Writes of values at positions, returned as a new tensor (``z.scatter(-1, ids, -inf)``, ``z.index_fill(-1, ids, 0)``):
# each entry keeps its column, so on logits they are steps of the chain (bans), like their in-place forms.
WRITE_LIKE = {"scatter", "scatter_add", "scatter_reduce", "index_fill", "index_put", "index_add", "index_copy",
              "masked_scatter", "slice_scatter", "select_scatter", "diagonal_scatter"}


def is_write_like(node: fx.Node) -> bool:
    """An out-of-place positional write of its first argument (its result has the argument's shape)."""
    return node_name(node, attribute=True) in WRITE_LIKE and bool(node.args) and tensor_shape(node) is not None
