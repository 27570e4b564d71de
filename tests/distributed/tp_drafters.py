"""Vocabulary-parallel drafters written as users write them, and their plain-torch oracle.

Each drafter holds a replicated token embedding and this rank's shard ``[V / tp, H]`` of the head, computes its
slice of the logits and gathers ``[..., V]`` with one of the forms users write (the gather forms of
``GATHERS``). ``dense_masked`` is the oracle: the same eager drafter (real gather), with -inf at inactive tokens.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F


def gather_funcol(local: torch.Tensor, tp: int) -> torch.Tensor:
    return funcol.all_gather_tensor(local, gather_dim=local.dim() - 1, group=dist.group.WORLD)


def gather_list(local: torch.Tensor, tp: int) -> torch.Tensor:
    out = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(out, local)
    return torch.cat(out, -1)


def gather_into_tensor(local: torch.Tensor, tp: int) -> torch.Tensor:
    out = local.new_empty((tp * local.shape[0],) + tuple(local.shape[1:]))
    dist.all_gather_into_tensor(out, local)
    return torch.cat(out.chunk(tp), dim=local.dim() - 1)


def gather_movedim(local: torch.Tensor, tp: int) -> torch.Tensor:
    stacked = funcol.all_gather_tensor(local, gather_dim=0, group=dist.group.WORLD)  # [tp * B, ..., V / tp]
    ranked = stacked.view((tp,) + tuple(local.shape)).movedim(0, -2)  # [B, ..., tp, V / tp]
    return ranked.reshape(tuple(local.shape[:-1]) + (tp * local.shape[-1],))


def gather_stack(local: torch.Tensor, tp: int) -> torch.Tensor:
    out = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(out, local)
    return torch.stack(out, dim=-2).flatten(-2)


GATHERS = {"funcol": gather_funcol, "list": gather_list, "into_tensor": gather_into_tensor, "movedim": gather_movedim,
           "stack": gather_stack}


class VocabParallelDrafter(nn.Module):
    """Embedding -> one layer -> vocabulary-parallel head -> gather -> soft-capped logits (a post-op)."""

    def __init__(self, vocab: int, hidden: int, tp: int, rank: int, gather: str = "funcol", bias: bool = False,
                 seed: int = 0, scale: float | None = None, draft_rows: int | None = None):
        super().__init__()
        self.scale = scale  # a temperature and a cast on this rank's slice, before the gather
        g = torch.Generator().manual_seed(seed)
        self.tp, self.gather = tp, GATHERS[gather]
        self.embed = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, hidden)
        head_rows = draft_rows or vocab  # a draft vocabulary (EAGLE-3 d2t): R head rows over a V-token embedding
        full_w = torch.randn(head_rows, hidden, generator=g)
        full_b = torch.randn(head_rows, generator=g)
        rows = head_rows // tp
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(vocab, hidden, generator=g))
            self.proj.weight.copy_(torch.randn(hidden, hidden, generator=g) / hidden ** 0.5)
            self.proj.bias.zero_()
        self.head_weight = nn.Parameter(full_w[rank * rows:(rank + 1) * rows].clone())
        self.head_bias = nn.Parameter(full_b[rank * rows:(rank + 1) * rows].clone()) if bias else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(self.embed(ids)))
        local = F.linear(h, self.head_weight, self.head_bias)
        if self.scale is not None:
            local = (local * self.scale).double()
        z = self.gather(local, self.tp)
        return 30.0 * torch.tanh(z / 30.0)


class DTensorDrafter(nn.Module):
    """A plain drafter whose ``lm_head`` is parallelised with DTensor's ``ColwiseParallel`` (replicated output)."""

    def __init__(self, vocab: int, hidden: int, bias: bool = False, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)  # the same full weights on every rank, before they are sharded
        self.embed = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=bias)

    def parallelize(self, mesh) -> "DTensorDrafter":
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(self, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.embed(ids))).float() / 0.7


def dense_masked(model: nn.Module, ids: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """The eager drafter (real gather of the logits) with -inf at tokens outside ``active`` (a [V] bool)."""
    with torch.no_grad():
        out = model(ids)
    return out.masked_fill(~active, float("-inf"))
