"""What the tensor-parallel check-in costs one rank per compiled draft step: store calls (exact) and CPU time
(indicative).

Two gloo ranks (this script starts them: ``--world``, a file store, one thread each) compile a vocabulary-parallel
drafter (V = 96, H = 16, capacity 48, ``inductor=False``) and run ``--calls`` compiled draft steps of 3 ids. Each
rank counts the store calls its check-ins make (a counting wrapper around the group's store: each call is one
round trip; a wait that ran out because the other rank came later is counted apart, as load, not cost) and
times, in process CPU time (``time.process_time``: the waits for the other rank are sleeps, not cost), the whole
compiled step and the check-in alone (``state.check_in``, the call the step makes). Medians per rank; rank 0's
JSON (``--out``) keeps each ``--label``'s run with its provenance (commit, load average, oversubscription).

A file store is a file read and locked per call: a TCP store's calls are network round trips instead, so the
counts carry over and the times do not.

    python benchmarks/tp_check_in.py --label after --out benchmarks/results/tp-check-in-cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

V, H, CAPACITY = 96, 16, 48


def rank_main(rank: int, world: int, store_file: str, calls: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    import nanospec_fx
    import nanospec_fx.parallel.consensus as consensus
    from nanospec_fx.eval.bench.store_calls import CountingStore
    from nanospec_fx.eval.bench.timing import time_call

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "parallel"))
    from tp_drafters import VocabParallelDrafter

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    model = VocabParallelDrafter(V, H, world, rank)
    compiled = torch.compile(model, backend="nanospec", options={"capacity": CAPACITY, "inductor": False})
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        for _ in range(5):  # compile, first check-ins
            compiled(ids)
    state = nanospec_fx.active_vocab(model)
    counts: dict = {}
    original = distributed_c10d._get_process_group_store
    proxy = CountingStore(original(dist.group.WORLD), counts)
    distributed_c10d._get_process_group_store = lambda group: proxy
    getattr(consensus, "_clients", {}).clear()  # a checkout without a client per group has none to clear
    step, check_in = [], []
    with torch.no_grad():
        for _ in range(calls):
            step.append(time_call(lambda: compiled(ids), clock=time.process_time))
        calls_in_steps = {k: v / calls for k, v in sorted(counts.items()) if k not in ("waits_ran_out", "clone")}
        for _ in range(calls):
            check_in.append(time_call(lambda: state.check_in("compiled draft step"), clock=time.process_time))
    distributed_c10d._get_process_group_store = original
    dist.destroy_process_group()
    return {"store_calls_per_step": calls_in_steps, "store_calls_in_all": sum(calls_in_steps.values()),
            "waits_ran_out": counts.get("waits_ran_out", 0),
            "step_cpu_us_median": 1e6 * statistics.median(step),
            "check_in_cpu_us_median": 1e6 * statistics.median(check_in)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--label", default="run")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--note", default="", help="what this run measures (e.g. which checkout)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a rank this script started
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        print("RESULT " + json.dumps(rank_main(args.rank, args.world, args.store, args.calls)), flush=True)
        os._exit(0)  # no interpreter teardown under gloo's threads (see tests/parallel/tp_worker.py)
    from nanospec_fx.eval import cores
    from nanospec_fx.eval.report import provenance

    load, oversubscribed = cores.check(1, processes=args.world)
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(args.world),
                                   "--store", str(Path(tmp) / "store"), "--calls", str(args.calls)],
                                  stdout=subprocess.PIPE, text=True) for r in range(args.world)]
        outs = [p.communicate(timeout=1200)[0] for p in procs]
    ranks = [json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]) for out in outs]
    for r, result in enumerate(ranks):
        print(f"{args.label} rank {r}: {result}")
    if args.out:
        data = json.loads(args.out.read_text()) if args.out.exists() else {}
        data[args.label] = {"ranks": ranks, "calls": args.calls, "world": args.world,
                            "shape": dict(vocab=V, hidden=H, capacity=CAPACITY), "store": "file",
                            "note": args.note, "shared_machine": True, "oversubscribed_at_start": oversubscribed,
                            "provenance": provenance()}
        args.out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
