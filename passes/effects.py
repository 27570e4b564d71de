"""What a Dynamo-level FX node writes and what its result may alias, from torch's op schemas.

Dynamo graphs call Python-level targets (``torch.clamp_``, ``"masked_fill_"`` methods,
``operator.setitem``, ``operator.itruediv``) rather than ATen overloads. Their effects are read
from the ATen schemas of the same name (``aten::clamp_``: ``Tensor(a!) self``), plus the
Python operators that have no schema. Anything unknown is assumed to alias its inputs and to write every
tensor it receives (:func:`mutated_inputs`), so the passes stay conservative (sound) on calls they have never
seen.

Purity is an allow-list, the same direction: a node is removable when unused only if it is known to
compute a value and do nothing else (:func:`is_pure`: an op whose schema neither writes nor is random
nor is registered as effectful, or a known pure Python builtin or shape read). Any other call, above
all a Python-level one with no schema (``torch._C._functorch._vmap_increment_nesting``, a function
allowed in the graph that writes a buffer), is kept even when its result is unused.

Used by the head rewrite (a mutation or an alias of a compact logits value is a
materialisation point) and by every dead-code elimination the backend runs.
"""
from __future__ import annotations

import functools
import inspect
import logging
import math
import operator
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from .graph import node_name

log = logging.getLogger(__name__)

# Python operators: in-place ones write (and return) their first operand; getitem returns a view
# for basic indexing (a copy for advanced indexing: treated as a view, conservatively).
INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul,
}
WRITING_OPERATORS = INPLACE_OPERATORS | {operator.setitem}
# Python-level targets that return a fresh value and write nothing (no ATen schema of that name).
PURE_PYTHON = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.neg, operator.pos, operator.abs, operator.matmul, operator.lt, operator.le, operator.gt, operator.ge,
    operator.eq, operator.ne, operator.and_, operator.or_, operator.xor, operator.invert, operator.not_,
    torch.nn.functional.softmax, torch.nn.functional.log_softmax, torch.nn.functional.linear,
    torch._C._nn.linear, torch.nn.functional.embedding, torch.functional.einsum, torch.einsum,
}
VIEW_ATTRIBUTES = {"T", "mT", "H", "mH", "real", "imag", "data"}
# Schema-less targets Dynamo emits for shape and Python-value arithmetic: they compute a value, nothing else.
PURE_BUILTINS = {
    operator.getitem, operator.contains, operator.index, operator.truth, operator.is_, operator.is_not,
    operator.lshift, operator.rshift, getattr, len, isinstance, int, float, bool, abs, min, max, round,
    math.sqrt, math.ceil, math.floor, math.trunc, math.exp, math.log, math.log2, math.pow, math.prod,
    torch.sym_int, torch.sym_float, torch.sym_max, torch.sym_min, torch.sym_not, torch.sym_ite, torch.sym_sum,
    torch.Size,
    # functional forms with no ATen op of their name, made of pure ones
    torch.nn.functional.normalize, torch.nn.functional.softmin, torch.nn.functional.softsign,
    torch.nn.functional.tanhshrink, torch.nn.functional.local_response_norm,
}
# Tensor methods with no ATen schema of their name that only read metadata or return a cast/copy.
PURE_METHODS = {
    "size", "dim", "ndimension", "numel", "nelement", "stride", "element_size", "is_contiguous", "is_floating_point",
    "float", "double", "half", "bfloat16", "int", "long", "short", "bool", "byte", "char", "cpu", "cuda", "type",
    "type_as", "view_as", "reshape_as", "expand_as", "contiguous", "__getitem__", "new_tensor", "tolist",
}
# functorch's wrap/unwrap calls Dynamo emits around a transform's body (``torch._C._functorch`` or
# ``torch._functorch.*``): they return a wrapper of their input and write nothing.
FUNCTORCH_WRAPPERS = {"_add_batch_dim", "_remove_batch_dim", "_wrap_for_grad", "_unwrap_for_grad",
                      "_wrap_functional_tensor", "_unwrap_functional_tensor"}
