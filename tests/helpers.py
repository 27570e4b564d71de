"""Shared test helpers: compile with nanospec, build the eager oracle, compare per dtype."""
from __future__ import annotations

import torch
import torch._dynamo

import nanospec_fx

TOLERANCES = {  # (rtol, atol) per dtype for logits computed from a different matmul blocking
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 5e-2),
}


def compile_nanospec(model, **options):
    torch._dynamo.reset()
    options.setdefault("inductor", False)
    return torch.compile(model, backend="nanospec", options=options)


def active_mask(model, **kw) -> torch.Tensor:
    state = nanospec_fx.active_vocab(model, **kw)
    return state.contains(torch.arange(state.vocab_size))


def assert_close_per_dtype(actual, expected, compute_dtype=None):
    """Compare with the tolerance of ``compute_dtype`` (the head's dtype; default: the output's).

    An fp32 output computed from bf16 logits (``log_softmax(z.float())``) carries bf16 error.
    """
    if isinstance(expected, (tuple, list)):
        assert type(actual) is type(expected) or isinstance(actual, tuple) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_close_per_dtype(a, e, compute_dtype)
        return
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if expected.is_floating_point():
        rtol, atol = TOLERANCES[compute_dtype or expected.dtype]
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    else:
        torch.testing.assert_close(actual, expected)


def tiny_llama(vocab: int, layers: int, seed: int):
    """A random-weight LlamaForCausalLM small enough for CPU tests."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config).eval()
