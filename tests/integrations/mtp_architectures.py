"""Tiny models of every architecture whose MTP layers transformers' ``generate(use_mtp=True)`` drives, built in the
test (random weights, nothing from a hub), and checkpoints of them with their MTP layers' tensors stored under the
names ``MtpModel.from_pretrained`` loads (docs/mtp.md; /work/shared/design.md section 7).

Checked on transformers 5.25 (``num_mtp_layers`` in the text config and MTP load patterns on the causal-LM class):
DeepSeek-V3 (also SarvamMLA's class), GLM-4-MoE (also Sarvam-MoE's and Param2-MoE's), Ernie-4.5-MoE, Mellum. Others
name MTP layers that transformers 5.25 cannot build: Bailing-hybrid's config has ``layer_types`` and no
``mtp_layer_types`` (``get_mtp_config`` raises), MiMo-V2-Flash drops ``num_mtp_layers``, Qwen3.5 has none (its
checkpoints' ``mtp.*`` tensors are ignored at load); Inkling and Step-3.7 are multimodal (their MTP text layers are
DeepSeek/GLM-style blocks).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

transformers = __import__("transformers")
from transformers.modeling_layers import MtpModel  # noqa: E402

COMMON = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, max_position_embeddings=128,
              pad_token_id=0, bos_token_id=None, eos_token_id=None, initializer_range=0.2, dtype="float32")
MOE = dict(moe_intermediate_size=16, num_experts_per_tok=2)
MLA = dict(num_key_value_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=8)
GROUPS = dict(n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1)


def config(kind: str, vocab_size: int, depth: int, tied: bool, checkpoint: bool):
    """A tiny config of ``kind`` with ``depth`` MTP layers. ``checkpoint``: as many decoder layers as the class's
    load pattern names the first MTP layer's index after (DeepSeek-V3: 61, GLM-4-MoE: 46; thin dense layers)."""
    common = dict(COMMON, vocab_size=vocab_size, tie_word_embeddings=tied, num_mtp_layers=depth, **MOE)
    if kind == "deepseek_v3":
        layers = 61 if checkpoint else 2
        return transformers.DeepseekV3Config(num_hidden_layers=layers, first_k_dense_replace=layers - 1, **MLA,
                                             **GROUPS, **common)
    if kind == "glm4_moe":
        layers = 46 if checkpoint else 2
        return transformers.Glm4MoeConfig(num_hidden_layers=layers, first_k_dense_replace=layers - 1,
                                          num_key_value_heads=1, head_dim=16, **GROUPS, **common)
    if kind == "ernie4_5_moe":
        return transformers.Ernie4_5_MoeConfig(num_hidden_layers=1, num_key_value_heads=1, moe_num_experts=4,
                                               moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=0,
                                               **{k: v for k, v in common.items() if k != "num_experts_per_tok"})
    if kind == "mellum":
        return transformers.MellumConfig(num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"],
                                         num_key_value_heads=1, num_experts=4, head_dim=16, sliding_window=16,
                                         **common)
    raise ValueError(f"unknown kind {kind!r}")


def model(kind: str, vocab_size: int, depth: int = 1, tied: bool = False, checkpoint: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config(kind, vocab_size, depth, tied, checkpoint)).eval()


def mtp_layers(target, depth: int, seed: int = 1) -> MtpModel:
    """``MtpModel(target, depth)`` with every weight of its own drawn (transformers 5.25 leaves a fresh MtpModel's
    MoE experts uninitialised, torch.empty), the target's embedding and head shared."""
    torch.manual_seed(seed)
    layers = MtpModel(target, depth).eval()
    with torch.no_grad():
        for name, value in layers.named_parameters():
            if not name.startswith(("shared_head", "embed_tokens")) and value.dim() > 1:
                torch.nn.init.normal_(value, std=0.2)
    return layers


def checkpoint(path: Path, kind: str, vocab_size: int, depth: int = 1, tied: bool = False) -> tuple[Path, dict]:
    """Save a tiny ``kind`` model to ``path`` with its MTP layers' tensors added under a name the class's MTP load
    pattern matches (``model.layers.{num_hidden_layers + k}.*`` or ``mtp.*`` / ``model.mtp.*``); returns the path and
    ``{MtpModel state-dict key: the tensor written}``, to check that ``from_pretrained`` loaded them."""
    from safetensors.torch import load_file, save_file

    target = model(kind, vocab_size, depth, tied, checkpoint=True)
    target.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    pattern = MtpModel.get_mtp_weights_regex(target)
    n = target.config.get_text_config().num_hidden_layers
    written = {}
    for key, value in mtp_layers(target, depth).state_dict().items():
        if key.startswith(("shared_head", "embed_tokens")):  # the target's own
            continue
        layer = re.match(r"layers\.(\d+)\.(?:mtp_block\.)?(.*)", key)
        names = [f"model.layers.{n + int(layer[1])}.{layer[2]}"] * bool(layer) + [f"mtp.{key}", f"model.mtp.{key}"]
        name = next(name for name in names if pattern.search(name))
        tensors[name] = written[key] = value.contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path, written
