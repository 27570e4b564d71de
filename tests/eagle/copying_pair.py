"""The tiny transformers target and the drafter that copies its only layer, shared by the speculative-loop tests:
drafts are mostly accepted, so the accept, reject and crop paths of the loop all run."""
from __future__ import annotations

import pytest
import torch

from nanospec_fx.eagle import EagleConfig, EagleDrafter
from nanospec_fx.eagle.speculative import final_norm

transformers = pytest.importorskip("transformers")

V = 512


def llama(layers: int = 1):
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def copying_drafter(target, noise: float = 0.0) -> EagleDrafter:
    drafter = EagleDrafter(
        EagleConfig.from_target(target.config), target.model.embed_tokens, target.lm_head, final_norm(target)
    )
    return drafter.copy_target_layer(target.model.layers[0], noise).eval()


def head_name(drafter) -> str:
    """The head weight's parameter name (a tied head is listed under the embedding's name)."""
    return next(n for n, p in drafter.named_parameters() if p is drafter.lm_head.weight)


def prompt(length: int = 12, seed: int = 2):
    return torch.randint(0, V, (1, length), generator=torch.Generator().manual_seed(seed))
