"""``nanospec_fx.compile(m, capacity=..., mode=...)`` (issue 45 item 6): torch.compile refuses ``mode=`` beside
``options=``; nanospec merges the mode's inductor options (``torch._inductor.list_mode_options``) under its own."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn as nn

import nanospec_fx
from nanospec_fx.compiler import backend

V, H = 50, 8


def test_mode_with_nanospec_options_reaches_the_backend_merged(monkeypatch):
    seen = []
    real = backend.execute

    def spy(plan):
        seen.append((plan.options, plan.patches))
        return real(plan)
    monkeypatch.setattr(backend, "execute", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(V, H), nn.Linear(H, V, bias=False)).eval()
    compiled = nanospec_fx.compile(model, capacity=16, mode="max-autotune-no-cudagraphs", inductor=False)
    with torch.no_grad():
        out = compiled(torch.tensor([[1, 2, 3]]))
    (opts, patches), = seen
    assert opts.vocab_config.capacity == 16
    assert {k: patches[k] for k in torch._inductor.list_mode_options("max-autotune-no-cudagraphs")} == \
        torch._inductor.list_mode_options("max-autotune-no-cudagraphs")
    assert torch.isfinite(out[0, -1]).nonzero().flatten().tolist() == [1, 2, 3]


def test_options_given_win_over_the_modes_and_a_bad_mode_says_what_to_write():
    from nanospec_fx.compiler.options import with_mode

    assert with_mode({"capacity": 8, "max_autotune": False}, "max-autotune")["max_autotune"] is False
    assert with_mode({"capacity": 8}, "default") == {"capacity": 8}
    model = nn.Linear(H, V)
    with pytest.raises(nanospec_fx.OptionError, match="max_autotune=True"):
        nanospec_fx.compile(model, capacity=16, mode="fastest")
