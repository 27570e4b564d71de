"""Write a trained EAGLE drafter as the checkpoint vLLM's ``eagle`` method loads for a Llama target.

vLLM 0.32's EAGLE-1 Llama drafter (``vllm/model_executor/models/llama_eagle.py``, ``EagleLlamaForCausalLM``)
computes ``h = layer(fc(cat(embed(x[t+1]), f[t])))`` with ``f`` the target's final-norm *output*, no fc bias,
no input norm in its (first) layer, and ``logits = head(h)`` with the target's embedding and head. That is
:class:`~nanospec_fx.eagle.EagleDrafter` in the ``vllm`` layout only: our default layout (features before
the norm, an fc bias, a normed layer input, ``head(norm(h))``) folds into none of it exactly, so it is refused.

The directory holds ``config.json`` (a one-layer Llama config, ``EagleLlamaForCausalLM``) and
``model.safetensors`` with the names vLLM's loader maps: ``fc.weight`` and ``layers.0.*`` (q/k/v and
gate/up are stacked by vLLM itself); no embedding and no head, so vLLM shares the target's.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from nanospec_fx.eagle import EagleDrafter

ARCHITECTURE = "EagleLlamaForCausalLM"  # vLLM maps LlamaForCausalLM to it for `eagle`; named outright here
WEIGHTS = "model.safetensors"
STATIC_LIST = "static-tokens.txt"  # the training text's token ids, most frequent first (the plugin's static policy)


def check_target(target: torch.nn.Module) -> None:
    """``ValueError`` unless vLLM's EAGLE-1 Llama drafter computes with ``target``'s embedding and head what our
    drafter does: a transformers Llama (plain embedding, RMSNorm, no logit soft-cap or scale)."""
    config = getattr(target.config, "text_config", target.config)
    kind = getattr(config, "model_type", None)
    if kind != "llama" or type(target.get_input_embeddings()) is not torch.nn.Embedding:
        raise ValueError(f"vLLM's EAGLE layout is exported for Llama targets only (model_type 'llama', a plain "
                         f"embedding); this target is {kind!r} ({type(target.get_input_embeddings()).__name__})")


def vllm_tensors(drafter: EagleDrafter) -> dict[str, torch.Tensor]:
    """The drafter's own weights under vLLM's names (``ValueError`` for a drafter vLLM would compute differently)."""
    c = drafter.config
    if c.layout != "vllm":
        raise ValueError(
            f"this EAGLE drafter has the {c.layout!r} layout, which vLLM's `eagle` method does not compute "
            "(vLLM feeds the target's final-norm output, has no fc bias, no input norm in the layer and no norm "
            "before the head); train one in vLLM's layout: `nanospec-fx train-eagle ... --vllm-out DIR`")
    out = {"fc.weight": drafter.fc.weight}
    for module, name in drafter.llama_layer_pairs(lambda name: name):
        out[f"layers.0.{name}.weight"] = module.weight
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def vllm_config(drafter: EagleDrafter, max_position_embeddings: int, dtype: torch.dtype) -> dict:
    """A one-layer Llama config with the drafter's shapes and RoPE (vLLM builds the drafter from it)."""
    c = drafter.config
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_eps, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": str(dtype).removeprefix("torch."),
    }


def export_vllm_eagle(drafter: EagleDrafter, out: str | Path, max_position_embeddings: int,
                      dtype: torch.dtype | None = None, frequent: torch.Tensor | None = None) -> Path:
    """Write ``drafter`` (``vllm`` layout) to ``out`` for ``vllm ... --speculative-config '{"method": "eagle",
    "model": "OUT"}'``; ``max_position_embeddings`` should be the target's. ``frequent`` (token ids, most frequent
    first) is written to ``out/static-tokens.txt``, the list ``NANOSPEC_VLLM_STATIC`` takes (docs/vllm.md).
    Returns ``out``."""
    from safetensors.torch import save_file

    tensors = vllm_tensors(drafter)
    dtype = dtype or drafter.fc.weight.dtype
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype) for k, v in tensors.items()}, str(out / WEIGHTS))
    (out / "config.json").write_text(json.dumps(vllm_config(drafter, max_position_embeddings, dtype), indent=1))
    if frequent is not None:
        (out / STATIC_LIST).write_text("\n".join(map(str, frequent.tolist())) + "\n")
    return out
