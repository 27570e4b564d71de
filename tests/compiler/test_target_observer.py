"""The target observer: the target's top-k at every scored position joins the drafter's set."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn as nn

import nanospec_fx
from helpers import tiny_llama
from drafters import TinyDrafter

transformers = pytest.importorskip("transformers")


def test_target_outputs_are_bit_identical_and_its_top3_is_observed():
    target, drafter = tiny_llama(2000, 2, 0), tiny_llama(2000, 1, 1)
    ids = torch.randint(0, 2000, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        eager = target(ids).logits
    state = nanospec_fx.speculative_pair(target, drafter, capacity=512, inductor=False)
    with torch.inference_mode():
        observed = target(ids).logits
    assert torch.equal(observed, eager)
    top3 = eager.topk(3, dim=-1).indices
    assert state.contains(top3).all() and state.contains(ids).all()
    expected = set(top3.flatten().tolist()) | set(ids.flatten().tolist())
    assert set(state.token_ids().tolist()) == expected


def test_target_observer_under_inductor_matches_plain_inductor():
    target, drafter = tiny_llama(1000, 1, 0), tiny_llama(1000, 1, 1)
    ids = torch.randint(0, 1000, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        plain = torch.compile(target)(ids).logits
    state = nanospec_fx.attach(drafter, capacity=64)
    observer = torch.compile(target, backend="nanospec", options={"observe_topk": 2, "vocab": state})
    with torch.inference_mode():
        out = observer(ids).logits
    assert torch.equal(out, plain)
    assert state.contains(out.topk(2, dim=-1).indices).all()


@pytest.mark.slow
def test_assisted_generation_with_target_observer_is_lossless():
    target, drafter = tiny_llama(3000, 2, 0), tiny_llama(3000, 1, 1)
    prompt = torch.randint(0, 3000, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        greedy = target.generate(prompt, max_new_tokens=12, do_sample=False)
    state = nanospec_fx.speculative_pair(target, drafter, capacity=512, inductor=False)
    with torch.inference_mode(), state.request():
        assisted = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter)
        assert 0 < len(state) <= 512
        # HF asks the target for the last prompt position's logits only; observe_prompt (the
        # default) still makes the top-3 of every prompt position active.
        active = set(state.token_ids().tolist())
        prompt_top3 = target(prompt).logits.topk(3, dim=-1).indices
    assert set(prompt_top3.flatten().tolist()) <= active
    assert torch.equal(assisted, greedy)
    assert len(state) == 0, "request() resets the set when the request ends"


def test_without_observe_prompt_only_scored_positions_are_observed():
    target, drafter = tiny_llama(3000, 1, 0), tiny_llama(3000, 1, 1)
    prompt = torch.randint(0, 3000, (1, 10), generator=torch.Generator().manual_seed(4))
    state = nanospec_fx.speculative_pair(target, drafter, capacity=512, inductor=False, observe_prompt=False)
    with torch.inference_mode():
        full = target(prompt).logits
        state.reset()
        target(prompt, logits_to_keep=1)  # what generate does at prefill
    active = set(state.token_ids().tolist())
    assert set(full[:, -1].topk(3, dim=-1).indices.flatten().tolist()) <= active
    expected = set(full.topk(3, dim=-1).indices.flatten().tolist()) | set(prompt.flatten().tolist())
    assert active < expected, "the other prompt positions' top-3 were not observed"


def test_target_observer_rejects_bad_options():
    target, drafter = TinyDrafter(50, 8).eval(), TinyDrafter(60, 8).eval()
    state = nanospec_fx.attach(drafter, head="lm_head.weight", capacity=8)
    with pytest.raises(Exception, match="observe_topk and vocab go together"):
        torch.compile(target, backend="nanospec", options={"observe_topk": 3})(torch.tensor([[1]]))
    with pytest.raises(Exception, match="60 tokens"):
        torch.compile(target, backend="nanospec", options={"observe_topk": 3, "vocab": state, "inductor": False})(
            torch.tensor([[1]])
        )
    with pytest.raises(Exception, match="must be the drafter module or its ActiveVocab"):
        torch.compile(target, backend="nanospec", options={"observe_topk": 3, "vocab": "drafter", "inductor": False})(
            torch.tensor([[1]])
        )


def test_static_state_is_not_fed_by_the_target():
    target, drafter = TinyDrafter(50, 8).eval(), TinyDrafter(50, 8).eval()
    freqs = torch.arange(50)  # token 49 most frequent
    state = nanospec_fx.attach(drafter, head="lm_head.weight", policy="static", frequencies=freqs, static_size=5)
    observer = torch.compile(target, backend="nanospec", options={"observe_topk": 3, "vocab": state, "inductor": False})
    with torch.inference_mode():
        observer(torch.tensor([[1, 2, 3]]))
    assert sorted(state.token_ids().tolist()) == [45, 46, 47, 48, 49]


class _Target(nn.Module):
    """A target of its own class (Dynamo caches graphs per code object: not the drafter's class)."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, hidden), nn.Linear(hidden, vocab)

    def forward(self, ids):
        return self.head(self.embed(ids).tanh())


@pytest.mark.parametrize("observer_first", [True, False])
def test_the_observer_follows_the_drafter_to_another_dtype(observer_first):
    """``drafter.to(dtype)`` rebuilds the shared state in the new dtype: the observer keeps feeding it (no
    error), and the drafter's logits stay equal to its masked eager logits, in each dtype and back."""
    torch.manual_seed(0)
    vocab = 50
    target, drafter = _Target(vocab, 8).eval(), TinyDrafter(vocab, 8).eval()
    state = nanospec_fx.attach(drafter, head="lm_head.weight", capacity=16)
    observer = torch.compile(target, backend="nanospec", options={"observe_topk": 2, "vocab": state, "inductor": False})
    compiled = torch.compile(drafter, backend="nanospec",
                             options={"head": "lm_head.weight", "capacity": 16, "inductor": False})
    batches = iter(torch.arange(3, 48).view(-1, 1, 3))

    def step(first):
        calls = [lambda: observer(next(batches)), lambda: compiled(next(batches))]
        for call in calls if first else calls[::-1]:
            call()
        ids = next(batches)
        out, eager = compiled(ids), drafter(ids)
        active = torch.zeros(vocab, dtype=torch.bool)
        active[state.token_ids()] = True  # the oracle: eager logits, -inf outside the set
        torch.testing.assert_close(out, eager.masked_fill(~active, float("-inf")))
        return out

    with torch.no_grad():
        step(observer_first)
        for dtype in (torch.float64, torch.float32):
            drafter.to(dtype)
            assert step(observer_first).dtype == dtype
            assert nanospec_fx.active_vocab(drafter) is state and state.cache_w.dtype == dtype


def test_detach_undoes_speculative_pair():
    """After detach the target observes nothing, both models run their own eager calls again (or what they had
    before), and Dynamo's recompile limit is what it was; the drafter's ActiveVocab stays its handle."""
    target, drafter = tiny_llama(500, 1, 0), tiny_llama(500, 1, 1)
    ids = torch.randint(0, 500, (1, 6), generator=torch.Generator().manual_seed(5))
    limit = torch._dynamo.config.recompile_limit
    try:
        torch._dynamo.config.recompile_limit = 3
        state = nanospec_fx.speculative_pair(target, drafter, capacity=64, inductor=False)
        again = nanospec_fx.speculative_pair(target, drafter, capacity=64, inductor=False)  # paired twice
        assert again is state and torch._dynamo.config.recompile_limit == nanospec_fx.integrations.transformers.PAIR_RECOMPILE_LIMIT
        with torch.inference_mode():
            target(ids)
        assert len(state) > 0  # the observer ran
        nanospec_fx.detach(drafter)  # either model of the pair undoes both
        assert target._compiled_call_impl is None and drafter._compiled_call_impl is None
        assert torch._dynamo.config.recompile_limit == 3
        state.reset()
        with torch.inference_mode():
            target(ids)
            drafter(ids)
        assert len(state) == 0, "a detached target (or drafter) still adds tokens"
        assert nanospec_fx.active_vocab(drafter) is state
        with pytest.raises(ValueError, match="not part of a pair"):
            nanospec_fx.detach(target)
    finally:
        torch._dynamo.config.recompile_limit = limit


def test_detach_gives_back_a_models_own_compile_and_keeps_a_limit_changed_since():
    target, drafter = tiny_llama(500, 1, 0), tiny_llama(500, 1, 1)
    target.compile(backend="eager")
    own = target._compiled_call_impl
    limit = torch._dynamo.config.recompile_limit
    try:
        nanospec_fx.speculative_pair(target, drafter, capacity=64, inductor=False)
        assert target._compiled_call_impl is not own
        torch._dynamo.config.recompile_limit = 100  # the user's, after the pair: kept
        nanospec_fx.detach(target)
        assert target._compiled_call_impl is own and drafter._compiled_call_impl is None
        assert torch._dynamo.config.recompile_limit == 100
    finally:
        torch._dynamo.config.recompile_limit = limit
