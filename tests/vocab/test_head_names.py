"""A head's name resolves to the state of the weight its module holds now (issue 45 item 6): after untying a tied
head, or replacing a head's weight, the name goes with the new weight's state; the old one is left out."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nanospec_fx
from helpers import compile_nanospec

V, H = 50, 8


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.embed(ids)))


def test_untied_head_name_resolves_to_the_new_weight():
    model = Tied().eval()
    compiled = compile_nanospec(model, capacity=16)
    with torch.no_grad():
        compiled(torch.tensor([[1, 2]]))
    tied = nanospec_fx.active_vocab(model, head="lm_head")
    model.lm_head.weight = nn.Parameter(model.embed.weight.detach().clone())  # untie: a new weight, a new state
    with torch.no_grad():
        out = compiled(torch.tensor([[3, 4]]))
    state = nanospec_fx.active_vocab(model, head="lm_head")
    assert state is not tied and state.is_weight(model.lm_head.weight)
    assert state is nanospec_fx.active_vocab(model)  # the former head's state no longer answers for the model
    assert torch.isfinite(out[0, -1]).nonzero().flatten().tolist() == state.token_ids().sort().values.tolist()
    assert set(state.token_ids().tolist()) == {3, 4}


def test_replaced_head_weight_takes_the_name_and_errors_list_names_once():
    model = Tied().eval()
    model.lm_head = nn.Linear(H, V, bias=False)  # untied before compiling: two 2-D tensors, one head
    compiled = compile_nanospec(model, capacity=16)
    with torch.no_grad():
        compiled(torch.tensor([[5]]))
    first = nanospec_fx.active_vocab(model, head="lm_head")
    model.lm_head.weight = nn.Parameter(torch.randn(V, H))
    with torch.no_grad():
        compiled(torch.tensor([[6]]))
    assert nanospec_fx.active_vocab(model, head="lm_head") is not first
    with pytest.raises(KeyError) as info:
        nanospec_fx.active_vocab(model, head="nothing")
    listed = str(info.value).split("names of heads with one: ")[1].split("]")[0]
    names = [n.strip(" '[") for n in listed.split(",")]
    assert len(names) == len(set(names)) and "lm_head" in names, listed
