"""Autograd as eager wherever the head runs (README, the contract: "autograd as eager").

Every spelling of a grad-mode region around the head (a block, the function form, a decorated submodule or
forward, ``inference_mode`` either way) x the caller's grad mode x a frozen or trainable head x a frozen or
trainable body. The oracle is the same drafter compiled with ``backend="aot_eager"``: every output's
``requires_grad``, the presence of its ``grad_fn``, its values on the active tokens and the gradients after a
backward must be equal; the head runs dense with one warning exactly where grad mode is on at a trainable head.
"""
from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch._dynamo
import torch.nn as nn

import nanospec_fx
from helpers import compile_nanospec
from nanospec_fx.vocab import reports as pass_reports
V, H = 32, 8
IDS = torch.tensor([[1, 2, 3]])


def _no_grad_block(head, h):
    with torch.set_grad_enabled(False):
        return head(h)


def _function_form(head, h):
    prev = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    z = head(h)
    torch.set_grad_enabled(prev)
    return z


def _enable_grad_block(head, h):
    with torch.enable_grad():
        return head(h)


def _inference_block(head, h):
    with torch.inference_mode():
        return head(h)


def _inference_false_block(head, h):
    with torch.inference_mode(False):
        return head(h)


class Head(nn.Module):
    def __init__(self, region):
        super().__init__()
        self.region = region
        self.lm = nn.Linear(H, V, bias=False)

    def forward(self, h):
        return self.region(self.lm, h) if self.region else self.lm(h)


class NoGradHead(Head):
    @torch.no_grad()
    def forward(self, h):
        return self.lm(h)


class InferenceHead(Head):
    @torch.inference_mode()
    def forward(self, h):
        return self.lm(h)


class Drafter(nn.Module):
    def __init__(self, head: Head, post: bool = False):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.head = head
        self.post = post
        self.mask: torch.Tensor | None = None  # the oracle's: the contract's mask where the chain ends

    def forward(self, ids):
        z = self.head(torch.tanh(self.body(self.embed(ids))))
        if self.mask is not None:
            z = z.masked_fill(~self.mask, float("-inf"))
        return (z, z.log_softmax(-1)) if self.post else z


class EnableGradDrafter(Drafter):
    """A training helper: grad mode on for the whole forward, whatever the caller's."""

    @torch.enable_grad()
    def forward(self, ids):
        return super().forward(ids)


# region kind -> (how the drafter is built, grad mode at the head given the caller's)
REGIONS = {
    "none": (lambda: Drafter(Head(None)), lambda outer: outer),
    "no_grad block": (lambda: Drafter(Head(_no_grad_block)), lambda outer: False),
    "set_grad_enabled(False) ... (prev)": (lambda: Drafter(Head(_function_form)), lambda outer: False),
    "@no_grad submodule": (lambda: Drafter(NoGradHead(None)), lambda outer: False),
    "enable_grad block": (lambda: Drafter(Head(_enable_grad_block)), lambda outer: True),
    "@enable_grad forward": (lambda: EnableGradDrafter(Head(None)), lambda outer: True),
    "inference_mode block": (lambda: Drafter(Head(_inference_block)), lambda outer: False),
    "@inference_mode submodule": (lambda: Drafter(InferenceHead(None)), lambda outer: False),
    "inference_mode(False) block": (lambda: Drafter(Head(_inference_false_block)), lambda outer: True),
}


def _build(region: str, head_trainable: bool, body_trainable: bool, post: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = REGIONS[region][0]()
    model.post = post
    model.head.requires_grad_(head_trainable)
    model.embed.requires_grad_(body_trainable)
    model.body.requires_grad_(body_trainable)
    return model


def _outputs(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [out]


def _loss(outs: list[torch.Tensor], active: torch.Tensor) -> torch.Tensor:
    """A loss over the active tokens only (inactive ones are -inf in the compiled drafter)."""
    return sum(o.masked_fill(~active, 0.0).sum() for o in outs if o.requires_grad)


def _check(region: str, outer: bool, head_trainable: bool, body_trainable: bool, post: bool = False) -> None:
    model = _build(region, head_trainable, body_trainable, post)
    compiled = compile_nanospec(model, capacity=16)
    with warnings.catch_warnings(record=True) as caught, torch.set_grad_enabled(outer):
        warnings.simplefilter("always")
        got = _outputs(compiled(IDS))
    warned = [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]

    dense = head_trainable and REGIONS[region][1](outer)
    assert len(warned) == (1 if dense else 0), warned
    if dense:
        assert "needs gradients here" in warned[0]
        active = torch.ones(V, dtype=torch.bool)
    else:
        state = nanospec_fx.active_vocab(model)
        assert pass_reports.reports(state), "the head should be rewritten"
        active = state.contains(torch.arange(V))
        assert active[IDS.flatten()].all() and not active.all()
    oracle_model = _build(region, head_trainable, body_trainable, post)
    if post:  # log_softmax reads the masked logits (the chain ends there); the mask keeps no-grad logits no-grad
        oracle_model.mask = active
    with torch.set_grad_enabled(outer):
        expected = _outputs(torch.compile(oracle_model, backend="aot_eager")(IDS))
    for g, e in zip(got, expected, strict=True):
        assert g.requires_grad == e.requires_grad
        assert (g.grad_fn is None) == (e.grad_fn is None)
        torch.testing.assert_close(g.detach()[..., active], e.detach()[..., active])
    if any(e.requires_grad for e in expected):
        _loss(got, active).backward()
        _loss(expected, active).backward()
        for (name, p), q in zip(model.named_parameters(), oracle_model.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=name)


@pytest.mark.parametrize("region", list(REGIONS))
@pytest.mark.parametrize("outer,head_trainable,body_trainable", list(itertools.product([True, False], repeat=3)))
def test_autograd_equals_aot_eager_whatever_the_region(region, outer, head_trainable, body_trainable):
    _check(region, outer, head_trainable, body_trainable)


@pytest.mark.parametrize("region", ["no_grad block", "@inference_mode submodule", "@enable_grad forward"])
@pytest.mark.parametrize("outer", [True, False])
def test_a_chain_read_outside_the_region_keeps_the_region_grad_mode(region, outer):
    """The logits are materialised (and log_softmax'd) after the region has closed: still its mode."""
    _check(region, outer, head_trainable=False, body_trainable=True, post=True)
