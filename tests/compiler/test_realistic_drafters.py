"""Drafters written the way in-house teams write them: transformers' logits processors verbatim after the head,
several heads, optional ``inputs_embeds``, vocabulary masks in buffers, KV-cache buffers, dict outputs, learned
logit scales, soft-caps, position tables. Each is either rewritten and equal to the oracle, or runs dense with a
warning and equals the dense drafter: never a silent difference.

Oracle: the same eager drafter with the head's logits set to -inf outside the state's active set (a mask applied
right after the head; every step after it here keeps -inf at -inf, so that is the contract's oracle).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.generation import logits_process as lp

import nanospec_fx
from helpers import compile_nanospec

V, H = 101, 32


class Drafter(nn.Module):
    """Embedding -> MLP -> head; ``mask`` (set by the test) is the oracle's -inf outside the active set."""

    def __init__(self, vocab: int = V):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, vocab, bias=False)
        self.mask = None

    def hidden(self, ids):
        return F.silu(self.body(self.embed(ids)))

    def masked(self, z):
        return z if self.mask is None else z.masked_fill(~self.mask, float("-inf"))


class WithProcessors(Drafter):
    def __init__(self, processors):
        super().__init__()
        self.processors = processors

    def forward(self, ids):
        z = self.masked(self.lm_head(self.hidden(ids)[:, -1, :]))
        for p in self.processors:
            z = p(ids, z)
        return torch.softmax(z, -1), z.argmax(-1)


PROCESSORS = {
    "temperature": lambda: [lp.TemperatureLogitsWarper(0.7)],
    "top_k": lambda: [lp.TopKLogitsWarper(5)],
    "top_p": lambda: [lp.TemperatureLogitsWarper(0.9), lp.TopPLogitsWarper(0.8)],
    "min_p": lambda: [lp.MinPLogitsWarper(0.1)],
    "repetition_penalty": lambda: [lp.RepetitionPenaltyLogitsProcessor(1.3)],
    "typical": lambda: [lp.TypicalLogitsWarper(0.9)],
    "eta": lambda: [lp.EtaLogitsWarper(0.01, device="cpu")],
    "epsilon": lambda: [lp.EpsilonLogitsWarper(0.01)],
    "suppress_tokens": lambda: [lp.SuppressTokensLogitsProcessor([3, 4, 5], device="cpu")],
    "no_bad_words": lambda: [lp.NoBadWordsLogitsProcessor([[7], [8, 9]], eos_token_id=1)],
    "sequence_bias": lambda: [lp.SequenceBiasLogitsProcessor({(11,): 5.0, (12,): -3.0})],
    "min_length": lambda: [lp.MinLengthLogitsProcessor(50, eos_token_id=2, device="cpu")],
    "no_repeat_ngram": lambda: [lp.NoRepeatNGramLogitsProcessor(2)],
    "penalty_temperature_top_k_top_p": lambda: [
        lp.RepetitionPenaltyLogitsProcessor(1.2), lp.TemperatureLogitsWarper(0.8), lp.TopKLogitsWarper(10),
        lp.TopPLogitsWarper(0.9)],
    # -inf -> finfo.min through a comparison of the logits: nanospec cannot map it, so dense with a warning
    "inf_nan_remove": lambda: [lp.InfNanRemoveLogitsProcessor()],
}
DENSE = {"inf_nan_remove"}


class OptionalEmbeds(Drafter):
    def forward(self, input_ids=None, inputs_embeds=None):
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        return self.masked(self.lm_head(F.silu(self.body(inputs_embeds)))).float().log_softmax(-1)


class TwoPositions(Drafter):
    def forward(self, ids):
        h = self.hidden(ids)
        return self.masked(self.lm_head(h[:, -1])).softmax(-1) + self.masked(self.lm_head(h[:, -2])).softmax(-1)


class AllowedVocabBuffer(Drafter):
    def __init__(self):
        super().__init__()
        self.register_buffer("allowed", torch.rand(V, generator=torch.Generator().manual_seed(3)) > 0.3)

    def forward(self, ids):
        z = self.masked(self.lm_head(self.hidden(ids)[:, -1]))
        return z.masked_fill(~self.allowed, float("-inf")).topk(4, -1)


