"""Heads that are not ``nn.Linear``: a weight stored [H, V], Medusa heads stacked in one [K, V, H] weight, an int8
weight-only head, a parametrised head.

    python examples/head_layouts.py

Each drafter is compiled with the nanospec backend and called on a few ids; its logits must equal the eager
drafter's with -inf at the tokens outside the active set (the ids it was fed); the K stacked heads read one set (one
state per head weight: its cache holds the K rows of each active token). The quantised and the parametrised
heads compute only the active rows of their weight (``passes/row_weight.py``); a parametrisation that mixes rows
runs dense, with a warning that says so.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

import nanospec_fx

V, H = 1000, 32


class Drafter(nn.Module):
    """Embedding -> one layer -> a head of the given kind."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        w = torch.randn(V, H) / H**0.5
        if kind == "[H, V] weight":
            self.W = nn.Parameter(w.t().contiguous())  # h @ W, as some research code stores it
        elif kind == "Medusa [K, V, H]":
            self.W = nn.Parameter(torch.stack([w, w.flip(0), -w]))  # 3 heads in one tensor, applied by one einsum
        elif kind == "int8 weight-only":
            scale = w.abs().amax(1) / 127
            self.register_buffer("q", torch.round(w / scale[:, None]).to(torch.int8))
            self.register_buffer("scale", scale)
        else:
            self.lm_head = nn.Linear(H, V, bias=False)
            if kind == "weight_norm":
                self.lm_head = weight_norm(self.lm_head)
            else:  # "column-normalised": every row depends on every other row
                parametrize.register_parametrization(self.lm_head, "weight", ColumnNorm())

    def forward(self, ids):
        h = torch.tanh(self.body(self.embed(ids)))
        if self.kind == "[H, V] weight":
            return h @ self.W
        if self.kind == "Medusa [K, V, H]":
            return torch.einsum("bth,kvh->btkv", h, self.W)  # [B, T, K, V]
        if self.kind == "int8 weight-only":
            return F.linear(h, self.q.to(h.dtype) * self.scale[:, None])
        return self.lm_head(h)


class ColumnNorm(nn.Module):
    def forward(self, W):
        return W / W.norm(dim=0, keepdim=True)


def main() -> None:
    ids = torch.tensor([[5, 17, 256, 999]])
    for kind in ("[H, V] weight", "Medusa [K, V, H]", "int8 weight-only", "weight_norm", "column-normalised"):
        torch._dynamo.reset()
        drafter = Drafter(kind).eval()
        compiled = torch.compile(drafter, backend="nanospec", options={"capacity": 64, "inductor": False})
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, dense = compiled(ids), drafter(ids)
        said = [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]
        if said:
            print(f"{kind:18s} dense: {torch.equal(out, dense)}; warning: ...{said[0][150:260]}...")
            continue
        active = nanospec_fx.active_vocab(compiled).contains(torch.arange(V))
        exact = torch.allclose(out, dense.masked_fill(~active, float("-inf")), rtol=1e-5, atol=1e-5)
        print(f"{kind:18s} rewritten, exact: {exact}, active tokens: {int(active.sum())}")


if __name__ == "__main__":
    main()
