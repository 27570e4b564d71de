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
    return funcol.all_gather_single(local, gather_dim=local.dim() - 1, group=dist.group.WORLD)


def gather_list(local: torch.Tensor, tp: int) -> torch.Tensor:
    out = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(out, local)
    return torch.cat(out, -1)


def gather_into_tensor(local: torch.Tensor, tp: int) -> torch.Tensor:
    out = local.new_empty((tp * local.shape[0],) + tuple(local.shape[1:]))
    dist.all_gather_into_tensor(out, local)
    return torch.cat(out.chunk(tp), dim=local.dim() - 1)


def gather_movedim(local: torch.Tensor, tp: int) -> torch.Tensor:
    stacked = funcol.all_gather_single(local, gather_dim=0, group=dist.group.WORLD)  # [tp * B, ..., V / tp]
    ranked = stacked.view((tp,) + tuple(local.shape)).movedim(0, -2)  # [B, ..., tp, V / tp]
    return ranked.reshape(tuple(local.shape[:-1]) + (tp * local.shape[-1],))


def gather_c10d_movedim(local: torch.Tensor, tp: int) -> torch.Tensor:
    """c10d's ``all_gather_into_tensor`` into a fresh buffer, the rank axis then moved next to the vocabulary axis."""
    out = local.new_empty((tp * local.shape[0],) + tuple(local.shape[1:]))
    dist.all_gather_into_tensor(out, local)
    ranked = out.view((tp,) + tuple(local.shape)).movedim(0, -2)
    return ranked.reshape(tuple(local.shape[:-1]) + (tp * local.shape[-1],))


def gather_list_movedim(local: torch.Tensor, tp: int) -> torch.Tensor:
    """c10d's ``all_gather`` into a list, stacked on a leading rank axis then moved next to the vocabulary axis."""
    out = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(out, local)
    return torch.stack(out).movedim(0, -2).flatten(-2)


def gather_stack(local: torch.Tensor, tp: int) -> torch.Tensor:
    out = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(out, local)
    return torch.stack(out, dim=-2).flatten(-2)


def gather_megatron(local: torch.Tensor, tp: int) -> torch.Tensor:
    """Megatron's ``_gather_along_last_dim``: this rank's own slice stands in the output list, written in place."""
    out = [torch.empty_like(local) for _ in range(tp)]
    out[dist.get_rank()] = local
    dist.all_gather(out, local)
    return torch.cat(out, dim=-1).contiguous()


GATHERS = {"funcol": gather_funcol, "list": gather_list, "into_tensor": gather_into_tensor, "movedim": gather_movedim,
           "stack": gather_stack, "megatron": gather_megatron, "c10d_movedim": gather_c10d_movedim,
           "list_movedim": gather_list_movedim}


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


# ----------------------------------------------------------------------------- local selection + exchange
def exchange_max_view(local: torch.Tensor, tp: int, rank: int, start: torch.Tensor) -> tuple:
    """max(-1) on the slice, ids + rank * V/tp, funcol gathers of values and ids along dim 0, argmax over ranks."""
    v, i = local.max(-1)
    i = i + rank * local.shape[-1]
    av = funcol.all_gather_single(v, 0, dist.group.WORLD).view((tp,) + tuple(v.shape))
    ai = funcol.all_gather_single(i, 0, dist.group.WORLD).view((tp,) + tuple(i.shape))
    best = av.argmax(0)
    return ai.gather(0, best.unsqueeze(0)).squeeze(0)


def exchange_topk_list(local: torch.Tensor, tp: int, rank: int, start: torch.Tensor, k: int = 3) -> tuple:
    """topk(k), ids + a start buffer, in-place all_gather into lists, cat, topk(k) of the tp * k candidates."""
    v, i = local.topk(k, dim=-1)
    i = i + start
    vs, ids = [torch.empty_like(v) for _ in range(tp)], [torch.empty_like(i) for _ in range(tp)]
    dist.all_gather(vs, v)
    dist.all_gather(ids, i)
    best, pos = torch.cat(vs, -1).topk(k, dim=-1)
    return best, torch.cat(ids, -1).gather(-1, pos)


