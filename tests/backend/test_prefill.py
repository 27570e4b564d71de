"""A prefill call (embeds the prompt, scores no head) feeds the set the next head of the same model reads.

Oracle: the prompt's ids are those the test drew (plain Python sets), and the decode logits are the eager
dense logits with -inf outside the state's active set.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nanospec_fx
from helpers import compile_nanospec


class PrefillDrafter(nn.Module):
    """Embeds ids; a prefill call returns the hidden states, a decode call the head's logits of the last position."""

    def __init__(self, vocab: int = 90, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.body = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, prefill: bool = False):
        h = torch.tanh(self.body(self.embed(ids)))
        if prefill:
            return h
        return self.lm_head(h[:, -1])


def _active(model) -> set[int]:
    return set(nanospec_fx.active_vocab(model).token_ids().tolist())


def test_prompt_of_a_prefill_call_is_active_at_the_next_decode_call():
    torch.manual_seed(0)
    model = PrefillDrafter().eval()
    compiled = compile_nanospec(model, capacity=64)
    prompt, step = torch.tensor([[3, 17, 42, 5, 8]]), torch.tensor([[61]])
    with torch.inference_mode():
        compiled(prompt, prefill=True)
        out = compiled(step)
        active = _active(model)
        assert set(prompt.flatten().tolist()) | {61} <= active
        mask = torch.zeros(90, dtype=torch.bool)
        mask[sorted(active)] = True
        expected = model(step).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(out, expected)


def test_prefill_ids_stay_with_their_own_instance():
    torch.manual_seed(0)
    a, b = PrefillDrafter().eval(), PrefillDrafter().eval()
    ca, cb = compile_nanospec(a, capacity=64), compile_nanospec(b, capacity=64)
    with torch.inference_mode():
        ca(torch.tensor([[1, 2, 3]]), prefill=True)
        cb(torch.tensor([[70, 71]]), prefill=True)
        cb(torch.tensor([[72]]))
        ca(torch.tensor([[4]]))
    assert {1, 2, 3, 4} <= _active(a) and not {70, 71, 72} & _active(a)
    assert {70, 71, 72} <= _active(b) and not {1, 2, 3, 4} & _active(b)


def test_without_observe_inputs_a_prefill_records_nothing():
    torch.manual_seed(0)
    model = PrefillDrafter().eval()
    compiled = compile_nanospec(model, capacity=64, observe_inputs=False)
    with torch.inference_mode():
        compiled(torch.tensor([[3, 17, 42]]), prefill=True)
        compiled(torch.tensor([[61]]))
    assert not {3, 17, 42, 61} & _active(model)


class MultiplySumHead(PrefillDrafter):
    """A head nanospec does not recognise (a broadcast multiply and a sum), read only by an argmax."""

    def forward(self, ids, prefill: bool = False):
        h = torch.tanh(self.body(self.embed(ids)))[:, -1]
        return (h.unsqueeze(1) * self.lm_head.weight).sum(-1).argmax(-1)


def test_a_head_nanospec_misses_is_not_taken_for_a_prefill():
    """Its logits never reach an output, but they are vocabulary-wide: the call warns, and runs unchanged."""
    model = MultiplySumHead().eval()
    ids = torch.tensor([[3, 17, 42]])
    with pytest.warns(nanospec_fx.NanoSpecWarning, match="no LM head found"), torch.inference_mode():
        out = compile_nanospec(model)(ids)
    torch.testing.assert_close(out, model(ids))
