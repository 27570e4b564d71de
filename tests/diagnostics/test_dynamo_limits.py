"""A drafter Dynamo stops handing to nanospec (its recompile limit) runs dense: that is said once."""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

import nanospec_fx


class KeyedDrafter(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 8)
        self.lm_head = nn.Linear(8, 40, bias=False)

    def forward(self, ids, key: str):
        return self.lm_head(self.embed(ids)) * (1.0 + len(key) * 0.0)  # a new Python string: a recompile


def test_reaching_the_recompile_limit_warns_that_the_head_runs_dense():
    model = KeyedDrafter().eval()
    compiled = torch.compile(model, backend="nanospec", options={"inductor": False, "capacity": 8})
    with torch._dynamo.config.patch(recompile_limit=2), torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(1, 5):
            out = compiled(torch.tensor([[1] * n]), "k" * n)
    messages = [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]
    assert any("recompile_limit" in m and "'forward'" in m for m in messages), messages
    assert torch.isfinite(out).all()  # the last call ran the original code: a dense head
