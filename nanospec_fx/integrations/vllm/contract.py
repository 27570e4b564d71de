"""What an adapter touches in vLLM's private API, as data, and a check of it against a release's source.

Each version adapter declares ``CONTRACT``: the classes, methods (with their parameter names), attributes and
environment variables it reads or patches. :func:`check` parses the release's ``.py`` files (``ast``; nothing is
imported, so any release's source can be checked on any machine) and names every piece that is missing or changed:
a new vLLM release fails one test that says which. ``python -m nanospec_fx.integrations.vllm.contract fetch DIR``
puts the needed files of every supported release under ``DIR/<version>/`` (``pip download``, then only the files).
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Symbol:
    """One piece of vLLM an adapter relies on.

    ``kind``: ``method`` (``def name`` in class ``owner`` whose first parameters are ``params``), ``attribute``
    (``self.name = ...`` in one of ``owner``'s methods, a class-level field, or a property), ``function`` (a
    module-level ``def name``), ``class`` (a module-level ``class name`` whose bases include ``params``), ``env``
    (the string ``name`` in the file: an environment variable vLLM reads)."""

    path: str
    owner: str | None
    name: str
    kind: str = "attribute"
    params: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = f"{self.owner}.{self.name}" if self.owner else self.name
        params = f"({', '.join(self.params)}, ...)" if self.kind == "method" else \
            f"({', '.join(self.params)})" if self.kind == "class" and self.params else ""
        return f"{self.kind} {where}{params} in {self.path}"


def method(path: str, owner: str, name: str, *params: str) -> Symbol:
    return Symbol(path, owner, name, "method", ("self",) + params)


def class_(path: str, name: str, *bases: str) -> Symbol:
    return Symbol(path, None, name, "class", bases)


def attributes(path: str, owner: str, *names: str) -> tuple[Symbol, ...]:
    return tuple(Symbol(path, owner, n) for n in names)


def check(contract, read) -> list[str]:
    """The problems of ``contract`` against one release (``read(path)``: a source file's text, None if absent),
    one line each naming the symbol and what differs; empty when every piece is there."""
    problems, trees = [], {}
    for symbol in contract:
        if symbol.path not in trees:
            text = read(symbol.path)
            trees[symbol.path] = None if text is None else (text, ast.parse(text))
        parsed = trees[symbol.path]
        if parsed is None:
            problems.append(f"{symbol}: the file is missing")
            continue
        problem = _problem(symbol, *parsed)
        if problem:
            problems.append(f"{symbol}: {problem}")
    return problems


def _problem(symbol: Symbol, text: str, tree: ast.Module) -> str | None:
    if symbol.kind == "env":
        return None if repr(symbol.name)[1:-1] in text else "not read by this release"
    if symbol.kind == "class":
        found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == symbol.name]
        if not found:
            return "no such module-level class"
        bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else None
                 for b in found[0].bases]
        missing = [b for b in symbol.params if b not in bases]
        return f"bases are ({', '.join(str(b) for b in bases)})" if missing else None
    if symbol.owner is None:
        found = [n for n in tree.body
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == symbol.name]
        return None if found else "no such module-level function"
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == symbol.owner]
    if not classes:
        return f"no class {symbol.owner}"
    body = classes[0].body
    defs = {n.name: n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if symbol.kind == "method":
        node = defs.get(symbol.name)
        if node is None:
            return "no such method"
        args = node.args
        names = tuple(a.arg for a in args.posonlyargs + args.args + args.kwonlyargs)
        if names[:len(symbol.params)] != symbol.params:
            return f"parameters are ({', '.join(names)})"
        return None
    if symbol.name in defs:  # a property (or a method read as a value)
        return None
    for node in body:  # class-level fields: dataclasses, NamedTuples, annotated class attributes
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == symbol.name:
            return None
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == symbol.name for t in node.targets):
            return None
    for node in ast.walk(classes[0]):  # self.name = ... in any method
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if (isinstance(t, ast.Attribute) and t.attr == symbol.name and isinstance(t.value, ast.Name)
                    and t.value.id == "self"):
                return None
    return "no such attribute"


def files(contract) -> list[str]:
    """The source files a contract reads, in order."""
    return list(dict.fromkeys(s.path for s in contract))


def installed_root(adapter) -> Path | None:
    """The folder holding the installed ``vllm`` package when it is ``adapter``'s release (the ``WHEEL``
    distribution at ``RELEASE``, any local tag), found without importing vLLM; else None."""
    import importlib.metadata
    import importlib.util

    try:
        version = importlib.metadata.version(adapter.WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return None
    spec = importlib.util.find_spec("vllm")
    if version.split("+")[0] != adapter.RELEASE or spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.parent


def reader(root: Path):
    """``read(path)`` over a folder of vLLM's source (None for a missing file)."""
    def read(path: str) -> str | None:
        f = root / path
        return f.read_text() if f.is_file() else None
    return read


#: the file that says a release's whole Python package was kept (its classes are tested by importing it)
PACKAGE_MARK = ".nanospec-package"


def fetch(root: Path) -> None:
    """For every adapter whose release is not the installed vLLM: ``pip download`` its wheel (no dependencies) into
    a temporary folder and keep only the files its contract reads, under ``root/<version>/`` (skipped when they are
    all there already: the folder is a cache). An adapter with ``CLASS_TESTED_FROM_WHEEL`` keeps the wheel's whole
    Python package there instead (no compiled extension), which its class tests import over the venv's torch."""
    import subprocess
    import tempfile
    import time
    import zipfile

    from nanospec_fx.integrations.vllm import ADAPTERS, adapter_module

    for key in ADAPTERS:
        adapter = adapter_module(key)
        dest, needed = root / adapter.RELEASE, files(adapter.CONTRACT)
        package = getattr(adapter, "CLASS_TESTED_FROM_WHEEL", False)  # keep the whole Python package (importable)
        if installed_root(adapter) is not None:
            print(f"vLLM {adapter.RELEASE}: installed ({adapter.WHEEL}), read in place")
            continue
        if all((dest / p).is_file() for p in needed) and (not package or (dest / PACKAGE_MARK).is_file()):
            print(f"vLLM {adapter.RELEASE}: cached in {dest}")
            continue
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp,
                            f"{adapter.WHEEL}=={adapter.RELEASE}"], check=True)
            (wheel,) = Path(tmp).glob("*.whl")
            size = wheel.stat().st_size
            with zipfile.ZipFile(wheel) as z:
                names = set(z.namelist())
                if package:  # its Python files and metadata (no compiled extension: imported over a CPU torch)
                    needed = sorted(n for n in names if n.endswith((".py", ".json")) or ".dist-info/" in n)
                for p in needed:
                    if p in names:  # a missing file is the contract test's finding, not a fetch error
                        (dest / p).parent.mkdir(parents=True, exist_ok=True)
                        (dest / p).write_bytes(z.read(p))
            if package:
                (dest / PACKAGE_MARK).write_text(wheel.name)
        print(f"vLLM {adapter.RELEASE}: {len(needed)} files of {wheel.name} ({size / 1e6:.0f} MB, "
              f"{time.monotonic() - start:.0f} s) into {dest}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "fetch":
        sys.exit("usage: python -m nanospec_fx.integrations.vllm.contract fetch DIR")
    fetch(Path(sys.argv[2]))
