"""A prefill call (embeds the prompt, scores no head) feeds the set the next head of the same model reads.

Oracle: the prompt's ids are those the test drew (plain Python sets), and the decode logits are the eager
dense logits with -inf outside the state's active set.
"""
from __future__ import annotations

import itertools

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


# ----------------------------------------------------------------------------- models that share a table
class OnSharedTable(nn.Module):
    """A drafter built around an embedding it shares (the target's, or another drafter's)."""

    def __init__(self, embed: nn.Embedding, hidden: int = 16):
        super().__init__()
        self.embed = embed
        self.body = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, embed.num_embeddings, bias=False)

    def forward(self, ids, prefill: bool = False):
        h = torch.tanh(self.body(self.embed(ids)))
        return h if prefill else self.lm_head(h[:, -1])


PROMPTS = {"a": [[1, 2, 3, 4, 5]], "b": [[70, 71, 72]]}
STEPS = {"a": [[6]], "b": [[73]]}
ORDERS = [o for o in itertools.permutations(["pa", "pb", "da", "db"])
          if o.index("pa") < o.index("da") and o.index("pb") < o.index("db")]


@pytest.mark.parametrize("order", ORDERS, ids="-".join)
def test_drafters_sharing_one_embedding_keep_their_own_prompts(order):
    """Each drafter's set holds its own prompt and none of the other's, whichever runs first (the prefill ids
    used to be keyed by the table alone: the first decode took both prompts)."""
    torch.manual_seed(0)
    shared = nn.Embedding(90, 16)
    models = {"a": OnSharedTable(shared).eval(), "b": OnSharedTable(shared).eval()}
    compiled = {k: torch.compile(m, backend="nanospec", options={"capacity": 64, "inductor": False})
                for k, m in models.items()}
    with torch.inference_mode():
        for step in order:
            k = step[1]
            if step[0] == "p":
                compiled[k](torch.tensor(PROMPTS[k]), prefill=True)
            else:
                compiled[k](torch.tensor(STEPS[k]))
    for k, other in (("a", "b"), ("b", "a")):
        own = {t for row in PROMPTS[k] + STEPS[k] for t in row}
        theirs = {t for row in PROMPTS[other] + STEPS[other] for t in row}
        assert own <= _active(models[k]) and not theirs & _active(models[k]), (k, order)


class TwoHeads(nn.Module):
    """One embedding and body, two draft heads, picked per call (a graph with both needs options['head'])."""

    def __init__(self, vocab: int = 90, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.body = nn.Linear(hidden, hidden)
        self.head_a = nn.Linear(hidden, vocab, bias=False)
        self.head_b = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, mode: str = "a"):
        h = torch.tanh(self.body(self.embed(ids)))
        if mode == "prefill":
            return h
        return (self.head_a if mode == "a" else self.head_b)(h[:, -1])


@pytest.mark.parametrize("decodes", [["a", "b"], ["b", "a"], ["a", "a", "b"]])
def test_every_head_of_the_model_sees_the_prompt(decodes):
    """A prefill's ids reach each head of its model, whichever runs first (the first head's call used to take
    them all: the other head decoded without the prompt)."""
    torch.manual_seed(0)
    model = TwoHeads().eval()
    compiled = compile_nanospec(model, capacity=64)
    prompt = [[3, 17, 42, 5]]
    with torch.inference_mode():
        compiled(torch.tensor(prompt), mode="prefill")
        for mode in decodes:
            compiled(torch.tensor([[61]]), mode=mode)
        compiled(torch.tensor([[8, 9]]), mode="prefill")  # a later prefill: straight to the heads that read
        for mode in decodes:
            compiled(torch.tensor([[62]]), mode=mode)
    for head in ("head_a", "head_b"):
        active = set(nanospec_fx.active_vocab(model, head=f"{head}.weight").token_ids().tolist())
        assert {3, 17, 42, 5, 61, 8, 9, 62} <= active, head
