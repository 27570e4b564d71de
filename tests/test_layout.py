"""The package's layering: a lean runtime, self-contained passes/ and kernels/, evaluation kept apart."""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EVAL_ONLY = ("click", "rich", "matplotlib", "transformers")


def run_fresh(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


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
        for path in sorted((ROOT / package).glob("*.py")):
            for module, level in _imports(path):
                assert level <= 1, f"{path.name}: a relative import leaves {package}/"
                if module.split(".")[0] == "nanospec_fx":
                    assert module.startswith(f"nanospec_fx.{package}"), f"{package}/{path.name} imports {module}"
                assert module.split(".")[0] not in ("passes", "kernels") or level, f"{path.name}: top-level {module}"


def test_the_runtime_never_imports_the_evaluation():
    runtime = [p for p in sorted((ROOT / "nanospec_fx").rglob("*.py")) if "eval" not in p.relative_to(ROOT / "nanospec_fx").parts]
    runtime += sorted((ROOT / "passes").glob("*.py")) + sorted((ROOT / "kernels").glob("*.py"))
    assert len(runtime) > 15
    for path in runtime:
        for module, _ in _imports(path):
            assert not module.startswith("nanospec_fx.eval"), f"{path.relative_to(ROOT)} imports {module}"
            assert module.split(".")[0] not in ("click", "rich", "matplotlib"), f"{path.relative_to(ROOT)} imports {module}"


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
