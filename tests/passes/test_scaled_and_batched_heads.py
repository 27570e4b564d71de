"""Heads written as ``addmm`` with ``alpha``/``beta``, and as ``bmm``/``baddbmm`` with the weight broadcast along
the batch: rewritten exactly, or dense with one warning naming why (issue 40, item 6).

``alpha * (x @ W.t()) + beta * b`` is the head ``x @ W.t() + b`` with its input scaled by ``alpha`` and its bias by
``beta`` (``beta == 0``: torch ignores ``b``, NaNs included); ``baddbmm(b, x, W.t().expand(B, H, V))`` multiplies
every batch entry by the same ``W.t()``, so it is the head over ``x`` [B, n, H]. Oracle (independent of the pass):
the eager drafter's logits with -inf at the tokens the active set does not hold after the call.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nanospec_fx
from helpers import compile_nanospec
from nanospec_fx.vocab import reports as pass_reports
V, H = 40, 8
IDS = torch.tensor([[5, 17, 23], [9, 31, 2]])


def _flat(h):
    return h.reshape(-1, H)


FORMS = {
    "addmm_alpha_beta": lambda h, W, b: torch.addmm(b, _flat(h), W.t(), beta=0.5, alpha=2.0).view(2, 3, V),
    "addmm_alpha_int": lambda h, W, b: torch.addmm(b, _flat(h), W.t(), alpha=3).view(2, 3, V),
    "addmm_beta_zero_ignores_nan": lambda h, W, b: torch.addmm(torch.full_like(b, float("nan")), _flat(h), W.t(),
                                                               beta=0, alpha=0.5).view(2, 3, V),
    "addmm_method_scaled": lambda h, W, b: b.addmm(_flat(h), W.t(), beta=-1.0).view(2, 3, V),
    "baddbmm": lambda h, W, b: torch.baddbmm(b, h, W.t().expand(2, H, V)),
    "baddbmm_scaled": lambda h, W, b: torch.baddbmm(b, h, W.t().unsqueeze(0).expand(2, -1, -1), beta=2.0, alpha=0.25),
    "baddbmm_none_index": lambda h, W, b: torch.baddbmm(b, h, W.T[None].expand(h.shape[0], -1, -1)),
    "bmm": lambda h, W, b: torch.bmm(h, W.t().expand(2, H, V)) + b,
    "bmm_broadcast_to": lambda h, W, b: torch.bmm(h, torch.broadcast_to(W.t(), (2, H, V))),
}


class ScaledHead(nn.Module):
    """Embedding -> tanh -> a head written in one of :data:`FORMS` (weight [V, H] and bias [V] Parameters)."""

    def __init__(self, form, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed = nn.Embedding(V, H)
        self.W = nn.Parameter(torch.randn(V, H, generator=g))
        self.b = nn.Parameter(torch.randn(V, generator=g))
        self.form = FORMS[form] if isinstance(form, str) else form  # a name of FORMS, or such a function

    def forward(self, ids):
        return self.form(torch.tanh(self.embed(ids)), self.W, self.b)


class StoredHVHead(ScaledHead):
    """The weight stored [H, V]: ``baddbmm(b, h, W.expand(B, H, V))``."""

    def __init__(self, seed: int = 0):
        super().__init__("baddbmm", seed)
        self.W = nn.Parameter(self.W.detach().t().contiguous())

    def forward(self, ids):
        h = torch.tanh(self.embed(ids))
        return torch.baddbmm(self.b, h, self.W.expand(h.shape[0], H, V), alpha=2.0)


def _check_exact(model: nn.Module) -> None:
    compiled = compile_nanospec(model, capacity=16)
    with torch.no_grad():
        out = compiled(IDS)
        dense = model(IDS)
    state = nanospec_fx.active_vocab(compiled)
    assert pass_reports.reports(state), "the head was not rewritten"
    active = state.contains(torch.arange(V))
    assert active[IDS.flatten()].all() and not active.all()
    torch.testing.assert_close(out, dense.masked_fill(~active, float("-inf")), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", FORMS)
def test_scaled_and_batched_heads_are_rewritten_exactly(form):
    _check_exact(ScaledHead(form).eval())


def test_baddbmm_over_a_weight_stored_h_by_v_is_rewritten_exactly():
    _check_exact(StoredHVHead().eval())


@pytest.mark.parametrize("form", [
    # one bias row per position: not one value per output token, nothing to gather at the active tokens
    lambda h, W, b: torch.addmm(b.expand(6, V) * torch.arange(1.0, 7.0)[:, None], _flat(h), W.t()).view(2, 3, V),
    lambda h, W, b: torch.baddbmm(torch.randn(2, 3, V, generator=torch.Generator().manual_seed(1)), h,
                                  W.t().expand(2, H, V)),
], ids=["addmm_per_row_bias", "baddbmm_per_position_input"])
def test_a_bias_that_is_not_per_token_stays_dense_with_its_reason(form):
    model = ScaledHead(form).eval()
    compiled = compile_nanospec(model, capacity=16)
    with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning, match="not one bias value per output token"):
        out = compiled(IDS)
    torch.testing.assert_close(out, model(IDS))
