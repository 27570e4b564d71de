"""A post-op whose other operand needs gradients runs the head dense (found by a review of the passes).

EAGLE-style training: the head frozen, the body trainable, grad mode on, and a post-op with a trainable operand: a
learned temperature ``z * exp(-log_t)``, an adaptive one computed by the body ``z / t(h)``, a trainable soft-cap, a
trainable logit bias, a learned temperature after a ban written on the logits (the materialised path). Rewritten,
the compact logits hold -inf at the slots no token uses and autograd's ``sum(grad * z)`` for the operand made NaN
of it (0 * -inf), in the operand and in every weight it is computed from. The head runs dense with one warning
naming the operand; where grad mode is off at the post-op (``torch.no_grad()``, or the step in a ``no_grad`` block
while its operand is a trainable parameter) the head stays rewritten. The oracle is the eager drafter (masked with
-inf at the inactive tokens where the chain ends, for a rewritten head), written here.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanospec_fx
from helpers import compile_nanospec
from nanospec_fx.vocab import reports as pass_reports

V, H = 40, 8
IDS = torch.tensor([[3, 17, 22], [5, 9, 30]])
NEG = float("-inf")


class Drafter(nn.Module):
    """Embedding -> body -> frozen head -> a post-op with a trainable operand (``form``)."""

    def __init__(self, form: str):
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=False).requires_grad_(False)
        self.log_t = nn.Parameter(torch.tensor(0.3))
        self.temp_proj = nn.Linear(H, 1)
        self.cap = nn.Parameter(torch.tensor(3.0))
        self.logit_bias = nn.Parameter(torch.randn(V) * 0.1)
        self.register_buffer("ban", torch.tensor([4, 11]))
        self.mask: torch.Tensor | None = None  # the oracle's: -inf at inactive tokens where the chain ends

    def forward(self, ids):
        h = torch.tanh(self.body(self.embed(ids)))
        z = self.lm_head(h)
        if self.form == "learned_temperature":
            z = z * torch.exp(-self.log_t)
        elif self.form == "adaptive_temperature":
            z = z / (F.softplus(self.temp_proj(h)) + 0.5)
        elif self.form == "trainable_softcap":
            z = self.cap * torch.tanh(z / self.cap)
        elif self.form == "trainable_logit_bias":
            z = z + self.logit_bias
        elif self.form == "ban_then_learned_temperature":
            z = z.clone()
            z[..., self.ban] = -30.0
            z = z * torch.exp(-self.log_t)
        elif self.form == "no_grad_step":  # grad mode off at the step: its operand is trainable, nothing records it
            with torch.no_grad():
                z = z * self.log_t
        elif self.form == "type_as_hidden":  # reads only the dtype of h (which needs gradients)
            z = z.type_as(h) / 0.7
        if self.mask is not None:
            z = z.masked_fill(~self.mask, NEG)
        return z


# form -> what the warning names (the operand, or the trainable input it is computed from)
TRAINABLE = {
    "learned_temperature": "log_t",
    "adaptive_temperature": "temp_proj.weight",
    "trainable_softcap": "cap",
    "trainable_logit_bias": "logit_bias",
    "ban_then_learned_temperature": "log_t",
}


def _call(model: nn.Module, grad: bool):
    compiled = compile_nanospec(model, capacity=16)
    with warnings.catch_warnings(record=True) as caught, torch.set_grad_enabled(grad):
        warnings.simplefilter("always")
        out = compiled(IDS)
    return out, [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]


@pytest.mark.parametrize("form", list(TRAINABLE))
def test_a_trainable_post_op_operand_in_grad_mode_runs_the_head_dense(form):
    model = Drafter(form)
    oracle = copy.deepcopy(model)
    out, warned = _call(model, grad=True)
    assert len(warned) == 1 and "needs gradients here" in warned[0] and TRAINABLE[form] in warned[0], warned
    expected = oracle(IDS)  # dense: every token's logit, as eager
    torch.testing.assert_close(out, expected)
    weights = torch.linspace(-1, 1, V)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    for (name, p), q in zip(model.named_parameters(), oracle.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert p.grad.isfinite().all(), name
            torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("form", [*TRAINABLE, "no_grad_step", "type_as_hidden"])
def test_a_trainable_post_op_operand_without_gradients_stays_rewritten(form):
    """Under torch.no_grad() (or a step in a no_grad block, or one that reads only the dtype of a tensor needing
    gradients) no gradient of the operand reads the compact logits: rewritten, and equal to the masked eager
    drafter."""
    model = Drafter(form)
    grad = form in ("no_grad_step", "type_as_hidden")
    out, warned = _call(model, grad=grad)
    assert not warned
    state = nanospec_fx.active_vocab(model)
    assert pass_reports.reports(state), "the head should be rewritten"
    active = state.contains(torch.arange(V))
    assert active[IDS.flatten()].all() and not active.all()
    oracle = copy.deepcopy(model)
    oracle.mask = active
    with torch.set_grad_enabled(grad):
        expected = oracle(IDS)
    assert out.requires_grad == expected.requires_grad == (form == "type_as_hidden")
    torch.testing.assert_close(out, expected)
    if out.requires_grad:  # the body's gradients through the compact head: as the masked eager drafter's
        out.masked_fill(~active, 0.0).sum().backward()
        expected.masked_fill(~active, 0.0).sum().backward()
        for (name, p), q in zip(model.named_parameters(), oracle.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=name)
