"""generate(use_mtp=True) with nanospec_fx.mtp.mtp_pair: compact MTP drafting, output equal to plain greedy."""
from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.modeling_layers import MtpModel  # noqa: E402

from nanospec_fx.mtp import mtp_detach, mtp_pair  # noqa: E402

V = 500


def checkpoint(path, kind):
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=2,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                  num_mtp_layers=1, max_position_embeddings=128, pad_token_id=0, bos_token_id=None,
                  eos_token_id=None, initializer_range=0.2, dtype="float32")
    if kind == "deepseek_v3":
        config = transformers.DeepseekV3Config(num_hidden_layers=61, first_k_dense_replace=61, num_key_value_heads=2,
                                               q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                               v_head_dim=8, **common)
        model = transformers.DeepseekV3ForCausalLM(config)
    else:
        config = transformers.Glm4MoeConfig(num_hidden_layers=46, first_k_dense_replace=46, num_key_value_heads=1,
                                            head_dim=16, **common)
        model = transformers.Glm4MoeForCausalLM(config)
    model.save_pretrained(path)
    mtp = MtpModel(model, 1)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    n = config.num_hidden_layers
    for key, value in mtp.state_dict().items():
        if not key.startswith(("shared_head", "embed_tokens")):
            torch.nn.init.normal_(value, std=0.2) if value.dim() > 1 else None
            tensors[key.replace("layers.0.mtp_block.", "layers.0.").replace("layers.0.", f"model.layers.{n}.")] = \
                value.contiguous()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_mtp_pair_drafts_compact_and_keeps_greedy_output(kind, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch._dynamo.reset()
        target = transformers.AutoModelForCausalLM.from_pretrained(checkpoint(tmp_path / kind, kind)).eval()
        ids = torch.randint(1, V, (1, 8), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            plain = target.generate(ids, max_new_tokens=10, do_sample=False)
            mtp_dense = target.generate(ids, max_new_tokens=10, do_sample=False, use_mtp=True)
        state = mtp_pair(target, capacity=64, inductor=False)
        drafts = []
        original = transformers.generation.candidate_generator.MTPCandidateGenerator.get_candidates

        def spy(self, *a, **k):
            out = original(self, *a, **k)
            if out[1] is not None:
                drafts.append((out[1].clone(), state.token_ids().clone()))
            return out

        transformers.generation.candidate_generator.MTPCandidateGenerator.get_candidates = spy
        try:
            with torch.inference_mode():
                first = target.generate(ids, max_new_tokens=10, do_sample=False, use_mtp=True)
                size = len(state)
                second = target.generate(ids[:, :5], max_new_tokens=6, do_sample=False, use_mtp=True)
        finally:
            transformers.generation.candidate_generator.MTPCandidateGenerator.get_candidates = original
        assert torch.equal(first, plain) and torch.equal(mtp_dense, plain)
        with torch.inference_mode():
            assert torch.equal(second, target.generate(ids[:, :5], max_new_tokens=6, do_sample=False))
        assert drafts, "the MTP layers drafted"
        for logits, active in drafts:
            finite = torch.isfinite(logits[0, 0])
            assert 0 < int(finite.sum()) <= 64 < V, "the drafting head is compact"
            assert set(finite.nonzero().flatten().tolist()) <= set(active.tolist())
        assert 0 < len(state) <= size, "the second request started from a reset set"
        mtp_detach(target)
        assert "_get_candidate_generator" not in vars(target)
    finally:
        torch.set_num_threads(threads)


def test_mtp_pair_with_two_mtp_layers_handed_in_keeps_greedy_output():
    """Depth 2: DeepSeek-V3's load pattern matches one MTP layer index, so the two layers are passed as mtp=."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch._dynamo.reset()
        torch.manual_seed(1)
        config = transformers.DeepseekV3Config(
            vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=2,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, num_mtp_layers=2,
            max_position_embeddings=128, pad_token_id=0, bos_token_id=None, eos_token_id=None, initializer_range=0.2,
            dtype="float32", num_hidden_layers=2, first_k_dense_replace=2, num_key_value_heads=2, q_lora_rank=16,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
        target = transformers.DeepseekV3ForCausalLM(config).eval()
        layers = MtpModel(target, 2).eval()
        ids = torch.randint(1, V, (1, 8), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            plain = target.generate(ids, max_new_tokens=10, do_sample=False)
        state = mtp_pair(target, mtp=layers, capacity=64, inductor=False)
        with torch.inference_mode():
            out = target.generate(ids, max_new_tokens=10, do_sample=False, use_mtp=True)
        assert torch.equal(out, plain)
        assert 0 < len(state) <= 64
        mtp_detach(target)
    finally:
        torch.set_num_threads(threads)
