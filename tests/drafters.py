"""Tiny drafters covering every head pattern the pass must handle.

Each takes ``_mask`` (bool [V]) in eager mode: it sets inactive logits to -inf right after
the post-ops, which is exactly what the compiled drafter must compute (the contract in docs/testing.md).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

HEAD_KINDS = ("linear", "linear_bias", "tied", "matmul_t", "matmul_T_bias")
POST_OPS = ("none", "temperature", "softcap", "bias_add", "last_position")
RETURNS = ("logits", "tuple", "log_softmax_topk", "argmax", "softmax")


class TinyDrafter(nn.Module):
    def __init__(self, vocab: int, hidden: int, head: str = "linear", post: str = "none", returns: str = "logits",
                 body_width: int | None = None):
        super().__init__()
        assert head in HEAD_KINDS and post in POST_OPS and returns in RETURNS
        self.head_kind, self.post, self.returns = head, post, returns
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(16, hidden)  # a position table: not the vocabulary, never observed
        # A body MLP; with body_width == vocab its up-projection has the head's width but is not the head.
        width = body_width or 2 * hidden
        self.up = nn.Linear(hidden, width)
        self.down = nn.Linear(width, hidden)
        if head in ("linear", "linear_bias"):
            self.lm_head = nn.Linear(hidden, vocab, bias=head == "linear_bias")
        elif head in ("matmul_t", "matmul_T_bias"):
            self.head_weight = nn.Parameter(torch.randn(vocab, hidden) / hidden**0.5)
            self.head_bias = nn.Parameter(torch.randn(vocab)) if head == "matmul_T_bias" else None
        if post == "bias_add":
            self.logit_bias = nn.Parameter(torch.randn(vocab))

    def project(self, h: torch.Tensor) -> torch.Tensor:
        if self.head_kind in ("linear", "linear_bias"):
            return self.lm_head(h)
        if self.head_kind == "tied":
            return F.linear(h, self.embed.weight)
        if self.head_kind == "matmul_t":
            return h @ self.head_weight.t()
        return torch.matmul(h, self.head_weight.T) + self.head_bias

    def forward(self, ids: torch.Tensor, _mask: torch.Tensor | None = None):
        positions = torch.arange(ids.shape[-1], device=ids.device)
        h = self.embed(ids) + self.pos(positions)
        h = h + self.down(F.silu(self.up(h)))
        z = self.project(h)
        if self.post == "temperature":
            z = z / 0.7
        elif self.post == "softcap":
            z = 3.0 * torch.tanh(z / 3.0)
        elif self.post == "bias_add":
            z = z + self.logit_bias
        elif self.post == "last_position":
            z = z[:, -1]
        if _mask is not None:
            z = z.masked_fill(~_mask, float("-inf"))
        if self.returns == "tuple":
            return z, h
        if self.returns == "log_softmax_topk":
            return torch.log_softmax(z.float(), dim=-1).topk(3, dim=-1)
        if self.returns == "argmax":
            return z.argmax(dim=-1)
        if self.returns == "softmax":
            return z.softmax(-1)
        return z


class EagleLikeDrafter(nn.Module):
    """Token embedding + target hidden state -> fc -> one layer -> shared head; returns (logits, hidden)."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.fc = nn.Linear(2 * hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, target_hidden, _mask=None):
        h = self.fc(torch.cat([self.embed(ids), target_hidden], dim=-1))
        h = h + self.mlp(h)
        z = self.lm_head(h)
        if _mask is not None:
            z = z.masked_fill(~_mask, float("-inf"))
        return z, h


class HiddenOnlyDrafter(nn.Module):
    """A drafter fed hidden states only: nothing to observe, its set grows through observe()."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, hidden, _mask=None):
        z = self.lm_head(torch.tanh(self.proj(hidden)))
        return z if _mask is None else z.masked_fill(~_mask, float("-inf"))


class TwoHeads(nn.Module):
    """Two different vocabulary-sized projections reach the output: ambiguous without options."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.head_a = nn.Linear(hidden, vocab, bias=False)
        self.head_b = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head_a(h), self.head_b(h)


class NoHead(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.lin(x).relu().sum(-1)
