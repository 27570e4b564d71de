"""Issue 16, class 10: a head bias replaced by another tensor is tracked like the weight: the active
tokens take the new bias (assignment, load_state_dict(assign=True), through a target observer too), and a
new head of another vocabulary size gets a correct rebuild, never a crash or a stale bias."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nanospec_fx
from mlp_drafter import H, V, Drafter  # beside this file

IDS = torch.tensor([[1, 2, 3]])


def setup():
    model = Drafter("linear", bias=True).eval()
    compiled = torch.compile(model, backend="nanospec", options={"inductor": False, "capacity": 16})
    with torch.no_grad():
        compiled(IDS)
    return model, compiled


def check(model, compiled, ids=IDS):
    """Compiled logits equal the eager drafter's, with inactive tokens masked (an oracle of plain torch)."""
    with torch.no_grad():
        out = compiled(ids)
        vocab = model.lm_head.weight.shape[0]
        active = torch.zeros(vocab, dtype=torch.bool)
        active[nanospec_fx.active_vocab(model).token_ids()] = True
        want = model(ids).masked_fill(~active, float("-inf"))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    return out


def test_a_bias_assigned_a_new_parameter_is_followed():
    model, compiled = setup()
    state = nanospec_fx.active_vocab(model)
    model.lm_head.bias = nn.Parameter(torch.randn(V) * 10)
    check(model, compiled)
    assert nanospec_fx.active_vocab(model) is state and state.bias is model.lm_head.bias


def test_a_bias_loaded_with_assign_is_followed():
    model, compiled = setup()
    model.load_state_dict({"lm_head.bias": torch.randn(V) * 10}, strict=False, assign=True)
    check(model, compiled)
    full = {k: v + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(full, assign=True)  # a new weight and a new bias: the new head gets its own state
    check(model, compiled, torch.tensor([[4, 5, 6]]))


@pytest.mark.parametrize("how", ["new_parameters", "weight_data"])
def test_a_head_replaced_by_one_of_another_vocabulary_size_is_rebuilt(how):
    model, compiled = setup()
    model.lm_head.bias = nn.Parameter(torch.randn(V) * 10)  # first a new bias of the same size...
    check(model, compiled)
    model.embed = nn.Embedding(V + 4, H)  # ...then a resized vocabulary (as resize_token_embeddings does)
    if how == "new_parameters":
        model.lm_head.weight = nn.Parameter(torch.randn(V + 4, H))
    else:  # the same Parameter object with new data: its state is rebuilt in place
        model.lm_head.weight.data = torch.randn(V + 4, H)
    model.lm_head.bias = nn.Parameter(torch.randn(V + 4) * 10)
    out = check(model, compiled, torch.tensor([[7, 8, V + 2]]))
    assert out.shape[-1] == V + 4
    assert nanospec_fx.active_vocab(model).bias is model.lm_head.bias


def test_a_target_observer_takes_the_drafters_new_bias():
    """The observer copies the drafter's head rows into the shared state: after the drafter followed its new
    bias, the observer must copy from the new one too."""
    model, compiled = setup()

    class Target(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(V, H), nn.Linear(H, V)

        def forward(self, ids):
            return self.head(self.embed(ids).tanh())

    target = Target().eval()
    observer = torch.compile(target, backend="nanospec",
                             options={"observe_topk": 2, "vocab": nanospec_fx.active_vocab(model), "inductor": False})
    with torch.no_grad():
        observer(IDS)
        model.lm_head.bias = nn.Parameter(torch.randn(V) * 10)
        compiled(IDS)  # the drafter follows its new bias
        observer(torch.tensor([[20, 21, 22]]))  # new tokens join from the target: their bias rows must be new
    check(model, compiled)
    assert nanospec_fx.active_vocab(model).contains(torch.tensor([20, 21, 22])).all()
