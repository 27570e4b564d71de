"""One observe op call on the CPU host path, as the EAGLE draft round makes them: <= 9 ids, nearly all active.

The round observes 1 + depth times (the fed token, the target's top-3 of each verified position): a few ids,
almost all already in the set. This times ``torch.ops.nanospec.observe`` (the op a compiled drafter calls, custom-op
dispatch included) and ``kernels.host.observe`` (the body alone) at Gemma-3-270M's head shape (V = 262,144,
H = 640, C = 3,072, fp32, one thread), ring full, for calls with 0, 1 and 3 new ids among 9. Median of ``--calls``
calls after 50 untimed; the JSON (``--out``) carries the provenance (git commit, load average).

    python benchmarks/observe_host.py --label after --out benchmarks/results/observe-host-cpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from nanospec_fx.eval.report import provenance
from nanospec_fx.kernels import host, ops  # noqa: F401  (ops registers torch.ops.nanospec)
from nanospec_fx.kernels.schema import new_state


def run(calls: int, new_per_call: int, direct: bool) -> float:
    V, H, C = 262144, 640, 3072
    g = torch.Generator().manual_seed(new_per_call)
    w = torch.randn(V, H, generator=g)
    s = new_state(V, H, C, torch.float32, "cpu")
    perm = torch.randperm(V, generator=g)
    torch.ops.nanospec.observe(perm[:C + 100], w, None, *s, 0)
    fresh = C + 100
    fn = host.observe if direct else torch.ops.nanospec.observe
    times = []
    for i in range(calls + 50):
        active = s[0][torch.randint(0, C, (9 - new_per_call,), generator=g)]
        call = torch.cat([active, perm[fresh:fresh + new_per_call]])
        fresh += new_per_call
        t = time.perf_counter()
        fn(call, w, None, *s, 0)
        if i >= 50:
            times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--label", default="run")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for new in (0, 1, 3):
        for direct in (False, True):
            us = run(args.calls, new, direct)
            rows.append({"new_ids": new, "ids": 9, "call": "host.observe" if direct else "op", "median_us": us})
            print(f"{args.label}: 9 ids, {new} new, {'host.observe' if direct else 'op'}: {us:.1f} us")
    if args.out:
        data = json.loads(args.out.read_text()) if args.out.exists() else {}
        data[args.label] = {"rows": rows, "provenance": provenance(), "calls": args.calls}
        args.out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
