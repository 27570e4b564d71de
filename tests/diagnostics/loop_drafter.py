"""Drafters whose head runs outside what Dynamo hands nanospec, for the diagnosis tests (also run in a fresh
process): an engine-style split (forward returns hidden states, ``compute_logits`` runs the head) and a draft loop
that stops at EOS (a graph break in a loop, so Dynamo skips the whole forward)."""
from __future__ import annotations

import torch
import torch.nn as nn

V, H = 60, 8


class Engine(nn.Module):
    """Engine-style split: forward returns hidden states, compute_logits(h) runs the head outside the call."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, ids):
        return torch.tanh(self.body(self.embed(ids)))

    def compute_logits(self, h):
        return self.lm_head(h)


class DraftLoop(Engine):
    """A draft loop that stops at EOS: a graph break in a loop, so Dynamo skips the whole forward."""

    def forward(self, ids, eos: int = 3):
        out = []
        for _ in range(3):
            z = self.lm_head(self.embed(ids)[:, -1])
            tok = z.argmax(-1, keepdim=True)
            out.append(z)
            if (tok == eos).all():
                break
            ids = torch.cat([ids, tok], 1)
        return torch.stack(out, 1)
