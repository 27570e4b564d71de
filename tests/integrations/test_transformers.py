"""transformers' assisted generation with a drafter compiled in place by nanospec is lossless."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

transformers = pytest.importorskip("transformers")

import nanospec_fx  # noqa: E402
from helpers import tiny_llama  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("inductor", [False, True])
def test_llama_assisted_generation_is_token_for_token_greedy(inductor):
    vocab = 3000
    target, drafter = tiny_llama(vocab, 2, 0), tiny_llama(vocab, 1, 1)
    drafter.compile(backend="nanospec", options={"capacity": 128, "inductor": inductor})
    prompt = torch.randint(0, vocab, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        greedy = target.generate(prompt, max_new_tokens=12, do_sample=False)
        assisted = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter)
    assert torch.equal(greedy, assisted)
    state = nanospec_fx.active_vocab(drafter)
    assert 0 < len(state) <= 128 < vocab
    assert state.contains(prompt).all(), "the prompt fed to the drafter joined the active vocabulary"
    # Only fed tokens join: the prompt, accepted tokens, and drafts (which were active already).
    assert set(state.token_ids().tolist()) <= set(greedy[0].tolist())
