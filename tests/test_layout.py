"""The package's layering: a lean runtime, self-contained passes/ and kernels/, evaluation kept apart."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import run_python

ROOT = Path(__file__).resolve().parents[1]
EVAL_ONLY = ("click", "rich", "matplotlib", "transformers")


def run_fresh(code: str) -> str:
    return run_python(code).stdout


@pytest.mark.slow
def test_import_nanospec_fx_is_lean():
    out = run_fresh(f"""
        import sys
        import nanospec_fx
        bare = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton"))
        # every runtime name and module, loaded
        from nanospec_fx import (ActiveVocab, FrequencyTable, HeadCost, NanoSpecOptions, attach, compile, explain,
                                 nanospec_backend, speculative_pair)
        import nanospec_fx.eagle, nanospec_fx.testing, nanospec_fx.passes, nanospec_fx.kernels
        import torch
        heavy = sorted({{m.split(".")[0] for m in sys.modules}} & set({EVAL_ONLY!r}))
        evaluation = sorted(m for m in sys.modules if m.startswith("nanospec_fx.eval"))
        print(bare, heavy, evaluation, torch.cuda.is_initialized())
    """)
    assert out.split() == ["[]", "[]", "[]", "False"], out


def _imports(path: Path) -> list[tuple[str, int]]:
    """(module, relative level) of every import statement in ``path``, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", node.level))
    return found


def test_passes_and_kernels_import_nothing_else_of_nanospec_fx():
    for package in ("passes", "kernels"):
        for path in sorted((ROOT / package).rglob("*.py")):
            depth = len(path.relative_to(ROOT / package).parts)  # 1 for a module of the package, 2 in a subpackage
            for module, level in _imports(path):
                assert level <= depth, f"{path.name}: a relative import leaves {package}/"
                # passes/ builds its op calls from the ops' declaration (kernels/schema.py), nothing else of kernels/
                allowed = (f"nanospec_fx.{package}",) + (("nanospec_fx.kernels.schema",) if package == "passes" else ())
                if module.split(".")[0] == "nanospec_fx":
                    assert module.startswith(allowed), f"{package}/{path.name} imports {module}"
                assert module.split(".")[0] not in ("passes", "kernels") or level, f"{path.name}: top-level {module}"


def test_the_runtime_never_imports_the_evaluation():
    runtime = [
        p
        for p in sorted((ROOT / "nanospec_fx").rglob("*.py"))
        if "eval" not in p.relative_to(ROOT / "nanospec_fx").parts
    ]
    runtime += sorted((ROOT / "passes").rglob("*.py")) + sorted((ROOT / "kernels").rglob("*.py"))
    assert len(runtime) > 15
    for path in runtime:
        for module, _ in _imports(path):
            assert not module.startswith("nanospec_fx.eval"), f"{path.relative_to(ROOT)} imports {module}"
            assert module.split(".")[0] not in ("click", "rich", "matplotlib"), (
                f"{path.relative_to(ROOT)} imports {module}"
            )


def test_every_package_directory_is_installed():
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    roots = {"nanospec_fx": ROOT / "nanospec_fx", **{k: ROOT / v for k, v in setuptools["package-dir"].items()}}
    found = set()
    for name, path in roots.items():
        for init in path.rglob("__init__.py"):
            found.add(".".join([name, *init.parent.relative_to(path).parts]))
    assert found == listed
    assert setuptools["package-data"] == {"nanospec_fx.eval.data": ["*.jsonl"]}


# Cycles other owners are removing (issue 17); an entry goes when its cycle does. Nothing may join this list.
KNOWN_CYCLES: set = set()


