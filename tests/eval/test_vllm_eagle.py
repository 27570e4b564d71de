"""The vLLM EAGLE layout (EagleConfig.layout="vllm") and its export (nanospec_fx/eval/vllm_eagle.py), without vLLM.

The oracle for the exported names and math: transformers' own one-layer ``LlamaModel`` loaded from the exported
``layers.0.*`` tensors (with vLLM's EAGLE changes: no input norm, no final norm) over ``fc(cat(embed, norm(f)))``.
vLLM itself runs the export in tests/integrations/test_vllm.py.
"""
import json

import pytest
import torch
from click.testing import CliRunner

from nanospec_fx.eagle import EagleConfig, EagleDrafter, KVCache, feed
from nanospec_fx.eval import cli, loaders
from nanospec_fx.eval import train_eagle as T
from nanospec_fx.eval.vllm_eagle import STATIC_LIST, WEIGHTS, check_target, export_vllm_eagle

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

V, H = 128, 64


def tiny_target():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=32, rope_theta=500.0,
                                   rms_norm_eps=1e-5, max_position_embeddings=300)
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        target.model.norm.weight.uniform_(0.5, 1.5)  # a norm that is not the identity
    return target


def random_vllm_drafter(target):
    drafter = T.new_drafter(target, seed=1, layout="vllm")
    with torch.no_grad():
        for p in drafter.layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
        drafter.fc.weight.add_(0.1 * torch.randn_like(drafter.fc.weight))
    return drafter.eval()


def hf_eagle_hidden(export_dir, target, ids, features):
    """vLLM's EAGLE-1 Llama math with transformers' layer: h = layer(fc(cat(embed(x), norm(f)))), no input norm."""
    config = json.loads((export_dir / "config.json").read_text())
    tensors = safetensors.load_file(str(export_dir / WEIGHTS))
    cfg = transformers.LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    model = transformers.LlamaModel(cfg).eval()
    state = {k: v for k, v in tensors.items() if k.startswith("layers.")}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) == {"embed_tokens.weight", "norm.weight", "layers.0.input_layernorm.weight"}
    model.layers[0].input_layernorm = torch.nn.Identity()
    model.norm = torch.nn.Identity()
    x = torch.cat([target.model.embed_tokens(ids), target.model.norm(features)], -1) @ tensors["fc.weight"].T
    return model(inputs_embeds=x).last_hidden_state


def test_vllm_layout_is_vllms_eagle_and_the_export_holds_it(tmp_path):
    target = tiny_target()
    drafter = random_vllm_drafter(target)
    assert drafter.fc.bias is None and isinstance(drafter.layer.attn_norm, torch.nn.Identity)
    out = export_vllm_eagle(drafter, tmp_path / "eagle", max_position_embeddings=300)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["EagleLlamaForCausalLM"] and config["num_hidden_layers"] == 1
    assert (config["head_dim"], config["rope_theta"], config["rms_norm_eps"]) == (32, 500.0, 1e-5)
    names = set(safetensors.load_file(str(out / WEIGHTS)))
    assert "fc.weight" in names and not any("embed" in n or "lm_head" in n or "norm.weight" == n for n in names)

    ids = torch.randint(0, V, (1, 12))
    features = 3 * torch.randn(1, 12, H)  # the target's final-norm inputs
    want_h = hf_eagle_hidden(out, target, ids, features)
    cache = KVCache(drafter.config, 16)
    slots = torch.arange(12)
    logits, h = drafter(ids, drafter.target_features(features), slots[None], slots,
                        torch.arange(16) <= slots[:, None], cache.k, cache.v)
    torch.testing.assert_close(h, want_h, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, target.lm_head(want_h), rtol=1e-4, atol=1e-4)  # head(h), no norm
    # feed() hands the drafter the target's features normed, as vLLM does
    root_logits, _ = feed(drafter, KVCache(drafter.config, 16), ids[0], features[0], 0)
    torch.testing.assert_close(root_logits, logits[0, -1], rtol=1e-5, atol=1e-5)