def exchange_topk_arange(local: torch.Tensor, tp: int, rank: int, start: torch.Tensor, k: int = 2) -> tuple:
    """topk(k), ids looked up in arange(first, first + V/tp), funcol along the candidate axis, take_along_dim."""
    v, i = torch.topk(local, k)
    rows = local.shape[-1]
    i = torch.arange(rank * rows, (rank + 1) * rows)[i]
    cv = funcol.all_gather_single(v, gather_dim=v.dim() - 1, group=dist.group.WORLD)
    ci = funcol.all_gather_single(i, gather_dim=i.dim() - 1, group=dist.group.WORLD)
    best, pos = cv.topk(1, dim=-1)
    return best.squeeze(-1), torch.take_along_dim(ci, pos, dim=-1).squeeze(-1)


def exchange_max_stack(local: torch.Tensor, tp: int, rank: int, start: torch.Tensor) -> tuple:
    """max(-1, keepdim=True), all_gather_into_tensor, a rank axis from view, max over it, gather of the ids."""
    v, i = local.max(dim=-1, keepdim=True)
    i = rank * local.shape[-1] + i
    out_v = v.new_empty((tp * v.shape[0],) + tuple(v.shape[1:]))
    out_i = i.new_empty((tp * i.shape[0],) + tuple(i.shape[1:]))
    dist.all_gather_into_tensor(out_v, v)
    dist.all_gather_into_tensor(out_i, i)
    best, pos = out_v.view((tp,) + tuple(v.shape)).max(0, keepdim=True)
    return best.squeeze(0), out_i.view((tp,) + tuple(i.shape)).gather(0, pos).squeeze(0)


def exchange_max_packed(local: torch.Tensor, tp: int, rank: int, start: torch.Tensor) -> tuple:
    """max(-1), values and ids stacked into one tensor (ids cast to the values' dtype): one funcol gather, a rank
    axis from view, the values and ids taken out by indexing, ids cast back, argmax over ranks."""
    v, i = local.max(-1)
    i = i + rank * local.shape[-1]
    packed = torch.stack([v, i.to(v.dtype)])  # [2, *v.shape]
    g = funcol.all_gather_single(packed, 0, dist.group.WORLD).view((tp, 2) + tuple(v.shape))
    av, ai = g[:, 0], g[:, 1].long()
    return ai.gather(0, av.argmax(0).unsqueeze(0)).squeeze(0)


def exchange_topk_packed_list(local: torch.Tensor, tp: int, rank: int, start: torch.Tensor, k: int = 2) -> tuple:
    """topk(k), values and ids (+ a start buffer, as floats) concatenated along the candidate axis, all_gather into
    a list, each rank's values and ids sliced out, topk(k) of the tp * k candidates, ids cast back at the end."""
    v, i = local.topk(k, dim=-1)
    packed = torch.cat([v, (i + start).float()], -1)  # [..., 2k]
    out = [torch.empty_like(packed) for _ in range(tp)]
    dist.all_gather(out, packed)
    best, pos = torch.cat([o[..., :k] for o in out], -1).topk(k, dim=-1)
    return best, torch.cat([o[..., k:] for o in out], -1).gather(-1, pos).long()


def exchange_topk_packed_unbind(local: torch.Tensor, tp: int, rank: int, start: torch.Tensor, k: int = 2) -> tuple:
    """topk(k), ids first and values stacked on a last axis, a rank axis moved next to the candidates, unbind."""
    v, i = torch.topk(local, k)
    packed = torch.stack([(i + rank * local.shape[-1]).to(v.dtype), v], -1)  # [..., k, 2]
    g = funcol.all_gather_single(packed, 0, dist.group.WORLD).view((tp,) + tuple(packed.shape))
    ids, vals = g.unbind(-1)  # [tp, ..., k] each
    flat = tuple(v.shape[:-1]) + (tp * k,)
    best, pos = vals.movedim(0, -2).reshape(flat).topk(k, dim=-1)
    return best, ids.movedim(0, -2).reshape(flat).gather(-1, pos).to(torch.int64)


