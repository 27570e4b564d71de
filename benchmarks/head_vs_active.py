"""The nanospec head's time at a fixed capacity against the active count, measured and as ``explain``'s cost model
predicts it (:func:`nanospec_fx.eval.bench.head.bench_head_vs_active`; docs/kernels.md).

    nice -n 10 python benchmarks/head_vs_active.py --repeats 30                  # Gemma-3 head (H=640, V=262144)
    python benchmarks/head_vs_active.py --repeats 30 --calibrate                # constants measured on this machine
"""
from __future__ import annotations

import argparse

import torch

from nanospec_fx.diagnostics.calibration import MachineConstants, calibrate
from nanospec_fx.eval import cores
from nanospec_fx.eval.bench.head import bench_head_vs_active


def main() -> None:
    p = argparse.ArgumentParser(description=bench_head_vs_active.__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=640)
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--capacity", type=int, default=3072)
    p.add_argument("--active", default="1,100,1000,3000")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--calibrate", action="store_true",
                   help="predict with constants measured on this machine (explain(..., calibrate=True))")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    ints = [[int(v) for v in s.split(",")] for s in (a.active, a.rows)]
    start, oversubscribed = cores.check(torch.get_num_threads())
    if oversubscribed:
        print(f"warning: {oversubscribed}")
    machine = calibrate(a.hidden) if a.calibrate else None
    res = bench_head_vs_active(a.hidden, a.vocab, ints[0], a.capacity, ints[1], a.repeats, device=a.device,
                               machine=machine)
    print(f"H={a.hidden} V={a.vocab} C={a.capacity} fp32 {a.device}, path={res[0].path}, threads="
          f"{torch.get_num_threads()}, load average {first_load(start)} at the start, {first_load(cores.load_average())} at the end, "
          f"median of {a.repeats}")
    print("cost model: " + (machine or MachineConstants.fitted(res[0].path)).describe())
    print("| rows | active | variant | nanospec ms | dense ms | measured speedup (min) | predicted "
          "| predicted / measured (min) |")
    print("|---|---|---|---|---|---|---|---|")
    for t in res:
        print(f"| {t.rows} | {t.active:,} | {t.variant} | {t.ms:.3f} | {t.dense_ms:.1f} | {t.speedup:.0f}x "
              f"({t.min_speedup:.0f}x) | {t.predicted:.0f}x | {t.predicted / t.speedup:.2f} "
              f"({t.predicted / t.min_speedup:.2f}) |")


def first_load(load: list[float] | None) -> str:
    return "?" if load is None else f"{load[0]:.2f}"


if __name__ == "__main__":
    main()
