"""A tensor-parallel drafter with a vocabulary-parallel head, on 2 gloo processes (CPU): compiled with nanospec, its
draft step has no logits collective, and every rank holds the same active set.

    python examples/tensor_parallel.py [--no-inductor]

Each rank holds half of the head's rows, computes its slice of the logits and all-gathers them (Megatron style).
nanospec finds that gather in the graph, removes it, and computes the compact head locally on both ranks.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import nanospec_fx

V, H, TP = 1000, 64, 2


class Drafter(nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(0)  # the same full head on every rank; each keeps its shard
        self.embed = nn.Embedding(V, H)
        head = torch.randn(V, H) / H ** 0.5
        self.head_shard = nn.Parameter(head[rank * V // TP:(rank + 1) * V // TP].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = F.linear(torch.tanh(self.embed(ids)), self.head_shard)       # [B, T, V / TP]
        logits = funcol.all_gather_single(local, gather_dim=2, group=dist.group.WORLD)  # [B, T, V]
        return logits / 0.8


def run(rank: int, store_file: str, inductor: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=TP)
    drafter = Drafter(rank)
    compiled = torch.compile(drafter, backend="nanospec", options={"capacity": 256, "inductor": inductor})
    prompt = torch.tensor([[5, 17, 256, 999, 640]])
    with torch.no_grad():
        logits = compiled(prompt)                          # the prompt's tokens become active on every rank
        state = nanospec_fx.active_vocab(drafter)
        state.observe([3, 501, 777])                       # e.g. the target's top-k: on every rank, the same ids
        logits = compiled(prompt[:, -1:])
        dense = drafter(prompt[:, -1:])                    # the eager drafter, with its all-gather
    active = state.contains(torch.arange(V))
    exact = torch.allclose(logits, dense.masked_fill(~active, float("-inf")), rtol=1e-5, atol=1e-5)
    sets: list = [None] * TP
    dist.all_gather_object(sets, state.token_ids().tolist())
    if rank == 0:
        print(f"rank 0: {state}")
        print(f"active tokens (slot order): {sets[0]}")
        print(f"same active set and slot order on every rank: {all(s == sets[0] for s in sets)}")
        print(f"logits == dense tensor-parallel drafter masked to the active set: {exact}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-inductor", action="store_true", help="run the rewritten graph eagerly (faster here)")
    args = parser.parse_args()
    # Forked ranks meeting at a file store (no port to pick). Fork, not spawn: a forked rank leaves without the
    # interpreter's teardown. gloo's worker threads outlive destroy_process_group here (torch still holds the group),
    # and one still freeing the last collective's tensors while a spawned rank finalizes can abort that rank.
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(run, args=(os.path.join(tmp, "store"), not args.no_inductor), nprocs=TP,
                           start_method="fork")
