"""Tiny random checkpoints vLLM loads: a Llama target and a drafter for each speculative method.

vLLM's CPU attention needs ``head_dim >= 32``; an EAGLE-3 drafter of a small target needs
``eagle_aux_hidden_state_layer_ids`` without duplicates. No tokenizer: the tests pass token ids
(``skip_tokenizer_init=True``). Plain torch + safetensors + json (transformers' DeepSeek-V3 for
:func:`build_deepseek_mtp`), no vLLM import, so the test process can build them before it starts the
engine in a subprocess.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 1024
HIDDEN = 64
HEADS = 2  # head_dim 32: the smallest vLLM's CPU attention takes
INTERMEDIATE = 128
TARGET_LAYERS = 3
DRAFT_VOCAB = 256  # EAGLE-3's own draft vocabulary (d2t)


def _llama_config(layers: int, vocab: int = VOCAB, **extra) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "num_hidden_layers": layers,
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "head_dim": HIDDEN // HEADS,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
        **extra,
    }


def _layer(prefix: str, g: torch.Generator, qkv_in: int = HIDDEN) -> dict[str, torch.Tensor]:
    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.5 / shape[-1] ** 0.5

    return {
        f"{prefix}.input_layernorm.weight": torch.ones(HIDDEN),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(HIDDEN),
        f"{prefix}.self_attn.q_proj.weight": w(HIDDEN, qkv_in),
        f"{prefix}.self_attn.k_proj.weight": w(HIDDEN, qkv_in),
        f"{prefix}.self_attn.v_proj.weight": w(HIDDEN, qkv_in),
        f"{prefix}.self_attn.o_proj.weight": w(HIDDEN, HIDDEN),
        f"{prefix}.mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE),
    }


def _save(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    return directory


def build(root: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write ``target``, ``draft_model``, ``eagle`` and ``eagle3`` checkpoints under ``root``; return their dirs.

    The target's embedding and head are large enough (V=1024) that a compact head is a real saving;
    its layers are random but not tiny, so greedy outputs vary with the prompt.
    """
    root, g = Path(root), torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    head = torch.randn(VOCAB, HIDDEN, generator=g) * 2.0 / HIDDEN ** 0.5
    target = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(HIDDEN), "lm_head.weight": head}
    for i in range(TARGET_LAYERS):
        target |= _layer(f"model.layers.{i}", g)
    dirs = {"target": _save(root / "target", _llama_config(TARGET_LAYERS), target)}

    # draft_model: the target's first layer, embedding, norm and head (a layer-truncated self-drafter).
    draft = {k: v for k, v in target.items() if not k.startswith("model.layers.") or k.startswith("model.layers.0.")}
    dirs["draft_model"] = _save(root / "draft_model", _llama_config(1), draft)

    # eagle (EAGLE-1/2 layout): fc(cat(embed, feature)) -> one layer; embedding and head shared with the target.
    eagle = {"fc.weight": torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)], 1)} | _layer("layers.0", g)
    del eagle["layers.0.input_layernorm.weight"]  # vLLM's EAGLE layer 0 has none
    dirs["eagle"] = _save(root / "eagle", _llama_config(1), eagle)

    # eagle3: fc over 3 aux target layers, a layer whose attention reads cat(embed, hidden), its own draft head
    # over DRAFT_VOCAB tokens mapped to target ids by d2t (target id = draft id + d2t[draft id]).
    draft_to_target = torch.sort(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]).values
    eagle3 = {
        "fc.weight": torch.randn(HIDDEN, 3 * HIDDEN, generator=g) / (3 * HIDDEN) ** 0.5,
        "midlayer.hidden_norm.weight": torch.ones(HIDDEN), "norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": head[draft_to_target].clone(),
        "d2t": draft_to_target - torch.arange(DRAFT_VOCAB),
        "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, draft_to_target, True),
    } | _layer("midlayer", g, qkv_in=2 * HIDDEN)
    config3 = _llama_config(1, draft_vocab_size=DRAFT_VOCAB,
                            eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    config3["architectures"] = ["LlamaForCausalLMEagle3"]
    dirs["eagle3"] = _save(root / "eagle3", config3, eagle3)
    return dirs


if __name__ == "__main__":
    import sys

    print(build(sys.argv[1]))


def _qwen_config(model_type: str, architectures: list[str], layers: int, **extra) -> dict:
    return _llama_config(layers, **extra) | {"model_type": model_type, "architectures": architectures}


def build_mtp(root: str | Path, seed: int = 0) -> dict[str, Path]:
    """``mimo``: a MiMo target (Qwen2 layers, ``architectures: ["MiMoForCausalLM"]``) with one MTP layer under
    ``model.mtp_layers.0.*``, the layout vLLM's ``mtp`` method reads from the target's own checkpoint (the MTP layer
    shares the target's embedding and head). ``dflash``: a one-layer DFlash drafter (``DFlashDraftModel``, Qwen3
    attention with q/k norms) over the target of :func:`build` (aux layers 0, 1, 2), with no head of its own: vLLM
    shares the target's."""
    root, g = Path(root), torch.Generator().manual_seed(seed + 1)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    head = torch.randn(VOCAB, HIDDEN, generator=g) * 2.0 / HIDDEN ** 0.5

    def qwen2_layer(prefix):
        layer = _layer(prefix, g)
        for p in ("q", "k", "v"):  # Qwen2's attention has q/k/v biases
            layer[f"{prefix}.self_attn.{p}_proj.bias"] = torch.randn(HIDDEN, generator=g) * 0.1
        return layer

    mimo = {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(HIDDEN), "lm_head.weight": head}
    for i in range(TARGET_LAYERS):
        mimo |= qwen2_layer(f"model.layers.{i}")
    mtp = "model.mtp_layers.0"
    mimo |= qwen2_layer(mtp) | {
        f"{mtp}.token_layernorm.weight": torch.ones(HIDDEN), f"{mtp}.hidden_layernorm.weight": torch.ones(HIDDEN),
        f"{mtp}.final_layernorm.weight": torch.ones(HIDDEN),
        f"{mtp}.input_proj.weight": torch.randn(HIDDEN, 2 * HIDDEN, generator=g) / (2 * HIDDEN) ** 0.5,
    }
    dirs = {"mimo": _save(root / "mimo", _qwen_config("qwen2", ["MiMoForCausalLM"], TARGET_LAYERS,
                                                      num_nextn_predict_layers=1), mimo)}

    layer = _layer("layers.0", g) | {"layers.0.self_attn.q_norm.weight": torch.ones(HIDDEN // HEADS),
                                     "layers.0.self_attn.k_norm.weight": torch.ones(HIDDEN // HEADS)}
    dflash = {"fc.weight": torch.randn(HIDDEN, 3 * HIDDEN, generator=g) / (3 * HIDDEN) ** 0.5,
              "hidden_norm.weight": torch.ones(HIDDEN), "norm.weight": torch.ones(HIDDEN)} | layer
    config = _qwen_config("qwen3", ["DFlashDraftModel"], 1, dflash_config={
        "mask_token_id": VOCAB - 1, "target_layer_ids": [0, 1, 2]})
    dirs["dflash"] = _save(root / "dflash", config, dflash)
    return dirs


def build_deepseek_mtp(root: str | Path, seed: int = 0) -> Path:
    """A DeepSeek-V3 target with one MTP layer (``model.layers.{L}.*``: ``enorm``, ``hnorm``, ``eh_proj``, a decoder
    block and ``shared_head.{norm,head}``), the layout vLLM's ``deepseek_mtp`` reads from the target's checkpoint.
    Written with transformers' ``DeepseekV3ForCausalLM`` built one layer deeper (that layer's block is the MTP
    block). MLA sizes as vLLM's CPU MLA decode kernel needs (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 = 576);
    dense MLPs (``first_k_dense_replace`` past every layer). ``shared_head.norm`` is not the identity, so a head
    that skipped it would fail the first-call check."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    root, layers = Path(root) / "deepseek_mtp", 2
    config = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, moe_intermediate_size=32,
                  num_hidden_layers=layers + 1, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                  q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=100,
                  n_group=1, topk_group=1, max_position_embeddings=512, rope_scaling=None, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    tensors = {k: v.contiguous() for k, v in DeepseekV3ForCausalLM(DeepseekV3Config(**config)).state_dict().items()}
    g = torch.Generator().manual_seed(seed + 3)
    mtp = f"model.layers.{layers}"
    tensors |= {f"{mtp}.enorm.weight": torch.ones(HIDDEN), f"{mtp}.hnorm.weight": torch.ones(HIDDEN),
                f"{mtp}.eh_proj.weight": torch.randn(HIDDEN, 2 * HIDDEN, generator=g) / (2 * HIDDEN) ** 0.5,
                f"{mtp}.shared_head.norm.weight": 1.0 + torch.rand(HIDDEN, generator=g),
                f"{mtp}.shared_head.head.weight": tensors["lm_head.weight"].clone()}
    saved = json.loads(DeepseekV3Config(**config).to_json_string()) | {
        "num_hidden_layers": layers, "num_nextn_predict_layers": 1, "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3", "torch_dtype": "float32"}
    return _save(root, saved, tensors)