def exchange_topk_packed_split(local: torch.Tensor, tp: int, rank: int, start: torch.Tensor, k: int = 2) -> tuple:
    """topk(k), ids first and values concatenated, all_gather into a list, values by narrow, ids by split."""
    v, i = local.topk(k, dim=-1)
    packed = torch.cat([(i + start).float(), v], -1)  # [..., 2k]
    out = [torch.empty_like(packed) for _ in range(tp)]
    dist.all_gather(out, packed)
    best, pos = torch.cat([o.narrow(-1, k, k) for o in out], -1).topk(k, dim=-1)
    return best, torch.cat([o.split(k, -1)[0] for o in out], -1).gather(-1, pos).long()


def exchange_max_packed_select(local: torch.Tensor, tp: int, rank: int, start: torch.Tensor) -> tuple:
    """max(-1, keepdim=True), values widened to float64 and stacked with the ids on a new first axis, gathered along
    the candidate axis (funcol, a non-negative dim), taken out with select, max over the candidates."""
    v, i = local.max(-1, keepdim=True)
    packed = torch.stack([v.double(), (i + start).double()])  # [2, ..., 1]
    g = funcol.all_gather_single(packed, gather_dim=packed.dim() - 1, group=dist.group.WORLD)  # [2, ..., tp]
    best, pos = g.select(0, 0).max(-1, keepdim=True)
    return best, g.select(0, 1).long().gather(-1, pos)


EXCHANGES = {"max_view": exchange_max_view, "topk_list": exchange_topk_list, "topk_arange": exchange_topk_arange,
             "max_stack": exchange_max_stack, "max_packed": exchange_max_packed,
             "topk_packed_list": exchange_topk_packed_list, "topk_packed_unbind": exchange_topk_packed_unbind,
             "topk_packed_split": exchange_topk_packed_split, "max_packed_select": exchange_max_packed_select}


class ExchangeDrafter(VocabParallelDrafter):
    """A vocabulary-parallel drafter that selects on its own slice and exchanges (value, id) candidates instead of
    gathering its logits. ``mask`` ([V] bool, eager only) sets inactive logits of the slice to -inf: the oracle."""

    def __init__(self, vocab: int, hidden: int, tp: int, rank: int, exchange: str = "max_view", **kwargs):
        super().__init__(vocab, hidden, tp, rank, **kwargs)
        self.rank, self.exchange, self.mask = rank, EXCHANGES[exchange], None
        rows = self.head_weight.shape[0]
        self.register_buffer("start", torch.tensor(rank * rows))

    def forward(self, ids: torch.Tensor):
        h = torch.tanh(self.proj(self.embed(ids)))
        local = F.linear(h, self.head_weight, self.head_bias)
        if self.scale is not None:
            local = (local * self.scale).double()
        if self.mask is not None:
            rows = local.shape[-1]
            local = local.masked_fill(~self.mask[self.rank * rows:(self.rank + 1) * rows], float("-inf"))
        return self.exchange(local, self.tp, self.rank, self.start)

    def full_logits(self, ids: torch.Tensor, full_weight: torch.Tensor, full_bias) -> torch.Tensor:
        """The logits of every shard's rows, on one device (plain torch: the oracle's)."""
        z = F.linear(torch.tanh(self.proj(self.embed(ids))), full_weight, full_bias)
        return (z * self.scale).double() if self.scale is not None else z


