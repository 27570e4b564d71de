"""Markdown tables from the JSON files that ``nanospec-fx`` writes (for docs/results.md), by
:mod:`nanospec_fx.eval.markdown`.

    python benchmarks/report.py benchmarks/results/*.json
    python benchmarks/report.py --sweep benchmarks/results/e2e-eagle-gemma3-d{1-subset,2,3,4}.json   # a depth sweep
"""
from __future__ import annotations

import sys
from pathlib import Path

from nanospec_fx.eval.markdown import eagle_sweep, render


def main(argv: list[str]) -> str:
    if argv[:1] == ["--sweep"]:  # one pooled table over runs of one depth each
        return eagle_sweep([Path(p) for p in argv[1:]])
    return "\n".join(render(Path(p)) for p in argv)


if __name__ == "__main__":
    print(main(sys.argv[1:]))