# Namespaces whose Python-level functions are bindings of the ATen op of the same name (``torch.tanh``,
# ``torch._C._nn.linear``, ``F.layer_norm``): their schema says whether they write or draw random numbers.
SCHEMA_NAMESPACES = {
    "torch", "torch.functional", "torch.nn.functional", "torch._C._nn", "torch._C._VariableFunctions",
    "torch._C._linalg", "torch._C._special", "torch._C._fft", "torch.linalg", "torch.special", "torch.fft",
}


@functools.lru_cache(maxsize=None)
def _schemas(name: str) -> tuple:
    try:
        return tuple(torch._C._jit_get_schemas_for_operator(f"aten::{name}"))
    except Exception:  # noqa: BLE001 - no such operator
        return ()


def _node_schemas(node: fx.Node) -> tuple:
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return (node.target._schema,)
    name = node_name(node)
    return _schemas(name) if name else ()


def mutated_inputs(node: fx.Node) -> list[fx.Node]:
    """The input nodes ``node`` may write in place (``self`` of ``x.add_()``, ``out=``, setitem's target, the input
    of ``F.relu(x, inplace=True)``).

    The same direction as :func:`is_pure`: only calls whose effects are known are trusted, from their ATen schema
    (tensor methods, OpOverloads, ``torch.*`` bindings) or from the lists above. Any other call - a Python function
    allowed in the graph, a module call, a higher-order op, a binding with no schema of its name - may write every
    tensor it receives (:func:`unknown_call`), so what relies on this (a weight or ids read after it, a logits
    chain) takes its safe branch."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return []
    written: list[Any] = []
    if node.op == "call_function" and node.target in WRITING_OPERATORS:
        written.append(node.args[0])
    elif node.op == "call_function" and (node.target in PURE_PYTHON or node.target in PURE_BUILTINS):
        if node.args and _in_place_flag(node):
            written.append(node.args[0])
        if node.target is torch.nn.functional.embedding and node.kwargs.get(
                "max_norm", node.args[3] if len(node.args) > 3 else None) is not None:
            written.append(node.kwargs.get("weight", node.args[1] if len(node.args) > 1 else None))
    elif node.op == "call_method" and node.target in PURE_METHODS:
        pass
    elif unknown_call(node):
        written.extend(n for n in node.all_input_nodes if not isinstance(_value(n), NOT_TENSORS))
    else:
        for schema in _node_schemas(node):
            for i, arg in enumerate(schema.arguments):
                info = arg.alias_info
                if info is None or not info.is_write or str(arg.type) not in ("Tensor", "Optional[Tensor]"):
                    continue  # (``aten::sort(int[](a!) self)`` sorts Python lists)
                if arg.kwarg_only or arg.name == "out":
                    if arg.name in node.kwargs:
                        written.append(node.kwargs[arg.name])
                elif i < len(node.args):
                    written.append(node.args[i])
                elif arg.name in node.kwargs:
                    written.append(node.kwargs[arg.name])
        if "out" in node.kwargs:
            written.append(node.kwargs["out"])
        if node.op == "call_function" and node.args and _in_place_flag(node):
            written.append(node.args[0])
    nodes: list[fx.Node] = []
    for w in written:
        for n in (w if isinstance(w, (tuple, list)) else (w,)):
            if isinstance(n, fx.Node) and n not in nodes:
                nodes.append(n)
    return nodes


NOT_TENSORS = (int, float, bool, str, torch.SymInt, torch.SymFloat, torch.SymBool, torch.dtype, torch.device)


def _value(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def unknown_call(node: fx.Node) -> bool:
    """A call whose effects nanospec cannot read: not an ATen op, a tensor method or a ``torch.*`` binding with a
    schema of its name, nor a known pure Python target (a function allowed in the graph, a module call, a
    higher-order op such as ``torch.cond``)."""
    if node.op == "call_module":
        return True
    if node.op == "call_method":
        return node.target not in PURE_METHODS and not _schemas(node.target)
    if node.op != "call_function":
        return False
    target = node.target
    if target in WRITING_OPERATORS or target in PURE_PYTHON or target in PURE_BUILTINS:
        return False
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    if getattr(target, "__objclass__", None) in (torch.Tensor, torch._C.TensorBase):  # ``torch.Tensor.add_``
        return not _schemas(target.__name__)
    module = getattr(target, "__module__", None) or ""
    if module.startswith(("torch._C._functorch", "torch._functorch")) and node_name(node) in FUNCTORCH_WRAPPERS:
        return False
    return not (module in SCHEMA_NAMESPACES and _schemas(node_name(node) or ""))


@functools.lru_cache(maxsize=None)
def _random(name: str) -> bool:
    """An ATen op of that name draws random numbers (``Tag.nondeterministic_seeded``: removing it moves the RNG)."""
    packet = getattr(torch.ops.aten, name, None)
    try:
        overloads = [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
    except Exception:  # noqa: BLE001 - not an op packet
        return True
    return any(torch.Tag.nondeterministic_seeded in o.tags for o in overloads)


def _in_place_flag(node: fx.Node) -> bool:
    """``F.relu(x, inplace=True)``: a functional form told to write its input (or maybe: not a constant)."""
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):  # a builtin with no signature, or args it does not take
        return False
    return bound.arguments.get("inplace", False) is not False


def _schema_pure(node: fx.Node, name: str | None) -> bool:
    """A call bound to ATen ops of ``name`` that writes none of its inputs here and draws no random numbers."""
    in_place = name is not None and name.endswith("_") and not name.endswith("__")  # ``add_``, not ``__and__``
    return bool(name) and not in_place and bool(_schemas(name)) and not _random(name) \
        and not mutated_inputs(node)


def is_pure(node: fx.Node) -> bool:
    """Whether ``node`` is known to compute its result and do nothing else (an unused one may be removed).

    An allow-list: ops whose schema neither writes nor has effects nor is random (FX's ``Node.is_impure``
    first), known pure Python builtins and operators, and tensor methods / torch functions bound to such an
    ATen op. Everything else - module calls, higher-order ops, Python functions with no schema - is not.
    """
    if node.op == "get_attr":
        return True
    if node.op not in ("call_function", "call_method") or node.is_impure():
        return False
    target = node.target
    if node.op == "call_method":
        return not mutated_inputs(node) and (target in PURE_METHODS or _schema_pure(node, target))
    if target in WRITING_OPERATORS:
        return False
    if target is torch.nn.functional.embedding:  # ``max_norm`` renormalises the rows it reads, in place
        return node.kwargs.get("max_norm", node.args[3] if len(node.args) > 3 else None) is None
    if target in PURE_PYTHON or target in PURE_BUILTINS:
        return not _in_place_flag(node)
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return not mutated_inputs(node)  # FX checked the schema, the registered effects and the random tag
    return (getattr(target, "__module__", None) in SCHEMA_NAMESPACES and _schema_pure(node, node_name(node))
            and not _in_place_flag(node))


def has_side_effect(node: fx.Node) -> bool:
    """Whether removing ``node`` could change the program even when its result is unused: anything not known
    to be pure (:func:`is_pure`), so a call nanospec has never seen is kept."""
    return not is_pure(node)


def may_alias_input(node: fx.Node) -> bool:
    """Whether the value of ``node`` may share storage with one of its tensor inputs."""
    if node.op not in ("call_function", "call_method"):
        return node.op == "call_module"  # placeholders and the output node return nothing new
    if node.op == "call_function":
        if node.target in INPLACE_OPERATORS or node.target is operator.getitem:
            return True
        if node.target is getattr:
            return node.args[1] in VIEW_ATTRIBUTES
        if node.target in PURE_PYTHON or node.target is operator.setitem:
            return False
    schemas = _node_schemas(node)
    if not schemas:
        return True  # unknown: assume it may
    for schema in schemas:
        out_variant = any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if out_variant and "out" not in node.kwargs:
            continue  # ``torch.tanh(x, out=y)`` returns y; ``torch.tanh(x)`` is fresh
        if any(ret.alias_info is not None for ret in schema.returns):
            return True
    return False


def dead_code_eliminate(graph: fx.Graph) -> None:
    """Dead-code elimination that removes only unused nodes known to be pure (see :func:`is_pure`); counts them
    (``torch._dynamo.utils.counters["nanospec"]["dce_removed"]``)."""
    before = len(graph.nodes)
    graph.eliminate_dead_code(is_impure_node=has_side_effect)
    removed = before - len(graph.nodes)
    counters["nanospec"]["dce_removed"] += removed
    log.debug("dead-code elimination removed %d node(s)", removed)

