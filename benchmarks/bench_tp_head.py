"""A vocabulary-parallel drafter head on 2 gloo processes: dense (local slice + all-gather of the logits) vs nanospec
(the replicated compact row cache: no logits collective), per draft step and per observe.

    python benchmarks/bench_tp_head.py                                   # small: V=32000, H=1024
    python benchmarks/bench_tp_head.py --vocab 128256 --hidden 4096     # Llama-3-8B's head over 2 ranks (fp32)

Times are medians over ``--steps`` calls, every call started together on both ranks (a barrier before each), read on
rank 0. Bytes are the collectives' payloads from their shapes (what one rank contributes and receives): the dense
head all-gathers ``[rows, V]``; nanospec all-reduces ``[N, H]`` per observe of ``N`` ids. Both heads are compiled
(``inductor`` for the dense one, ``nanospec`` for ours); ids are observed from Python (``state.observe``), as a
target's top-k or accepted tokens would be. CPU and gloo: the ratio of bytes carries over to NCCL, the times do not.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from nanospec_fx.eval.bench.timing import device_timings


class GatheredHead(nn.Module):
    """This rank's shard of the head, its slice of the logits gathered into [rows, V] (Megatron / vLLM style)."""

    def __init__(self, shard: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(shard, requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self.weight)
        return funcol.all_gather_tensor(local, gather_dim=1, group=dist.group.WORLD)


def median_ms(fn, steps: int) -> float:
    """Median milliseconds of ``steps`` calls, each started together on both ranks (a barrier before it)."""
    return 1e3 * statistics.median(device_timings(fn, steps, warmup=0, before=dist.barrier))


def _worker(rank: int, args: argparse.Namespace, store_file: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    import nanospec_fx

    V, H, rows, tp = args.vocab, args.hidden, args.rows, 2
    g = torch.Generator().manual_seed(rank)
    shard = torch.randn(V // tp, H, generator=g) / H ** 0.5
    dense = torch.compile(GatheredHead(shard))
    head = GatheredHead(shard)
    ours = torch.compile(head, backend="nanospec", options={"capacity": args.capacity, "observe_inputs": False})
    h = torch.randn(rows, H, generator=torch.Generator().manual_seed(7))  # the same hidden states on both ranks
    with torch.no_grad():
        ours(h)  # compiles; creates the state
        dense(h)
        state = nanospec_fx.active_vocab(head)
        ids = torch.randperm(V, generator=torch.Generator().manual_seed(3))  # the same ids on both ranks
        state.observe(ids[: args.active - args.observe_ids])
        new = iter(ids[args.active - args.observe_ids:].split(args.observe_ids))
        observe_ms = median_ms(lambda: state.observe(next(new)), min(args.steps, 5))  # observe of N new ids
        state.reset()
        state.observe(ids[: args.active])
        torch.testing.assert_close(ours(h), dense(h).masked_fill(~state.contains(torch.arange(V)), float("-inf")))
        dense_ms = median_ms(lambda: dense(h), args.steps)
        ours_ms = median_ms(lambda: ours(h), args.steps)
    item = shard.element_size()
    if rank == 0:
        gathered = rows * V * item
        print(f"V={V} H={H} tp=2 rows={rows} active={args.active} capacity={args.capacity} fp32, "
              f"{args.threads} thread(s) per rank, gloo, medians of {args.steps}")
        print("| | dense TP head (all-gather of logits) | nanospec (replicated compact cache) |")
        print("|---|---|---|")
        print(f"| draft step time | {dense_ms:.2f} ms | {ours_ms:.2f} ms ({dense_ms / ours_ms:.1f}x) |")
        print(f"| draft step collective payload | [{rows}, {V}] gathered: {gathered / 1e6:.2f} MB "
              f"(each rank sends {gathered / tp / 1e6:.2f} MB) | none |")
        print(f"| observe of {args.observe_ids} new ids | - | {observe_ms:.2f} ms, "
              f"all-reduce of [{args.observe_ids}, {H}]:"
              f" {args.observe_ids * H * item / 1e6:.3f} MB |")
        print(f"| memory per rank | shard {shard.numel() * item / 1e6:.1f} MB | shard + cache "
              f"{args.capacity * H * item / 1e6:.1f} MB + slot map {V * 4 / 1e6:.2f} MB |")
    dist.destroy_process_group()


def cost_model(args: argparse.Namespace) -> None:
    """An alpha-beta model (not a measurement) of one draft step on GPUs linked by NVLink 4, bf16:
    ``nanospec_fx.diagnostics.cost_model.CollectiveCost`` (the model ``explain`` prints for a vocabulary-parallel head)."""
    from nanospec_fx.diagnostics.cost_model import NVLINK4, CollectiveCost

    V, H, C, rows = args.vocab, args.hidden, args.capacity, args.rows
    print(f"alpha-beta model, not a measurement: V={V} H={H} bf16, rows={rows}, capacity={C}, N={rows} fed ids per "
          f"step, NVLink 4 at {NVLINK4 / 1e9:.0f} GB/s per direction, alpha={args.alpha_us} us per ring step "
          "(an assumption)")
    print("\n".join(CollectiveCost(V, H, C).table(rows, rows, alpha_s=args.alpha_us * 1e-6)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=10, help="rows per draft step (an EAGLE-2 tree level)")
    parser.add_argument("--active", type=int, default=3000)
    parser.add_argument("--capacity", type=int, default=3072)
    parser.add_argument("--observe-ids", type=int, default=16, help="ids per timed observe")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cost-model", action="store_true", help="print the alpha-beta model instead (no run)")
    parser.add_argument("--alpha-us", type=float, default=5.0, help="cost model: latency per ring step")
    args = parser.parse_args()
    if args.cost_model:
        return cost_model(args)
    if args.vocab % 2:
        sys.exit("--vocab must be even (2 shards)")
    from nanospec_fx.eval import cores

    _, oversubscribed = cores.check(args.threads, processes=2)  # two ranks, each with --threads
    if oversubscribed:
        print(f"warning: {oversubscribed}")
    with tempfile.TemporaryDirectory() as tmp:  # forked ranks at a file store: see examples/tensor_parallel.py
        mp.start_processes(_worker, args=(args, os.path.join(tmp, "store")), nprocs=2, start_method="fork")


if __name__ == "__main__":
    main()
