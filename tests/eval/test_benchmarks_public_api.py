"""The scripts in benchmarks/ use only the public API (benchmarks/README.md): no private name of nanospec_fx, no
kernels/ or passes/ internals, no other script; every clock is nanospec_fx.eval.bench.timing's; and every
nanospec_fx module and name they import exists."""
from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))
CLOCKS = {"perf_counter", "perf_counter_ns", "process_time", "process_time_ns", "monotonic", "monotonic_ns", "time",
          "time_ns", "thread_time"}


def _imports(tree: ast.AST) -> list[tuple[str, list[str], int]]:
    """(module, names imported from it, line) of every import, nested ones included (``import a.b``: names [])."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.module or "", [alias.name for alias in node.names], node.lineno))
    return found


def _ours(module: str) -> bool:
    return module.split(".")[0] in ("nanospec_fx", "kernels", "passes")


def violations(path: Path) -> list[str]:
    """What in one script breaks the rules, one line each (empty: none)."""
    tree = ast.parse(path.read_text(), str(path))
    scripts = {p.stem for p in SCRIPTS}
    found, aliases = [], set()
    for module, names, line in _imports(tree):
        where = f"{path.name}:{line}"
        if module.split(".")[0] in scripts:
            found.append(f"{where} imports the script {module} (move what it shares into nanospec_fx/eval/)")
        if not _ours(module):
            continue
        if module.split(".")[0] != "nanospec_fx" or module.startswith(("nanospec_fx.kernels", "nanospec_fx.passes")):
            found.append(f"{where} imports {module} (internals: call the ops, or nanospec_fx.eval.bench.kernel_config)")
        found += [f"{where} imports the private {module}" for part in module.split(".") if part.startswith("_")][:1]
        found += [f"{where} imports the private {module}.{name}" for name in names if name.startswith("_")]
    for node in ast.walk(tree):  # names bound to our modules or objects, then attributes read through them
        if isinstance(node, (ast.Import, ast.ImportFrom)) and _ours(getattr(node, "module", None) or node.names[0].name):
            aliases |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{path.name}:{node.lineno} reads the private {node.value.id}.{node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr in CLOCKS and isinstance(f.value, ast.Name) and f.value.id == "time":
                found.append(f"{path.name}:{node.lineno} reads time.{f.attr}() (use nanospec_fx.eval.bench.timing)")
            if f.attr == "Event" and ast.unparse(f.value) == "torch.cuda":
                found.append(f"{path.name}:{node.lineno} times with torch.cuda.Event (use timing.device_timings)")
    return found


def test_the_rules_catch_private_and_internal_imports_and_clocks(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom nanospec_fx.kernels import reference\nfrom nanospec_fx.eval.bench import "
                   "eagle_e2e as B\nfrom nanospec_fx._x import y\nfrom nanospec_fx.eval import _hidden\n"
                   "B._reset(None)\nt = time.perf_counter()\nfrom gpu_bench import graphed\n")
    found = "\n".join(violations(bad))
    for needle in ("imports nanospec_fx.kernels", "private nanospec_fx._x", "private nanospec_fx.eval._hidden",
                   "private B._reset", "time.perf_counter()", "the script gpu_bench"):
        assert needle in found, found


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_benchmarks_import_only_public_names(path):
    assert not violations(path)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_what_benchmarks_import_of_nanospec_fx_exists(path):
    """Each nanospec_fx module imports (with the dev extra), and each name imported from it is there."""
    for module, names, line in _imports(ast.parse(path.read_text())):
        if module.split(".")[0] != "nanospec_fx":
            continue
        loaded = importlib.import_module(module)
        for name in names:
            assert hasattr(loaded, name) or importlib.util.find_spec(f"{module}.{name}"), (
                f"{path.name}:{line}: {module} has no {name}")
