"""What a Dynamo-level FX node writes and what its result may alias, from torch's op schemas.

Dynamo graphs call Python-level targets (``torch.clamp_``, ``"masked_fill_"`` methods,
``operator.setitem``, ``operator.itruediv``) rather than ATen overloads. Their effects are read
from the ATen schemas of the same name (``aten::clamp_``: ``Tensor(a!) self``), plus the
Python operators that have no schema. Anything unknown is assumed to alias its inputs, so the
passes stay conservative (sound) on ops they have never seen.

Used by the head rewrite (a mutation or an alias of a compact logits value is a
materialisation point) and by every dead-code elimination the backend runs (an op that writes
an input survives even when its result is unused).
"""
from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx as fx

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


def _op_name(node: fx.Node) -> str | None:
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return target._schema.name.split("::")[-1]
        if isinstance(target, torch._ops.OpOverloadPacket):
            return target._qualified_op_name.split("::")[-1]
        return getattr(target, "__name__", None)
    return None


@functools.lru_cache(maxsize=None)
def _schemas(name: str) -> tuple:
    try:
        return tuple(torch._C._jit_get_schemas_for_operator(f"aten::{name}"))
    except Exception:  # noqa: BLE001 - no such operator
        return ()


def _node_schemas(node: fx.Node) -> tuple:
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return (node.target._schema,)
    name = _op_name(node)
    return _schemas(name) if name else ()


def mutated_inputs(node: fx.Node) -> list[fx.Node]:
    """The input nodes ``node`` writes in place (``self`` of ``x.add_()``, ``out=``, setitem's target)."""
    if node.op not in ("call_function", "call_method"):
        return []
    written: list[Any] = []
    if node.op == "call_function" and node.target in WRITING_OPERATORS:
        written.append(node.args[0])
    elif node.op == "call_function" and node.target in PURE_PYTHON:
        pass
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
    nodes: list[fx.Node] = []
    for w in written:
        for n in (w if isinstance(w, (tuple, list)) else (w,)):
            if isinstance(n, fx.Node) and n not in nodes:
                nodes.append(n)
    return nodes


def has_side_effect(node: fx.Node) -> bool:
    """Whether removing ``node`` could change the program even when its result is unused."""
    return node.is_impure() or bool(mutated_inputs(node))


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
    """Dead-code elimination that keeps every node with a side effect (see :func:`has_side_effect`)."""
    graph.eliminate_dead_code(is_impure_node=has_side_effect)
