"""``eagle_generate(prompt_topk=True)``: the paper's prefill seed (the target's top-k at every prompt position).

The active set must then hold every prompt token and the target's top-k at every prompt position,
the output must still be the target's greedy output, and without the flag those top-k tokens
must not be there just because of the prefill (so the flag is what put them in).
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

pytest.importorskip("transformers")

import nanospec_fx  # noqa: E402
from nanospec_fx.eagle.speculative import HFTarget, eagle_generate, greedy_generate, hf_target_forward  # noqa: E402
from copying_pair import V, copying_drafter, head_name, llama, prompt  # noqa: E402 - beside this file


def _decode(prompt_topk: bool):
    target = llama()
    drafter = copying_drafter(target, 0.05)
    nanospec_fx.attach(drafter, head=head_name(drafter), capacity=V)
    compiled = torch.compile(drafter, backend="nanospec", options={"capacity": V, "inductor": False})
    out, _ = eagle_generate(HFTarget(target), compiled, prompt(16), 1, depth=1, observe="none", target_topk=3,
                            prompt_topk=prompt_topk)
    return target, out, nanospec_fx.active_vocab(drafter)


def test_prompt_topk_seeds_the_targets_top_k_at_every_prompt_position():
    target, out, state = _decode(prompt_topk=True)
    with torch.no_grad():
        top = target(prompt(16)).logits[0].topk(3, dim=-1).indices
    assert state.contains(prompt(16)[0]).all()
    assert state.contains(top.reshape(-1)).all()
    assert torch.equal(out, greedy_generate(hf_target_forward(target), prompt(16), 1))


def test_without_prompt_topk_only_the_last_positions_top_k_is_seeded():
    target, _, state = _decode(prompt_topk=False)
    with torch.no_grad():
        top = target(prompt(16)).logits[0].topk(3, dim=-1).indices
    early = top[:-1].reshape(-1)
    early = early[~torch.isin(early, prompt(16)[0]) & ~torch.isin(early, top[-1])]
    assert early.numel() > 0, "the test needs prompt-position top-k tokens that are not otherwise seeded"
    assert not state.contains(early).any()
