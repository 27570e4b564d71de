"""The passes build and read nanospec op calls by the argument names kernels/schema.py declares: a renamed
argument fails at the first build, a reordered one moves the emitted positions with it, and every op call
written in passes/ names a declared op and declared arguments."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from nanospec_fx.kernels import schema
from nanospec_fx.kernels.schema import OpSignature, is_op, op_arg, op_call

ROOT = Path(__file__).resolve().parents[2]
PASSES = ROOT / "passes"
RUNTIME = ROOT / "nanospec_fx"
SCATTER = "(Tensor compact, Tensor ids, Tensor cursor, int vocab_size) -> Tensor"


def _graph_with_inputs(*names):
    graph = fx.Graph()
    return graph, {n: graph.placeholder(n) for n in names}


def test_the_builder_orders_named_arguments_as_declared():
    graph, p = _graph_with_inputs("c", "i", "k")
    node = op_call(graph, "scatter_logits", vocab_size=7, cursor=p["k"], ids=p["i"], compact=p["c"])
    assert node.target is torch.ops.nanospec.scatter_logits.default
    assert node.args == (p["c"], p["i"], p["k"], 7) and node.kwargs == {}
    assert [op_arg(node, n) for n in ("compact", "ids", "cursor", "vocab_size")] == [p["c"], p["i"], p["k"], 7]
    assert is_op(node, "scatter_logits") and not is_op(node, "head_logits")


def test_a_renamed_argument_breaks_the_build():
    renamed = OpSignature("scatter_logits", SCATTER.replace("vocab_size", "vocab"))
    graph, p = _graph_with_inputs("c", "i", "k")
    with pytest.raises(TypeError, match="declares no argument vocab_size"):
        renamed.call(graph, compact=p["c"], ids=p["i"], cursor=p["k"], vocab_size=7)
    with pytest.raises(TypeError, match="declares no argument vocab_size"):
        renamed.index("vocab_size")


def test_a_reordered_declaration_moves_the_emitted_positions():
    reordered = OpSignature("scatter_logits", "(Tensor ids, Tensor compact, int vocab_size, Tensor cursor) -> Tensor")
    graph, p = _graph_with_inputs("c", "i", "k")
    given = {"compact": p["c"], "ids": p["i"], "cursor": p["k"], "vocab_size": 7}
    assert reordered.args(**given) == (p["i"], p["c"], 7, p["k"])
    assert [reordered.index(n) for n in ("compact", "ids", "cursor", "vocab_size")] == [1, 0, 3, 2]


def test_missing_arguments_and_undeclared_ops_fail_loudly():
    graph, p = _graph_with_inputs("c", "i")
    with pytest.raises(TypeError, match="cursor"):
        op_call(graph, "scatter_logits", compact=p["c"], ids=p["i"], vocab_size=7)
    with pytest.raises(KeyError, match="not declared"):
        op_call(graph, "scatter", compact=p["c"])
    # a declared default may be left out at the end, never before an argument that is given
    topk = schema.signature("compact_topk")
    assert len(topk.args(compact=1, ids=2, cursor=3, k=4)) == 4
    plain = OpSignature("compact_topk", "(Tensor compact, int k=1, bool largest=True) -> (Tensor, Tensor)")
    with pytest.raises(TypeError, match="k not given"):
        plain.args(compact=1, largest=False)


def test_built_calls_run_the_registered_op():
    """The declared positions are the registered op's: a call built by name computes what a direct call does."""
    graph, p = _graph_with_inputs("c", "i", "k")
    graph.output(op_call(graph, "scatter_logits", compact=p["c"], ids=p["i"], cursor=p["k"], vocab_size=6))
    compact, ids, cursor = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([4, 0, -1]), torch.tensor([2])
    got = fx.GraphModule(torch.nn.Module(), graph)(compact, ids, cursor)
    inf = float("-inf")
    assert torch.equal(got, torch.tensor([[2.0, inf, inf, inf, 1.0, inf]]))


