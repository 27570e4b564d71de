"""The per-call cost of a nanospec op on a tiny CPU state: the Python and dispatcher machinery around its body.

On a state this small (V = 512, H = 16, C = 64, fp32, one thread) an op's own work is a few small torch ops, so a
good part of what a call costs is what surrounds it: torch's custom-op kernel, our kernel selection, the launch
context (issue 39). Calls as a decode loop makes them, under ``torch.inference_mode``: ``observe`` of 4 active ids,
``compact_logits`` of one row, ``compact_topk`` k=4 of those logits, through ``torch.ops.nanospec`` (eager, the
host path), and the host path's function called directly (``... body``: the body alone). Per call: the median
process CPU time of ``--calls`` calls (after 100 untimed; all interleaved, so load changes hit each alike) and,
exact, the Python function calls one op call makes (``sys.setprofile`` events; the same on every run of one
checkout). The machine this runs on is shared: the JSON says so and its timings are indicative; the counts are
exact.

    python benchmarks/op_call_overhead.py --label after --out benchmarks/results/op-call-overhead-cpu.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from nanospec_fx.eval import report
from nanospec_fx.eval.bench.kernel_config import host_body, op_state
from nanospec_fx.eval.bench.timing import interleaved_medians

V, H, C = 512, 16, 64


def op_calls() -> dict:
    """One call of each op on a filled tiny state (zero-argument functions, named by op)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=g)
    ids, slot_of, cursor, cache_w, cache_b = state = op_state(weight, C)
    ops = torch.ops.nanospec
    ops.observe(torch.randperm(V, generator=g)[:C], weight, None, *state, 0)
    fed, x = ids[:4].clone(), torch.randn(1, H, generator=g)
    logits = ops.compact_logits(x, cache_w, cache_b, cursor)
    bodies = {op: host_body(op) for op in ("observe", "compact_logits", "compact_topk")}
    return {
        "observe": lambda: ops.observe(fed, weight, None, *state, 0),
        "compact_logits": lambda: ops.compact_logits(x, cache_w, cache_b, cursor),
        "compact_topk": lambda: ops.compact_topk(logits, ids, cursor, 4),
        # the host path's functions called directly: the body alone, what an op call costs without its machinery
        "observe body": lambda: bodies["observe"](fed, weight, None, *state, 0, None),
        "compact_logits body": lambda: bodies["compact_logits"](x, cache_w, cache_b, cursor, None),
        "compact_topk body": lambda: bodies["compact_topk"](logits, ids, cursor, 4, True, None),
    }


def python_calls(fn) -> int:
    """Python function calls (profile ``call`` events) that one ``fn()`` makes, ``fn``'s own frame excluded."""
    fn()  # warm: first-call imports and caches are not per-call work
    count = 0

    def hook(frame, event, arg):
        nonlocal count
        count += event == "call"
    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--label", default="run")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--note", default="", help="what this run measures (e.g. which checkout)")
    args = parser.parse_args()
    report.set_threads(1)
    with torch.inference_mode():
        calls = op_calls()
        counts = {name: python_calls(fn) for name, fn in calls.items()}
        medians = interleaved_medians(calls, repeats=args.calls, warmup=100, clock=time.process_time)
    rows = [{"op": name, "median_cpu_us": 1e6 * medians[name], "python_calls": counts[name]} for name in calls]
    for row in rows:
        print(f"{args.label}: {row['op']:15s} {row['median_cpu_us']:6.1f} us (median CPU time), "
              f"{row['python_calls']} Python calls per op call")
    if args.out:
        data = json.loads(args.out.read_text()) if args.out.exists() else {}
        data[args.label] = {"rows": rows, "calls": args.calls, "shape": dict(vocab=V, hidden=H, capacity=C),
                            "note": args.note, "provenance": {**report.provenance(), "shared_machine": True}}
        args.out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
