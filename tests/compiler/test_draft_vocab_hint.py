"""A pruned draft head (EAGLE-3: ``[R, H]`` head rows over a ``V``-row token embedding, ``d2t`` buffer) compiled without
``draft_to_target``: it runs dense, and the one warning names the buffer and the option to pass; compiled with the
option the warning gives, it is rewritten (the oracle: the explicit option, judged against the eager drafter)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import nanospec_fx
from helpers import compile_nanospec
from nanospec_fx.compiler.options import HeldOption

V, R, H = 120, 30, 8


class Eagle3(nn.Module):
    """EAGLE-3's layout: ``d2t[i] = t_i - i`` for the sorted draft vocabulary t (head row i is target token t_i)."""

    def __init__(self, d2t_dtype=torch.int64, name: str = "d2t", use_in_forward: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, R, bias=False)
        targets = torch.randperm(V, generator=torch.Generator().manual_seed(3))[:R].sort().values
        self.register_buffer(name, (targets - torch.arange(R)).to(d2t_dtype))
        self.name, self.use_in_forward = name, use_in_forward

    def forward(self, ids):
        z = self.lm_head(torch.tanh(self.body(self.embed(ids))))
        if self.use_in_forward:  # EAGLE-3's top-k mapped to target ids inside forward
            top = z.topk(2, dim=-1).indices
            return z, top + getattr(self, self.name)[top]
        return z


def _targets(model) -> torch.Tensor:
    return torch.arange(R) + getattr(model, model.name).long()


@pytest.mark.parametrize("use_in_forward", [False, True])
def test_a_d2t_buffer_is_named_with_the_option_and_the_head_runs_dense(use_in_forward):
    model = Eagle3(use_in_forward=use_in_forward).eval()
    ids = _targets(model)[[1, 4, 9]].unsqueeze(0)
    with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning) as caught:
        out = compile_nanospec(model, capacity=16)(ids)
    (message,) = [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]
    assert "`d2t` is an integer buffer of 30 entries" in message
    assert f"options={{'draft_to_target': torch.arange({R}) + model.d2t, 'target_vocab_size': {V}}}" in message
    with torch.no_grad():
        torch.testing.assert_close(out, model(ids))  # dense


def test_the_option_the_warning_names_rewrites_the_head_exactly():
    model = Eagle3().eval()
    d2t = torch.arange(R) + model.d2t  # what the warning says to pass
    compiled = compile_nanospec(model, capacity=16, draft_to_target=d2t, target_vocab_size=V)
    targets = _targets(model)
    ids = torch.cat([targets[[1, 4, 9]], torch.tensor([t for t in range(V) if t not in set(targets.tolist())][:2])])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", nanospec_fx.NanoSpecWarning)
        out = compiled(ids.unsqueeze(0))
        dense = model(ids.unsqueeze(0))
    rows = torch.zeros(R, dtype=torch.bool)
    rows[[1, 4, 9]] = True  # the fed target ids in the draft vocabulary; the two others have no head row
    torch.testing.assert_close(out, dense.masked_fill(~rows, float("-inf")))


@pytest.mark.parametrize("dtype, values", [(torch.float32, "d2t"), (torch.int64, "out_of_range")])
def test_a_buffer_that_is_not_a_row_map_is_not_named(dtype, values):
    model = Eagle3(d2t_dtype=dtype).eval()
    if values == "out_of_range":
        model.d2t.fill_(V)  # i + d2t[i] >= V: no target ids
    with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning) as caught:
        compile_nanospec(model, capacity=16)(torch.tensor([[1, 2]]))
    message = " ".join(str(w.message) for w in caught)
    assert "integer buffer" not in message
    assert "draft_to_target" in message  # the generic remedy for a narrower head is still named


def test_two_drafters_each_with_its_own_tensor_option():
    """Two drafters of one class, each ``torch.compile``d with its own ``draft_to_target`` tensor: Dynamo compares the
    second's options with the first's cache entry's with ``==`` at its first call, which a tensor answered elementwise
    ("Boolean value of Tensor ... is ambiguous", a crash where eager runs). Both run rewritten, each exact on its own
    set; the caller's dict then holds the tensor it was given in a ``HeldOption`` (compared by identity)."""
    torch._dynamo.reset()
    models = [Eagle3().eval(), Eagle3().eval()]
    with torch.no_grad():
        models[1].lm_head.weight.mul_(2)  # another drafter: other logits
    maps = [torch.arange(R) + m.d2t for m in models]
    options = [{"inductor": False, "capacity": 16, "draft_to_target": d2t, "target_vocab_size": V}
               for d2t in maps]
    compiled = [torch.compile(m, backend="nanospec", options=o) for m, o in zip(models, options)]
    targets = _targets(models[0])
    for i, (model, fn) in enumerate(zip(models, compiled)):
        ids = targets[[1, 4, 9 + i]].unsqueeze(0)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", nanospec_fx.NanoSpecWarning)
            out = fn(ids)
            dense = model(ids)
        rows = torch.zeros(R, dtype=torch.bool)
        rows[[1, 4, 9 + i]] = True
        torch.testing.assert_close(out, dense.masked_fill(~rows, float("-inf")))
    held = options[0]["draft_to_target"]
    assert isinstance(held, HeldOption) and held.value is maps[0] and options[0]["capacity"] == 16
