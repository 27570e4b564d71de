"""The e2e tests' model pair: a tiny Llama over byte ids and an EAGLE drafter trained on it for 2 steps."""
from pathlib import Path

import pytest
import torch
import transformers

from nanospec_fx.eval import loaders


def train_tiny_pair(root: Path, invoke) -> pytest.MonkeyPatch:
    """Save the tiny Llama as ``root / "model"`` and train its drafter with ``invoke`` (the test's CLI runner) into
    ``root / "cache"``; ``loaders.CACHE`` points there until the returned patch is undone."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "model")
    patch = pytest.MonkeyPatch()
    patch.setattr(loaders, "CACHE", root / "cache")
    invoke("train-eagle", "--model", root / "model", "--tokenizer", "bytes", "--corpus", "sample", "--tokens", 2048,
           "--window", 64, "--val-tokens", 256, "--steps", 2, "--threads", 1)
    return patch
