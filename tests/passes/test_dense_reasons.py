"""Every dense outcome says the reason README.md's table gives for it (issue 45, item 5): one drafter per documented
reason triggers it; the test checks that the one warning names the head and the reason, in the README's words, that
the counter of that reason moved, and that the dense drafter is eager's."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize
from torch._dynamo.utils import counters

import nanospec_fx
from helpers import compile_nanospec

V, H = 48, 8
IDS = torch.tensor([[1, 2, 3]])
README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


class GlobalNormTimes8(nn.Module):
    """``W / W.norm() * 8``: every row depends on every other (the norm of the whole matrix)."""

    def forward(self, W):
        return W / W.norm() * 8


class LoraParametrization(nn.Module):
    """``W + B @ A``: a LoRA adapter held as a parametrization of the head weight."""

    def __init__(self, rank: int = 2):
        super().__init__()
        self.A = nn.Parameter(torch.randn(rank, H))
        self.B = nn.Parameter(torch.randn(V, rank))

    def forward(self, W):
        return W + self.B @ self.A


class Drafter(nn.Module):
    def __init__(self, parametrization: nn.Module | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        if parametrization is not None:
            parametrize.register_parametrization(self.lm_head, "weight", parametrization)

    def hidden(self, ids):
        return torch.tanh(self.embed(ids))

    def forward(self, ids):
        return self.lm_head(self.hidden(ids))


class TwoHeadsSummed(Drafter):
    def __init__(self):
        super().__init__()
        self.other_head = nn.Linear(H, V, bias=False)

    def forward(self, ids):
        h = self.hidden(ids)
        return self.lm_head(h) - self.other_head(h)


class TakesIds(Drafter):
    """``torch.take`` reads the table at computed ids: an integer read that is not a lookup nanospec observes."""

    def forward(self, ids):
        extra = torch.take(self.embed.weight, ids * H).unsqueeze(-1)
        return self.lm_head(self.hidden(ids) + extra)


# the drafter, the phrase the warning and README.md's table share, the counter key (the reason's first clause)
CASES = {
    "non-row-wise parametrization W / W.norm() * 8": (
        lambda: Drafter(GlobalNormTimes8()), "the weight is not row-wise", "the weight is not row-wise"),
    "LoRA parametrization W + B @ A": (
        lambda: Drafter(LoraParametrization()), "the weight is not row-wise", "the weight is not row-wise"),
    "two heads combined": (
        TwoHeadsSummed, "the logits of two heads are combined", "the logits of two heads are combined"),
    "an integer read that is not a lookup": (
        TakesIds, "is not a lookup nanospec can observe", "take"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_dense_warning_names_the_readme_reason(case):
    make, phrase, key = CASES[case]
    assert phrase in README, f"README.md's table does not give the reason {phrase!r}"
    model = make().eval()
    counters.clear()
    compiled = compile_nanospec(model, capacity=16)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(IDS)
        expected = model(IDS)
    warned = [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]
    assert len(warned) == 1, warned
    assert ("runs dense" in warned[0] or "run dense" in warned[0]) and phrase in warned[0], warned[0]
    assert "no LM head found" not in warned[0]
    assert not counters["nanospec"]["heads_rewritten"] and counters["nanospec"]["heads_dense"] >= 1
    assert any(k.startswith("dense: ") and key in k for k in counters["nanospec"]), dict(counters["nanospec"])
    torch.testing.assert_close(out, expected)