class NoOffset(ExchangeDrafter):
    """Exchanges local ids (0..V/tp-1) as they are: not token ids."""

    def forward(self, ids):
        v, i = F.linear(self.embed(ids), self.head_weight).max(-1)
        av = funcol.all_gather_tensor(v, 0, dist.group.WORLD).view((self.tp,) + tuple(v.shape))
        ai = funcol.all_gather_tensor(i, 0, dist.group.WORLD).view((self.tp,) + tuple(i.shape))
        return ai.gather(0, av.argmax(0).unsqueeze(0)).squeeze(0)


class DTensorExchangeDrafter(DTensorDrafter):
    """``ColwiseParallel()`` with its default ``Shard(-1)`` output: each rank gets its slice, takes its max and
    exchanges (value, id) with the others (``exchange_max_view``)."""

    def parallelize(self, mesh) -> "DTensorExchangeDrafter":
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        self.full_weight = self.lm_head.weight.detach().clone()  # the same on every rank (seeded): the oracle's
        self.mask, self.rank, self.tp = None, mesh.get_local_rank(), mesh.size()
        parallelize_module(self, mesh, {"lm_head": ColwiseParallel()})
        return self

    def forward(self, ids: torch.Tensor):
        local = self.lm_head(torch.tanh(self.embed(ids)))
        if self.mask is not None:
            rows = local.shape[-1]
            local = local.masked_fill(~self.mask[self.rank * rows:(self.rank + 1) * rows], float("-inf"))
        return exchange_max_view(local, self.tp, self.rank, None)

    def full_logits(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.tanh(self.embed(ids)), self.full_weight)


def full_selection(logits: torch.Tensor, active: torch.Tensor, k: int) -> tuple:
    """Plain torch, one device: the full logits with -inf at inactive tokens, their top-k values and ids (k = 1:
    ``max``, the first maximum)."""
    z = logits.masked_fill(~active, float("-inf"))
    return z.max(-1) if k == 1 else z.topk(k, dim=-1)


# ----------------------------------------------------------------------------- vocabulary-parallel token embedding
class VocabParallelEmbedding(nn.Module):
    """Megatron's ``VocabParallelEmbedding``: this rank's rows ``[start, end)`` of the table; ids outside are looked
    up at row 0 and their rows zeroed; the sum over ranks is the full lookup. ``style``: ``"megatron"`` (in-place
    masking, ``dist.all_reduce``) or ``"where"`` (``torch.where``, ``masked_fill``, ``funcol.all_reduce``, a
    ``start`` buffer)."""

    def __init__(self, full: torch.Tensor, tp: int, rank: int, style: str = "megatron"):
        super().__init__()
        rows = full.shape[0] // tp
        self.start, self.end, self.style = rank * rows, (rank + 1) * rows, style
        self.weight = nn.Parameter(full[self.start:self.end].clone())
        self.register_buffer("first", torch.tensor(self.start))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids < self.start) | (ids >= self.end)
        if self.style == "megatron":
            local = ids - self.start
            local[mask] = 0
            out = F.embedding(local, self.weight)
            out[mask, :] = 0.0
            dist.all_reduce(out)
            return out
        local = torch.where(mask, 0, ids - self.first)
        out = F.embedding(local, self.weight).masked_fill(mask.unsqueeze(-1), 0.0)
        return funcol.all_reduce(out, "sum", dist.group.WORLD)


class ParallelEmbeddingDrafter(VocabParallelDrafter):
    """A vocabulary-parallel drafter whose token embedding is vocabulary-parallel too (its ``embed`` holds the same
    full table as the base class's, sharded); ``full_embed`` keeps the full table for the oracle."""

    def __init__(self, vocab: int, hidden: int, tp: int, rank: int, style: str = "megatron", **kwargs):
        super().__init__(vocab, hidden, tp, rank, **kwargs)
        self.full_embed = self.embed
        self.embed = VocabParallelEmbedding(self.full_embed.weight.detach(), tp, rank, style)
