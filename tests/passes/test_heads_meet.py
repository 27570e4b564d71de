"""Heads whose logits meet (README, "heads whose logits meet"; passes/heads_meet.py).

Two head weights hold two active sets. An op that combines their logits element by element has no one set to be
exact on, whatever its spelling: every head of the group runs dense, with ONE warning naming them all. Heads kept
apart (stacked, returned) are rewritten; projections of one weight read one state and stay rewritten, exact on
it; and a head rewritten alone (``options={'head': ...}``) ends its chain at the op that meets the other head.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import nanospec_fx
from helpers import compile_nanospec
from nanospec_fx.vocab import reports as pass_reports
from nanospec_fx.vocab.module_heads import registered_states

V, H = 48, 8
IDS = torch.tensor([[1, 2, 3]])


class TwoHeads(nn.Module):
    def __init__(self, combine):
        super().__init__()
        torch.manual_seed(0)
        self.combine = combine
        self.embed = nn.Embedding(V, H)
        self.head_a = nn.Linear(H, V, bias=False)
        self.head_b = nn.Linear(H, V, bias=False)

    def forward(self, ids):
        h = torch.tanh(self.embed(ids))
        return self.combine(self.head_a(h) / 2, self.head_b(h))


def _in_place_sum(za, zb):
    za.add_(zb)
    return za


MEETING = {
    "add": lambda za, zb: za + zb,
    "sub": lambda za, zb: za - zb,
    "mul": lambda za, zb: za * zb,
    "div": lambda za, zb: za / zb.exp(),
    "mean": lambda za, zb: (za + zb) / 2,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "fmax": torch.fmax,
    "logaddexp": torch.logaddexp,
    "where on a's sign": lambda za, zb: torch.where(za > 0, za, zb),
    "where on a fixed region": lambda za, zb: torch.where(torch.arange(V) < V // 2, za, zb),
    "gather b at a's top-k": lambda za, zb: zb.gather(-1, za.topk(3).indices),
    "stack then amax(0)": lambda za, zb: torch.stack([za, zb]).amax(0),
    "stack then mean(0)": lambda za, zb: torch.stack([za, zb]).mean(0),
    "cat then logsumexp over both": lambda za, zb: torch.cat([za, zb], -1).logsumexp(-1),
    "log-probabilities subtracted (contrastive)": lambda za, zb: za.log_softmax(-1) - zb.log_softmax(-1),
}


def _call(model, **options):
    counters.clear()
    compiled = compile_nanospec(model, capacity=16, **options)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(IDS)
        expected = model(IDS)
    return out, expected, [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]


@pytest.mark.parametrize("combine", list(MEETING))
def test_two_heads_combined_run_dense_with_one_warning_naming_both(combine):
    model = TwoHeads(MEETING[combine]).eval()
    out, expected, warned = _call(model)
    assert len(warned) == 1, warned
    assert "head_a.weight and head_b.weight run dense" in warned[0]
    assert "the logits of two heads are combined" in warned[0]
    assert counters["nanospec"]["heads_dense"] == 2 and not counters["nanospec"]["heads_rewritten"]
    assert counters["nanospec"]["dense: the logits of two heads are combined"] == 2
    torch.testing.assert_close(out, expected)  # dense: eager's values, nothing masked
    assert not any(pass_reports.reports(s) for s in registered_states(model).values())


KEPT_APART = {
    "stacked": lambda za, zb: torch.stack([za, zb]),
    "returned": lambda za, zb: (za, zb),
    "stacked then log_softmax(-1)": lambda za, zb: torch.stack([za, zb]).log_softmax(-1),
    "stacked then top-k": lambda za, zb: torch.stack([za, zb]).topk(2).indices,
    # Medusa's tree scores: each head's top-k log-probabilities (exact on its own set), summed pairwise
    "top-k log-probabilities summed": lambda za, zb: (za.log_softmax(-1).topk(2).values[..., :, None]
                                                     + zb.log_softmax(-1).topk(2).values[..., None, :]),
}


@pytest.mark.parametrize("combine", list(KEPT_APART))
def test_heads_kept_apart_are_each_rewritten(combine):
    model = TwoHeads(KEPT_APART[combine]).eval()
    _, _, warned = _call(model)
    assert not warned
    assert counters["nanospec"]["heads_rewritten"] == 2


class OneWeightTwice(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, ids):
        h = torch.tanh(self.embed(ids))
        return torch.maximum(self.lm_head(h), self.lm_head(torch.sin(h))) - self.lm_head(h.cos())


def test_projections_of_one_weight_read_one_state_and_stay_exact_on_it():
    model = OneWeightTwice().eval()
    out, expected, warned = _call(model)
    assert not warned
    active = nanospec_fx.active_vocab(model).contains(torch.arange(V))
    assert active[IDS.flatten()].all() and not active.all()
    assert torch.isneginf(out[..., ~active]).all()
    torch.testing.assert_close(out[..., active], expected[..., active])


def test_a_head_rewritten_alone_ends_its_chain_where_it_meets_the_other():
    """With options={'head': 'head_a.weight'} head_b is dense: maximum reads a's masked logits and b's whole, so
    it is finite wherever b is (never masked with a's set alone)."""
    model = TwoHeads(torch.maximum).eval()
    out, expected, warned = _call(model, head="head_a.weight")
    assert not warned
    active = nanospec_fx.active_vocab(model, head="head_a.weight").contains(torch.arange(V))
    assert not active.all()
    with torch.no_grad():
        h = torch.tanh(model.embed(IDS))
        oracle = torch.maximum((model.head_a(h) / 2).masked_fill(~active, float("-inf")), model.head_b(h))
    torch.testing.assert_close(out, oracle)
    assert torch.isfinite(out).all()


def test_another_projection_written_into_the_logits_ends_the_chain_there():
    """``za.add_(zb)``: head_b is no head (its logits never reach the output themselves), so head_a alone is
    rewritten; its chain does not go on through the add (zb is no [V] post-op operand gathered at a's set): the
    write is a step of the chain, re-masked after it with a's set (the README's rule for writes)."""
    model = TwoHeads(_in_place_sum).eval()
    out, _, warned = _call(model)
    assert not warned
    active = nanospec_fx.active_vocab(model).contains(torch.arange(V))
    with torch.no_grad():
        h = torch.tanh(model.embed(IDS))
        oracle = ((model.head_a(h) / 2).masked_fill(~active, float("-inf")) + model.head_b(h)).masked_fill(
            ~active, float("-inf"))
    torch.testing.assert_close(out, oracle)


# ----------------------------------------------------------------------------- LoRA deltas on the head
class LoraDelta(nn.Module):
    """``lm_head(h) + B(A(h)) * s``, written out."""

    def __init__(self, rank: int = 2, scale: float = 0.5, delta_read_too: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.lora_A = nn.Linear(H, rank, bias=False)
        self.lora_B = nn.Linear(rank, V, bias=False)
        self.scale = scale
        self.delta_read_too = delta_read_too

    def forward(self, ids):
        h = torch.tanh(self.embed(ids))
        delta = self.lora_B(self.lora_A(h))
        z = self.lm_head(h) + delta * self.scale
        return (z, delta) if self.delta_read_too else z


class PeftStyleLoraLinear(nn.Module):
    """peft's ``lora.Linear`` as it computes (peft is not installed): the base layer plus, per adapter,
    ``lora_B[a](lora_A[a](dropout[a](x))) * scaling[a]``."""

    def __init__(self, base: nn.Linear, rank: int = 2, alpha: int = 4):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, base.out_features, bias=False)})
        nn.init.normal_(self.lora_B["default"].weight)  # peft starts B at zero; a trained adapter is not
        self.lora_dropout = nn.ModuleDict({"default": nn.Dropout(0.0)})
        self.scaling = {"default": alpha / rank}
        self.active_adapters = ["default"]

    def forward(self, x):
        result = self.base_layer(x)
        for name in self.active_adapters:
            result = result + self.lora_B[name](self.lora_A[name](self.lora_dropout[name](x))) * self.scaling[name]
        return result


