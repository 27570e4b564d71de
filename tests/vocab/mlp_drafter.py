"""The drafter of the state tests: embedding -> MLP -> head, its head weight held as a ``Linear``, tied to the
embedding, or as a plain buffer (with or without a bias); ``_mask`` gives the oracle (inactive logits -inf)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

V, H = 40, 8


class Drafter(nn.Module):
    """Embedding -> MLP -> head; ``head`` picks how the head weight is held."""

    def __init__(self, head: str = "linear", bias: bool = False, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.kind = head
        self.embed = nn.Embedding(V, H)
        self.body = nn.Sequential(nn.Linear(H, 2 * H), nn.SiLU(), nn.Linear(2 * H, H))
        if head == "linear":
            self.lm_head = nn.Linear(H, V, bias=bias)
        elif head == "tied":
            self.lm_head = nn.Linear(H, V, bias=False)
            self.lm_head.weight = self.embed.weight
        elif head == "buffer":
            self.register_buffer("head_w", torch.randn(V, H) / H**0.5)
            if bias:
                self.register_buffer("head_b", torch.randn(V))

    def forward(self, ids, _mask=None):
        h = self.embed(ids)
        h = h + self.body(h)
        if self.kind == "buffer":
            z = F.linear(h, self.head_w, getattr(self, "head_b", None))
        else:
            z = self.lm_head(h)
        if _mask is not None:
            z = z.masked_fill(~_mask, float("-inf"))
        return z
