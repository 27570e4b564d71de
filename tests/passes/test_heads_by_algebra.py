"""Heads found by their algebra, not their spelling (issue 40 item 6, issue 45 item 4): ``torch.addmm`` (function and
method), ``torch.mm``, an einsum with the weight first (``"vh,bh->bv"``), and a weight held as a plain tensor attribute (which
``active_vocab`` accepts). Each is rewritten and exact under the contract.

Oracle: the eager drafter, its logits masked to the active set the state reports after the call (every fed id in it).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanospec_fx
from helpers import compile_nanospec

V, H = 64, 16


class Drafter(nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.embed, self.body = nn.Embedding(V, H), nn.Linear(H, H)
        weight = torch.randn(V, H, generator=torch.Generator().manual_seed(1)) * 0.3
        if spelling == "tensor_attribute":
            self.W = weight  # not a Parameter, not a buffer
        else:
            self.W = nn.Parameter(weight)
        self.b = nn.Parameter(torch.randn(V, generator=torch.Generator().manual_seed(2)))

    def forward(self, ids):
        h = torch.tanh(self.body(self.embed(ids)))[:, -1]
        if self.spelling == "addmm":
            return torch.addmm(self.b, h, self.W.t())
        if self.spelling == "addmm_method":
            return self.b.addmm(h, self.W.T) / 0.7
        if self.spelling == "mm":
            return torch.mm(h, self.W.t()) + self.b
        if self.spelling == "einsum_weight_first":
            return torch.einsum("vh,bh->bv", self.W, h)
        if self.spelling == "einsum_weight_first_batched":
            return torch.einsum("vh,bsh->bsv", self.W, torch.tanh(self.body(self.embed(ids))))
        return F.linear(h, self.W)


@pytest.mark.parametrize("spelling", ["addmm", "addmm_method", "mm", "einsum_weight_first", "einsum_weight_first_batched",
                                      "tensor_attribute"])
def test_the_head_is_found_and_exact_whatever_its_spelling(spelling):
    torch.manual_seed(0)
    model = Drafter(spelling).eval()
    compiled = compile_nanospec(model, capacity=16)
    ids = torch.tensor([[3, 9, 27, 40], [5, 9, 11, 63]])
    with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
        warnings.simplefilter("always")
        out, ref = compiled(ids), model(ids)
    assert not [w for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]
    state = nanospec_fx.active_vocab(model)
    assert state.weight is model.W
    mask = state.contains(torch.arange(V))
    assert mask[ids].all() and int(mask.sum()) < V
    assert torch.isinf(out[..., ~mask]).all() and (out[..., ~mask] < 0).all()
    torch.testing.assert_close(out[..., mask], ref[..., mask], rtol=1e-5, atol=1e-5)


def test_an_addmm_whose_bias_is_not_one_per_token_is_no_head():
    """``addmm(c, h, W.t())`` with ``c`` [B, V] (a per-row term, not a bias) or ``beta != 1``: not a head's bias."""
    class PerRow(Drafter):
        def forward(self, ids):
            h = torch.tanh(self.body(self.embed(ids)))[:, -1]
            return torch.addmm(self.b.expand(h.shape[0], V) * 2, h, self.W.t(), beta=0.5)

    torch.manual_seed(0)
    model = PerRow("addmm").eval()
    compiled = compile_nanospec(model, capacity=16)
    ids = torch.tensor([[3, 9]])
    with pytest.warns(nanospec_fx.NanoSpecWarning), torch.inference_mode():
        out = compiled(ids)
    with torch.inference_mode():
        torch.testing.assert_close(out, model(ids))


class HiddenStatesDrafter(nn.Module):
    """A drafter on the target's hidden states (no token embedding in its graph) whose logits get a ban at the ids
    it is given: ``forward(inputs_embeds, *, input_ids)``."""

    def __init__(self, ban: str):
        super().__init__()
        self.ban = ban
        self.body, self.lm_head = nn.Linear(H, H), nn.Linear(H, V, bias=False)

    def forward(self, inputs_embeds, *, input_ids):
        z = self.lm_head(torch.tanh(self.body(inputs_embeds))[:, -1])
        if self.ban == "scatter":
            return z.scatter(-1, input_ids, -3.0)
        return z.index_fill(-1, input_ids[0], float("-inf"))


@pytest.mark.parametrize("ban", ["scatter", "index_fill"])
def test_a_hidden_states_drafter_with_a_ban_at_its_ids_keeps_its_head(ban):
    """Issue 45 item 4: the ban (a step of the chain the README lists) once made it "no LM head found"."""
    torch.manual_seed(0)
    model = HiddenStatesDrafter(ban).eval()
    compiled = compile_nanospec(model, capacity=16)
    x, ids = torch.randn(2, 3, H), torch.tensor([[4, 8, 15], [16, 23, 42]])
    with torch.inference_mode():
        compiled(x, input_ids=ids)
        state = nanospec_fx.active_vocab(model)
        state.observe(torch.tensor([4, 5, 6, 16, 42, 50]))  # fed by the user: no embedding in this graph
        out, ref = compiled(x, input_ids=ids), model(x, input_ids=ids)
    mask = state.contains(torch.arange(V))
    assert int(mask.sum()) == 6
    assert torch.isinf(out[..., ~mask]).all()
    torch.testing.assert_close(out[..., mask], ref[..., mask], rtol=1e-5, atol=1e-5)


class WideHiddenStatesDrafter(nn.Module):
    """A drafter on hidden states with two projections wider than H reaching the output (the head and a hidden-state
    projection): nothing in the graph says which is the head, the model does."""

    def __init__(self, says: str):
        super().__init__()
        self.says = says
        self.body, self.lm_head, self.up = nn.Linear(H, H), nn.Linear(H, V, bias=False), nn.Linear(H, 80)
        if says == "config":
            self.config = type("Config", (), {"vocab_size": V})()

    def get_output_embeddings(self):
        return self.lm_head if self.says == "get_output_embeddings" else None

    def forward(self, inputs_embeds):
        h = torch.tanh(self.body(inputs_embeds))
        return self.lm_head(h), self.up(h)


@pytest.mark.parametrize("says", ["config", "get_output_embeddings"])
def test_a_wide_head_on_hidden_states_is_found_when_the_model_says_its_vocabulary(says):
    torch.manual_seed(0)
    model = WideHiddenStatesDrafter(says).eval()
    compiled = compile_nanospec(model, capacity=16)
    x = torch.randn(2, 3, H)
    with torch.inference_mode():
        compiled(x)
        state = nanospec_fx.active_vocab(model)
        assert state.weight is model.lm_head.weight
        state.observe(torch.tensor([1, 2, 3, 60]))
        (out, up), (ref, ref_up) = compiled(x), model(x)
    mask = state.contains(torch.arange(V))
    assert torch.isinf(out[..., ~mask]).all()
    torch.testing.assert_close(out[..., mask], ref[..., mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(up, ref_up)


def test_a_wide_head_on_hidden_states_is_dense_with_a_warning_when_nothing_says_which():
    torch.manual_seed(0)
    model = WideHiddenStatesDrafter("nothing").eval()
    compiled = compile_nanospec(model, capacity=16)
    with pytest.warns(nanospec_fx.NanoSpecWarning, match="several projections could be the head"), \
            torch.inference_mode():
        compiled(torch.randn(2, 3, H))