class PeftDrafter(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)
        self.lm_head = PeftStyleLoraLinear(nn.Linear(H, V, bias=False))

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.embed(ids)))


@pytest.mark.parametrize("make", [LoraDelta, PeftDrafter], ids=["written out", "peft-style lora.Linear"])
def test_a_lora_delta_on_the_head_is_one_head_of_one_set(make):
    """(``test_lora_heads.py`` covers more forms.)"""
    model = make().eval()
    out, expected, warned = _call(model)
    assert not warned, warned
    (state,) = registered_states(model).values()  # one set: the head weight's
    active = state.contains(torch.arange(V))
    torch.testing.assert_close(out, expected.masked_fill(~active, float("-inf")))


def test_a_low_rank_projection_read_on_its_own_too_runs_dense_saying_why_and_how_to_merge():
    """Its logits are an output of their own: no delta of the head, a second head whose logits meet the first's."""
    model = LoraDelta(delta_read_too=True).eval()
    out, expected, warned = _call(model)
    assert len(warned) == 1, warned
    assert "the logits of two heads are combined" in warned[0]
    assert "LoRA delta" in warned[0] and "merge" in warned[0] and "lora_B" in warned[0]
    torch.testing.assert_close(out, expected)


def test_meeting_heads_under_dynamic_shapes():
    """A second call of another length recompiles with symbolic row sizes (the fuzzer's crash: a shape of SymInts
    put in a set); the heads that meet and the ones kept apart decide as before."""
    for combine, meets in ((torch.maximum, True), (KEPT_APART["top-k log-probabilities summed"], False)):
        model = TwoHeads(combine).eval()
        compiled = compile_nanospec(model, capacity=16)
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for ids in (IDS, torch.tensor([[4, 5, 6, 7, 8]]), torch.tensor([[9, 10]])):
                out = compiled(ids)
                if meets:
                    torch.testing.assert_close(out, model(ids))
        warned = {str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)}
        assert len(warned) == (1 if meets else 0), warned