def _package_modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package) of every module of nanospec_fx, passes/ and kernels/ as installed."""
    found = {}
    for base, name in ((ROOT / "nanospec_fx", "nanospec_fx"), (ROOT / "passes", "nanospec_fx.passes"),
                       (ROOT / "kernels", "nanospec_fx.kernels")):
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if name == "nanospec_fx" and parts[0] in ("passes", "kernels"):  # a checkout's links to the packages
                continue
            found[".".join((name, *parts)).removesuffix(".__init__")] = (path, parts[-1] == "__init__")
    return found


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports, at any depth (a lazy import in a function closes a cycle just
    the same), type-only ones (``if TYPE_CHECKING:``) included: a module that needs another's types to be read
    depends on it as much as one that runs it."""
    modules, graph = _package_modules(), {}
    for module, (path, is_package) in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        package = module if is_package else module.rpartition(".")[0]
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                submodules = {f"{source}.{alias.name}" for alias in node.names} & set(modules)
                edges |= submodules | ({source} if len(submodules) < len(node.names) else set())
        graph[module] = (edges & set(modules)) - {module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each as a sorted tuple."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                found.add(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle_and_nothing_else():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {("a", "b", "c")}
    assert _cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == set()


def test_the_package_has_no_import_cycle():
    graph = _import_graph()
    assert len(graph) > 40 and "nanospec_fx.vocab.state" in graph["nanospec_fx.compiler.stages"]  # the graph sees the imports
    new = _cycles(graph) - KNOWN_CYCLES
    assert not new, f"import cycles: {sorted(new)}"


def test_a_top_level_kernels_import_from_the_checkout_is_never_our_package():
    """Run from the repository root (``python -c``, a doc snippet), ``import kernels`` finds this checkout's kernels/
    first. transformers imports Hugging Face's ``kernels`` under that name: it must get that library where one is
    installed, and otherwise an empty package (never a second registration of the nanospec ops)."""
    import importlib.metadata

    out = run_python(
        "import kernels, torch; print(kernels.__file__); print(hasattr(torch.ops.nanospec, 'observe'))", cwd=ROOT
    ).stdout.split()
    try:
        importlib.metadata.version("kernels")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    assert out[1] == "False", "the top-level import registered the nanospec ops"
    if installed:
        # (a venv inside the checkout, as CI's, holds the real library under ROOT: compare with our kernels/ only)
        assert not out[0].startswith(str(ROOT / "kernels") + "/"), f"our kernels/ shadowed Hugging Face's kernels: {out[0]}"
        run_python("import transformers.integrations.hub_kernels", cwd=ROOT)
    else:
        assert out[0] == str(ROOT / "kernels" / "__init__.py")


def _stage_list(package: Path) -> list[str]:
    """The stage list a package's ``__init__`` docstring gives (its ``* ``name`` - ...`` lines), in order."""
    import re

    return re.findall(r"^\* ``(\w+)``", ast.get_docstring(ast.parse((package / "__init__.py").read_text())), re.M)


# The passes in stage order, as passes/__init__.py states it: every module of passes/ is listed (a subpackage as one
# stage), and a module imports only modules listed before it (a subpackage's own list likewise).
PASS_STAGES = _stage_list(ROOT / "passes")


def test_the_stage_lists_name_every_module():
    for package in (ROOT / "passes", *[p.parent for p in (ROOT / "passes").glob("*/__init__.py")]):
        modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
        modules |= {p.parent.name for p in package.glob("*/__init__.py")}
        assert sorted(_stage_list(package)) == sorted(modules), package


def test_the_passes_import_only_earlier_stages():
    graph = _import_graph()
    for package, name in ((ROOT / "passes", "nanospec_fx.passes"),
                          *[(p.parent, f"nanospec_fx.passes.{p.parent.name}") for p in (ROOT / "passes").glob("*/__init__.py")]):
        stages = _stage_list(package)
        assert len(stages) > 5, package
        for i, stage in enumerate(stages):
            later = {f"{name}.{s}" for s in stages[i + 1:]}
            reads = set().union(*(v for k, v in graph.items() if k == f"{name}.{stage}" or k.startswith(f"{name}.{stage}.")))
            later_reached = {m for m in reads if any(m == x or m.startswith(x + ".") for x in later)}
            assert not later_reached, f"{stage} imports a later stage: {sorted(later_reached)}"


# The layers of the package, lowest first: what each part of nanospec_fx may import (besides itself, torch and the
# standard library). docs/architecture.md draws the same table. A new subpackage must be placed here to pass.
LAYERS = {
    "kernels": set(),                                   # ops, Triton kernels, torch reference, selection
    "passes": {"kernels"},                              # FX passes (of kernels/, only the op schema: see above)
    "sampling": set(),                                  # speculative sampling rules
    "vocab": {"kernels"},                               # the active-vocabulary state and its options
    "parallel": {"vocab", "kernels"},                   # the vocabulary-parallel state at run time
    "diagnostics": {"vocab", "kernels"},                # warnings, diagnosis, active_vocab, explain, cost model
    "compiler": {"diagnostics", "parallel", "vocab", "passes", "kernels"},   # the backend: plan, then execute
    "eagle": {"diagnostics", "vocab", "sampling", "kernels"},                 # the EAGLE drafter and decode loop
    "testing": {"compiler", "diagnostics", "vocab", "passes", "kernels", "sampling"},  # the contract in users' CI
    "integrations": {"compiler", "diagnostics", "parallel", "vocab", "passes", "kernels", "sampling"},
    "eval": {"integrations", "testing", "eagle", "compiler", "diagnostics", "parallel", "vocab", "passes",
             "kernels", "sampling", ""},                # the evaluation extra: may use the public API ("")
    "": {"integrations", "testing", "eagle", "compiler", "diagnostics", "parallel", "vocab", "kernels", "sampling"},
}


def _layer(module: str) -> str:
    """``nanospec_fx.vocab.state`` -> ``vocab``; the package itself (its lazy public names) -> ``""``."""
    return module.split(".")[1] if "." in module else ""


def test_the_layer_table_is_a_partial_order():
    assert _cycles({layer: allowed for layer, allowed in LAYERS.items()}) == set()
    assert all(allowed <= set(LAYERS) for allowed in LAYERS.values())


def _against_layers(graph: dict[str, set[str]]) -> list[str]:
    """The imports of ``graph`` that cross from one part to another the layer table does not allow."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if _layer(a) != _layer(b) and _layer(b) not in LAYERS.get(_layer(a), ()))


def test_the_layer_check_flags_an_import_against_the_table():
    graph = {"nanospec_fx.vocab.state": {"nanospec_fx.kernels.ops", "nanospec_fx.compiler.plan"},
             "nanospec_fx.compiler.plan": {"nanospec_fx.vocab.state"}}
    assert _against_layers(graph) == ["nanospec_fx.vocab.state -> nanospec_fx.compiler.plan"]


def test_every_import_follows_the_layer_table():
    graph = _import_graph()
    layers = {_layer(m) for m in graph}
    assert layers == set(LAYERS), f"place in LAYERS: {sorted(layers - set(LAYERS))}; gone: {sorted(set(LAYERS) - layers)}"
    wrong = _against_layers(graph)
    assert not wrong, "imports against the layer table:\n" + "\n".join(wrong)
