"""The KV-cache speculative loop for transformers targets (nanospec_fx/eagle/speculative.py).

The target's cache must give the logits a full recomputation gives after any extend/crop pattern
(also past a sliding window), and EAGLE decoding on it must reproduce the target's greedy output
token for token, with every head and every way of feeding the active set. The drafter copies the
target's only layer and uses its final norm, so drafts are mostly accepted and the accept, reject
and crop paths all run.
"""
from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch._dynamo

transformers = pytest.importorskip("transformers")

import nanospec_fx  # noqa: E402
from nanospec_fx.eagle import EagleConfig  # noqa: E402
from nanospec_fx.sampling import SpeculativeSampler  # noqa: E402
from copying_pair import V, copying_drafter, head_name, llama, prompt  # noqa: E402 - beside this file
from nanospec_fx.eagle.speculative import (  # noqa: E402
    HFTarget, Sampling, decode, eagle_generate, greedy_generate, hf_target_forward,
)


def gemma3(sliding_window: int = 4):
    """A tiny Gemma-3 with sliding-window layers whose window the test sequences overrun."""
    config = transformers.Gemma3TextConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(config).eval()


@pytest.mark.parametrize("make", [llama, gemma3], ids=["llama", "gemma3-sliding"])
def test_cache_after_extend_and_crop_gives_the_recomputed_logits(make):
    target = make()
    runner = HFTarget(target)
    ids = prompt(10)[0].tolist()
    runner.prefill(torch.tensor([ids]))
    seq = list(ids)
    for extra, keep in [([5, 6, 7], 1), ([8, 9], 2), ([10, 11, 12, 13], 0), ([14], 1)]:
        logits, _ = runner.extend(torch.tensor([extra]))
        with torch.inference_mode():
            full = target(torch.tensor([seq + extra]))
        torch.testing.assert_close(logits, full.logits[0, len(seq):], rtol=1e-4, atol=1e-4)
        seq += extra[:keep]
        runner.crop(len(seq))
        assert len(runner) == len(seq)


def test_features_are_the_input_of_the_final_norm():
    target = llama()
    runner = HFTarget(target)
    ids = prompt(9)
    _, feats = runner.prefill(ids)
    with torch.inference_mode():
        normed = target.model(input_ids=ids).last_hidden_state[0]
    torch.testing.assert_close(target.model.norm(feats), normed)
    assert not torch.allclose(feats, normed)


@pytest.mark.parametrize("make", [llama, gemma3], ids=["llama", "gemma3-sliding"])
@pytest.mark.parametrize("depth", [0, 1, 3])
def test_eagle_decoding_is_the_targets_greedy_output(make, depth):
    target = make()
    expected = greedy_generate(hf_target_forward(target), prompt(), 24)
    out, stats = eagle_generate(HFTarget(target), copying_drafter(target, 0.05), prompt(), 24, depth=depth)
    assert torch.equal(out, expected)
    assert stats.new_tokens == 24 and len(stats.accepted) == stats.rounds
    if depth == 0:
        assert stats.rounds == 23 and stats.drafted == 0  # the first token comes with the prefill
    if depth == 3 and make is llama:
        assert stats.mean_accept_length > 1.5  # the copying drafter is mostly right: accept and crop paths ran
        assert any(a < 3 for a in stats.accepted)  # ... and some drafts were rejected


@pytest.mark.parametrize("observe", ["verified", "accepted", "none"])
def test_nanospec_drafter_is_lossless_and_keeps_a_small_set(observe):
    target = llama()
    drafter = copying_drafter(target, 0.05)
    nanospec_fx.attach(drafter, head=head_name(drafter), capacity=128)
    compiled = torch.compile(drafter, backend="nanospec", options={"capacity": 128, "inductor": False})
    expected = greedy_generate(hf_target_forward(target), prompt(), 24)
    out, stats = eagle_generate(HFTarget(target), compiled, prompt(), 24, depth=2, observe=observe)
    assert torch.equal(out, expected)
    state = nanospec_fx.active_vocab(drafter)
    assert 0 < stats.active_size == len(state) <= 128
    assert state.contains(prompt()[0]).all()


def test_observing_rejected_positions_adds_to_the_set():
    """observe="verified" adds the target's top-k after rejected drafts too: never fewer tokens."""
    sizes = {}
    for observe in ("accepted", "verified"):
        target = llama()
        drafter = copying_drafter(target, 0.3)
        nanospec_fx.attach(drafter, head=head_name(drafter), capacity=V)
        compiled = torch.compile(drafter, backend="nanospec", options={"capacity": V, "inductor": False})
        _, stats = eagle_generate(HFTarget(target), compiled, prompt(), 24, depth=3, observe=observe)
        sizes[observe] = stats.active_size
    assert sizes["verified"] >= sizes["accepted"]


def test_the_loop_reads_no_clock_and_a_timer_sees_every_phase(monkeypatch):
    """Timing belongs to the caller: the loop neither synchronises the device nor reads a clock itself."""
    target = llama()
    expected = greedy_generate(hf_target_forward(target), prompt(), 8)

    def forbidden(*args, **kwargs):
        raise AssertionError("the decode loop timed itself")

    monkeypatch.setattr(time, "perf_counter", forbidden)
    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    phases = []

    @contextlib.contextmanager
    def timer(phase):
        phases.append(phase)
        yield

    out, stats = eagle_generate(HFTarget(target), copying_drafter(target, 0.05), prompt(), 8, depth=2, timer=timer)
    monkeypatch.undo()
    assert torch.equal(out, expected)
    assert phases == ["draft", "verify", "draft"] * stats.rounds


def test_sampling_on_the_cache_follows_the_target():
    """The same loop samples: near temperature 0 the target's distribution is one token, its greedy choice."""
    target = llama()
    expected = greedy_generate(hf_target_forward(target), prompt(), 16)
    sampler = SpeculativeSampler(temperature=1e-4)
    out, stats = eagle_generate(HFTarget(target), copying_drafter(target, 0.05), prompt(), 16, depth=3,
                                sampler=sampler, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, expected)
    assert sum(stats.accepted) > 0 and stats.drafted > 0  # drafts were drawn and accepted
    with pytest.raises(ValueError, match="one path per round"):
        decode(HFTarget(target), copying_drafter(target), prompt(), 4, Sampling(sampler, None, depth=2, top_k=2))


def test_bad_arguments_say_what_is_accepted():
    target = llama()
    with pytest.raises(ValueError, match="observe must be one of"):
        eagle_generate(HFTarget(target), None, prompt(), 4, observe="all")
    with pytest.raises(ValueError, match=r"shape \[1, P\]"):
        eagle_generate(HFTarget(target), None, prompt()[0], 4)
    with pytest.raises(RuntimeError, match="before prefill"):
        HFTarget(target).extend(prompt())


def test_drafter_config_of_a_gemma3_target_takes_the_global_rope_theta():
    """Gemma-3 configs give RoPE per layer type (and rope_theta None): the drafter takes the full-attention one."""
    config = gemma3().config
    config.rope_parameters = {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                              "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}
    config.rope_theta = None
    assert EagleConfig.from_target(config).rope_theta == 1e6
