"""Markdown tables from the JSON files that ``nanospec-fx`` writes (for docs/results.md), by
:mod:`nanospec_fx.eval.markdown`.

    python benchmarks/report.py benchmarks/results/*.json
    python benchmarks/report.py --sweep benchmarks/results/e2e-eagle-gemma3-d{1-subset,2,3,4}.json   # a depth sweep
    python benchmarks/report.py --force benchmarks/results/X.json   # a run its JSON calls untrustworthy, said so
    python benchmarks/report.py --section split benchmarks/results/X.json   # one part of an EAGLE run: pooled,
                                                                            # paired or split

A run whose JSON says it is oversubscribed, or whose verify times show load spikes, is refused (exit status 2)
unless --force.
"""
from __future__ import annotations

import sys
from pathlib import Path

from nanospec_fx.eval.markdown import Untrustworthy, eagle_sweep, render


def main(argv: list[str]) -> str:
    force = "--force" in argv
    argv = [a for a in argv if a != "--force"]
    section = None
    if "--section" in argv:
        at = argv.index("--section")
        section, argv = argv[at + 1], argv[:at] + argv[at + 2:]
    if argv[:1] == ["--sweep"]:  # one pooled table over runs of one depth each
        return eagle_sweep([Path(p) for p in argv[1:]])
    return "\n".join(render(Path(p), force, section) for p in argv)


if __name__ == "__main__":
    try:
        print(main(sys.argv[1:]))
    except Untrustworthy as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
