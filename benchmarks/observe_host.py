"""One observe op call on the CPU host path, as the EAGLE draft round makes them: 9 ids, nearly all active.

The round observes 1 + depth times (the fed token, the target's top-3 of each verified position): a few ids,
almost all already in the set. This times ``torch.ops.nanospec.observe`` (the op a compiled drafter calls, custom-op
dispatch included; on CPU tensors it runs the host path) at Gemma-3-270M's head shape (V = 262,144, H = 640,
C = 3,072, fp32, one thread), ring full, for calls with 0, 1 and 3 new ids among 9. Median of ``--calls`` calls
after 50 untimed, in process CPU time (``time_call(clock=time.process_time)``: a busy machine disturbs it less than
wall time); the JSON (``--out``) keeps each ``--label``'s run with its provenance (git commit, load average).

    python benchmarks/observe_host.py --label after --out benchmarks/results/observe-host-cpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from nanospec_fx.eval.bench.kernel_config import op_state
from nanospec_fx.eval.bench.timing import time_call
from nanospec_fx.eval.report import provenance

V, H, C = 262144, 640, 3072


def run(calls: int, new_per_call: int) -> float:
    g = torch.Generator().manual_seed(new_per_call)
    w = torch.randn(V, H, generator=g)
    s = op_state(w, C)
    perm = torch.randperm(V, generator=g)
    torch.ops.nanospec.observe(perm[:C + 100], w, None, *s, 0)
    fresh = C + 100
    times = []
    for i in range(calls + 50):
        call = torch.cat([s[0][torch.randint(0, C, (9 - new_per_call,), generator=g)],
                          perm[fresh:fresh + new_per_call]])
        fresh += new_per_call
        t = time_call(lambda: torch.ops.nanospec.observe(call, w, None, *s, 0), clock=time.process_time)
        if i >= 50:
            times.append(t)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--label", default="run")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--note", default="", help="what this run measures (e.g. which checkout)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for new in (0, 1, 3):
        us = run(args.calls, new)
        rows.append({"ids": 9, "new_ids": new, "median_cpu_us": us})
        print(f"{args.label}: observe op, 9 ids, {new} new: {us:.1f} us (median CPU time)")
    if args.out:
        data = json.loads(args.out.read_text()) if args.out.exists() else {}
        data[args.label] = {"rows": rows, "calls": args.calls, "shape": dict(vocab=V, hidden=H, capacity=C),
                            "note": args.note,
                            "provenance": provenance()}
        args.out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
