"""The ``options`` walk of one compile: which nanospec modules a compile's options pass through, and how often it
comes back to one it left (issue 41's measure of back and forth in the compile path).

One drafter with one head is compiled by the nanospec backend (inductor off: the walk is nanospec's, not
inductor's). A profiler records every call of a nanospec function (``nanospec_fx.*``, passes and kernels included)
that holds the options in its arguments, or that a function holding them (in its arguments or variables) makes:
the path the options take, where they go and what the functions holding them call. "Them": the parsed
``NanoSpecOptions``, the plan, a head's plan, or an object (a builder, a list) holding one of them one level down.
A *stay* is a run of such calls in one module; a *return* is a stay in a module an earlier stay already left.
A count, not a timing: it does not depend on the machine's load.

    python benchmarks/options_walk.py [--out benchmarks/results/options_walk.json]

prints the walk as JSON (with ``--out``: also written there, with its provenance). Issue 41 measured it before the
compiler planned once (commit eff0b73, the same script: 39 stays in 16 modules, 23 returns) and asks <= 15 stays
with <= 5 returns; ``tests/compiler/test_plan.py`` holds the compiler to that.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn

TRACKED = ("NanoSpecOptions", "CompilePlan", "HeadPlan")


class Drafter(nn.Module):
    """Embedding -> one MLP -> the LM head: one head, one token lookup."""

    def __init__(self, vocab: int = 64, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.up = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        return self.lm_head(torch.relu(self.up(self.embed(ids))))


def _holds(value, depth: int = 1) -> bool:
    if type(value).__name__ in TRACKED:
        return True
    if depth == 0:
        return False
    if isinstance(value, (list, tuple)):
        return any(_holds(v, 0) for v in value)
    attrs = getattr(value, "__dict__", None)
    return isinstance(attrs, dict) and any(_holds(v, 0) for v in list(attrs.values()))


def _holds_in_locals(frame) -> bool:
    """A nanospec frame whose variables (at a call event: its arguments) hold the options."""
    if not frame.f_globals.get("__name__", "").startswith("nanospec_fx"):
        return False
    return any(_holds(value) for value in list(frame.f_locals.values()))


def walk(options: dict | None = None) -> list[tuple[str, str]]:
    """(module, function) of every nanospec call whose arguments hold the options, in call order."""
    import nanospec_fx

    calls: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("nanospec_fx") or module == __name__:
            return
        if _holds_in_locals(frame) or (frame.f_back is not None and _holds_in_locals(frame.f_back)):
            calls.append((module, frame.f_code.co_name))

    torch._dynamo.reset()
    model = Drafter().eval()
    compiled = torch.compile(model, backend=nanospec_fx.BACKEND_NAME,
                             options={"capacity": 16, "inductor": False, **(options or {})})
    sys.setprofile(profile)
    try:
        with torch.no_grad():
            compiled(torch.tensor([[1, 2, 3]]))
    finally:
        sys.setprofile(None)
    return calls


def stays(calls: list[tuple[str, str]]) -> list[str]:
    """The modules of the walk, consecutive calls in one module merged."""
    out: list[str] = []
    for module, _ in calls:
        if not out or out[-1] != module:
            out.append(module)
    return out


def measure() -> dict:
    calls = walk()
    runs = stays(calls)
    return {"stays": len(runs), "modules": len(set(runs)), "returns": len(runs) - len(set(runs)), "walk": runs,
            "calls": [f"{m}.{f}" for m, f in calls]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the walk here, as JSON with its provenance")
    args = parser.parse_args()
    result = measure()
    print(json.dumps(result, indent=1))
    if args.out is not None:
        from nanospec_fx.eval.report import provenance

        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": "python benchmarks/options_walk.py --out " + str(args.out),
                                        "provenance": provenance(), **result}, indent=1))


if __name__ == "__main__":
    main()
