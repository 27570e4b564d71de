"""Assisted generation is lossless for drafters of every common model family.

For each family a tiny random target (2 layers) and drafter (1 layer) share the vocabulary; the
drafter is compiled in place with nanospec and drives ``target.generate(assistant_model=...)``.
The families differ exactly where the head pass has to cope: an untied ``lm_head`` (Llama, Qwen2,
Mistral), a tied head (GPT-2, Gemma-3), and Gemma-3's scaled embeddings, final-logit softcapping
and 262k vocabulary.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

transformers = pytest.importorskip("transformers")

import nanospec_fx  # noqa: E402

VOCAB = 3000
CAPACITY = 128


def llama_like(config_cls, vocab, layers):
    return config_cls(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def gemma3(vocab, layers):
    return transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=128, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"][:layers] if layers > 1 else ["full_attention"],
        final_logit_softcapping=30.0, tie_word_embeddings=True)


def gpt2(vocab, layers):
    return transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=layers, n_head=4, n_positions=128,
                                   bos_token_id=vocab - 1, eos_token_id=vocab - 1)


FAMILIES = {  # name -> (config factory, model class, vocabulary size)
    "llama": (lambda v, n: llama_like(transformers.LlamaConfig, v, n), transformers.LlamaForCausalLM, VOCAB),
    "qwen2": (lambda v, n: llama_like(transformers.Qwen2Config, v, n), transformers.Qwen2ForCausalLM, VOCAB),
    "mistral": (lambda v, n: llama_like(transformers.MistralConfig, v, n), transformers.MistralForCausalLM, VOCAB),
    "gemma3": (gemma3, transformers.Gemma3ForCausalLM, 262144),
    "gpt2": (gpt2, transformers.GPT2LMHeadModel, VOCAB),
}


def build(family: str, layers: int, seed: int):
    make_config, model_cls, vocab = FAMILIES[family]
    torch.manual_seed(seed)
    return model_cls(make_config(vocab, layers)).eval()


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_assisted_generation_is_token_for_token_greedy(family):
    target, drafter = build(family, 2, seed=0), build(family, 1, seed=1)
    vocab = FAMILIES[family][2]
    drafter.compile(backend="nanospec", options={"capacity": CAPACITY, "inductor": False})
    prompt = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        greedy = target.generate(prompt, **kwargs)
        assisted = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert torch.equal(greedy, assisted), f"{family}: assisted output differs from the target's greedy output"

    state = nanospec_fx.active_vocab(drafter)
    assert state.vocab_size == vocab
    assert 0 < len(state) <= CAPACITY and len(state) * 20 < vocab, "the active set is far smaller than V"
    assert state.contains(prompt).all(), "the prompt fed to the drafter joined the active vocabulary"
    # Only tokens fed to the drafter join: the prompt, then accepted/corrected tokens.
    assert set(state.token_ids().tolist()) <= set(greedy[0].tolist())

    # The drafter's own logits: eager on the active tokens (after Gemma's softcap too), -inf elsewhere.
    with torch.inference_mode():
        compiled = drafter(greedy).logits
        eager = drafter.forward(greedy).logits  # in-place compile wraps __call__, not forward
    active = state.contains(torch.arange(vocab))
    assert torch.isneginf(compiled[..., ~active]).all()
    torch.testing.assert_close(compiled[..., active], eager[..., active], rtol=1e-5, atol=1e-5)