def _op_uses_in_passes():
    """(file, line, op, argument names) of every op_call / is_op / op_arg written in passes/."""
    uses = []
    for path in sorted(PASSES.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or getattr(node.func, "id", None) not in ("op_call", "is_op", "op_arg"):
                continue
            name = node.func.id
            if name == "op_arg":  # op_arg(node, "name"); a computed name is checked where it is written
                arg = node.args[1]
                uses.append((path.name, node.lineno, None, [arg.value] if isinstance(arg, ast.Constant) else []))
                continue
            op = node.args[1]
            assert isinstance(op, ast.Constant), f"{path.name}:{node.lineno}: the op of {name} is not written out"
            keys = [k.arg for k in node.keywords if k.arg is not None]
            for k in node.keywords:  # ``**{n: ... for n in (...)}``
                if k.arg is None and isinstance(k.value, ast.DictComp):
                    keys += [e.value for e in k.value.generators[0].iter.elts]
            uses.append((path.name, node.lineno, op.value, keys))
    return uses


def test_every_op_call_in_passes_names_declared_ops_and_arguments():
    uses = _op_uses_in_passes()
    emitted = {op for _, _, op, _ in uses if op}
    assert emitted == set(schema.OPS), emitted  # the passes emit (or look for) every declared op
    every_argument = {a for op in schema.OPS for a in schema.arguments(op)}
    for file, line, op, keys in uses:
        for name in keys:
            declared = schema.arguments(op) if op else every_argument
            assert name in declared, f"passes/{file}:{line}: {op or 'op_arg'} has no declared argument {name}"


def _package_modules():
    """Every module of passes/ and nanospec_fx/ (kernels/, which registers the ops, lives beside them)."""
    return sorted(PASSES.glob("*.py")) + sorted(RUNTIME.rglob("*.py"))


def _names_nanospec_ops(tree: ast.AST) -> list[int]:
    """Lines of code (not text) that reach ``torch.ops.nanospec`` (``torch.ops.nanospec.observe.default(...)``)."""
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "nanospec"
            and isinstance(n.value, ast.Attribute) and n.value.attr == "ops"]


def test_no_module_names_a_nanospec_op_outside_the_builder():
    """passes/ builds op calls with op_call (by declared names); nanospec_fx/ calls the registered ops of
    kernels.ops. Neither reaches ``torch.ops.nanospec``, where a call is written by
    position (a traced ``torch.ops.nanospec.observe.default(x, w, ...)`` is what this once caught)."""
    for path in _package_modules():
        lines = _names_nanospec_ops(ast.parse(path.read_text(), str(path)))
        assert not lines, f"{path.relative_to(ROOT)}:{lines} names a nanospec op outside the builder"


# Eager calls written by position: none may be (a file that must would be listed here, with its reason).
POSITIONAL_CALLERS: set[str] = set()


def _positional_op_calls(tree: ast.AST) -> list[int]:
    """Lines of eager calls of a declared op (``ops.<op>(...)``) with a positional argument."""
    declared = set(schema.OPS)
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in declared and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "ops" and n.args]


def test_eager_op_calls_pass_their_arguments_by_name():
    """An eager call of a declared op in nanospec_fx/ names its arguments (``ops.observe(token_ids=x, ...)``), so a
    reordered declaration cannot shift them silently; ``**dict(zip(STATE, tensors))`` names them from the schema."""
    for path in sorted(RUNTIME.rglob("*.py")):
        if path.name not in POSITIONAL_CALLERS:
            lines = _positional_op_calls(ast.parse(path.read_text(), str(path)))
            assert not lines, f"{path.relative_to(ROOT)}:{lines}: a nanospec op called by position"


def test_the_guards_see_a_positional_call():
    """The two checks above find what they look for, and only that."""
    tree = ast.parse("torch.ops.nanospec.observe.default(x, w)\n"
                     "ops.observe(x, w)\n"
                     "ops.observe(token_ids=x, **dict(zip(STATE, t)))\n"
                     "torch.ops.aten.add(x, w)\n"
                     "ops.something_else(x)\n")
    assert _names_nanospec_ops(tree) == [1]
    assert _positional_op_calls(tree) == [2]