def test_export_refuses_what_vllm_would_compute_differently(tmp_path):
    target = tiny_target()
    with pytest.raises(ValueError, match="'nanospec' layout.*--vllm-out"):
        export_vllm_eagle(T.new_drafter(target), tmp_path, 300)
    check_target(target)
    gemma = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=V, hidden_size=H, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32))
    with pytest.raises(ValueError, match="Llama targets only.*gemma3"):
        check_target(gemma)
    with pytest.raises(ValueError, match="layout"):
        EagleConfig(vocab_size=V, hidden_size=H, intermediate_size=96, num_heads=2, num_kv_heads=1, layout="eagle3")


def test_nanospec_layout_unchanged_by_the_option():
    config = EagleConfig(vocab_size=V, hidden_size=H, intermediate_size=96, num_heads=2, num_kv_heads=1)
    drafter = EagleDrafter(config, norm=torch.nn.RMSNorm(H))
    assert drafter.fc.bias is not None and isinstance(drafter.layer.attn_norm, torch.nn.RMSNorm)
    f = torch.randn(2, H)
    assert drafter.target_features(f) is f
    torch.testing.assert_close(drafter.head_input(f), drafter.norm(f))


def test_train_eagle_vllm_out(tmp_path, monkeypatch):
    model = tmp_path / "model"
    target = tiny_target()
    target.config.tie_word_embeddings = True
    target.save_pretrained(model)
    monkeypatch.setattr(loaders, "CACHE", tmp_path / "cache")
    result = CliRunner().invoke(cli.main, [
        "train-eagle", "--model", str(model), "--tokenizer", "bytes", "--corpus", "sample", "--tokens", "1024",
        "--window", "64", "--val-tokens", "256", "--steps", "3", "--threads", "1", "--vllm-out", str(tmp_path / "v")],
        catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "vLLM's EAGLE layout" in result.output
    folder = tmp_path / "cache" / "eagle" / "model"
    assert not (folder / T.WEIGHTS).exists()  # the default drafter's checkpoint is untouched
    saved = T.load_drafter(transformers.LlamaForCausalLM.from_pretrained(model), folder / "vllm-layout")
    assert saved.config.layout == "vllm"
    exported = safetensors.load_file(str(tmp_path / "v" / WEIGHTS))
    torch.testing.assert_close(exported["fc.weight"], saved.fc.weight)
    torch.testing.assert_close(exported["layers.0.mlp.down_proj.weight"], saved.layer.down_proj.weight)
    ranked = [int(t) for t in (tmp_path / "v" / STATIC_LIST).read_text().split()]  # FR-Spec's list
    assert sorted(ranked) == list(range(V)) and ranked[0] != 0


def test_vllm_layout_trains(tmp_path):
    """train() and validate() in vLLM's layout: the drafter reads and regresses normed features and learns."""
    target = tiny_target()
    g = torch.Generator().manual_seed(0)
    motifs = torch.randint(0, V, (4, 8), generator=g)  # repetitive text: learnable in a few steps
    stream = (motifs[torch.randint(0, 4, (8,), generator=g)].flatten().tolist() for _ in range(24))
    T.extract_features(target, stream, tmp_path, tokens=24 * 64, window=64, windows_per_shard=4)
    ids, feats = T.load_shards(tmp_path, 1)
    val_ids, val_feats = T.load_shards(tmp_path, 0, 1)
    drafter = T.new_drafter(target, seed=0, layout="vllm")
    before = T.validate(drafter, val_ids, val_feats)["top1_agreement"]
    frequent = torch.argsort(-torch.bincount(ids.flatten(), minlength=V))[:32]
    cfg = T.TrainConfig(steps=60, minutes=5, batch=4, lr=3e-3, warmup=5, random_negatives=32)
    log = T.train(drafter, ids, feats, cfg, frequent)
    assert log.history[-1]["reg"] < log.history[0]["reg"] and log.history[-1]["kl"] < log.history[0]["kl"]
    assert T.validate(drafter, val_ids, val_feats)["top1_agreement"] > max(before, 0.3)
    assert drafter.fc.bias is None and isinstance(drafter.layer.attn_norm, torch.nn.Identity)