class KVCacheBuffer(Drafter):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(2, 16, H))

    def forward(self, ids):
        h = self.hidden(ids)
        t = ids.shape[1]
        self.cache[:, :t].copy_(h)
        att = torch.softmax(h @ self.cache[:, :t].transpose(1, 2) / H**0.5, -1) @ self.cache[:, :t]
        return self.masked(self.lm_head(att[:, -1])).argmax(-1)


class DictOutput(Drafter):
    def forward(self, ids):
        h = self.hidden(ids)
        logits = self.masked(self.lm_head(h)).float()
        return {"logits": logits, "hidden": h, "next": logits[:, -1].argmax(-1)}


class LearnedLogitScale(Drafter):
    def __init__(self):
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, ids):
        return self.masked(self.lm_head(self.hidden(ids)[:, -1]) * self.logit_scale).softmax(-1)


class SoftCap(Drafter):
    def forward(self, ids):
        z = self.lm_head(self.hidden(ids))
        z = torch.tanh(z / 30.0) * 30.0
        return self.masked(z)[:, -1].float().softmax(-1)


class PositionTable(Drafter):
    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(128, H)

    def forward(self, ids, positions):
        h = F.silu(self.body(self.embed(ids) + self.pos(positions)))
        return self.masked(self.lm_head(h[:, -1])).argmax(-1)


class ThresholdWhere(Drafter):
    """A comparison of the logits combined with them: dense with a warning."""

    def forward(self, ids):
        z = self.masked(self.lm_head(self.hidden(ids)[:, -1]))
        return torch.where(z > 0.0, z, torch.full_like(z, -1e4)).softmax(-1)


class UnrecognisedHead(Drafter):
    """A head nanospec does not take ([V, B] logits, vocabulary first): dense with a warning."""

    def forward(self, ids):
        h = self.hidden(ids)[:, -1]
        z = self.lm_head.weight @ h.T
        return self.masked(z.T).T.argmax(0)


FORMS = {
    "optional_inputs_embeds": OptionalEmbeds, "head_at_two_positions": TwoPositions,
    "allowed_vocab_buffer": AllowedVocabBuffer, "kv_cache_buffer": KVCacheBuffer, "dict_output": DictOutput,
    "learned_logit_scale": LearnedLogitScale, "soft_cap": SoftCap, "position_table": PositionTable,
    "threshold_where": ThresholdWhere, "vocabulary_first_head": UnrecognisedHead,
}
DENSE |= {"threshold_where", "vocabulary_first_head"}


def _inputs(name: str) -> dict:
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    if name == "position_table":
        return {"ids": ids, "positions": torch.arange(6).expand(2, 6) + 70}
    return {"input_ids": ids} if name == "optional_inputs_embeds" else {"ids": ids}


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    return torch.equal(a.isinf(), b.isinf()) and torch.allclose(a, b, atol=1e-5, rtol=1e-4, equal_nan=True)


def _verdict(model: Drafter, inputs: dict) -> str:
    torch.manual_seed(0)
    compiled = compile_nanospec(model, capacity=24)
    with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
        warnings.simplefilter("always")
        compiled(**inputs)
        out = compiled(**inputs)
    warned = [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]
    with torch.inference_mode():
        dense = model(**inputs)
        try:
            state = nanospec_fx.active_vocab(model)
        except LookupError:
            state = None
        if state is not None:
            model.mask = state.contains(torch.arange(state.vocab_size))
            oracle = model(**inputs)
            model.mask = None
            ids = next(v for k, v in inputs.items() if "ids" in k)
            if _same(out, oracle) and bool(state.contains(ids).all()):
                return "rewritten"
    assert warned, "SILENT: the compiled drafter equals neither the oracle, nor, with a warning, the dense drafter"
    assert _same(out, dense), f"warned ({warned[0][:120]}), but differs from the dense drafter"
    return "dense"


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_transformers_logits_processors_after_the_head(name):
    torch.manual_seed(0)
    verdict = _verdict(WithProcessors(PROCESSORS[name]()).eval(), _inputs(name))
    assert verdict == ("dense" if name in DENSE else "rewritten")


@pytest.mark.parametrize("name", sorted(FORMS))
def test_in_house_drafter_forms(name):
    torch.manual_seed(0)
    verdict = _verdict(FORMS[name]().eval(), _inputs(name))
    assert verdict == ("dense" if name in DENSE else "rewritten")
