"""Evaluation of nanospec on real models and text: the ``nanospec-fx`` CLI, benchmarks, coverage,
model/corpus loaders and their bundled data.

It needs the ``[eval]`` extra (click, rich, matplotlib and the offline model/corpus packages); the
runtime (``import nanospec_fx``) never imports this subpackage.
"""
from __future__ import annotations

import importlib.util
import sys

INSTALL_HINT = "pip install 'nanospec-fx[eval]'"
CLI_REQUIREMENTS = ("click", "rich", "matplotlib")


def main() -> None:
    """Entry point of ``nanospec-fx``: a plain install hint (no terminal markup) when the extra is missing."""
    missing = [name for name in CLI_REQUIREMENTS if importlib.util.find_spec(name) is None]
    if missing:
        sys.stderr.write(f"nanospec-fx needs {', '.join(missing)} (the [eval] extra). Install it with:\n"
                         f"    {INSTALL_HINT}\n")
        sys.exit(2)
    from nanospec_fx.eval.cli import main as cli_main

    cli_main()
