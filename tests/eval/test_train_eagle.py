"""EAGLE training (nanospec_fx/eval/train_eagle.py) and its two verbs, on tiny random models (seconds).

The CI configuration of the whole path: a few thousand tokens of features, a few training steps, a
short lossless run of ``e2e --drafter eagle``.
"""
import json

import pytest
import torch
from click.testing import CliRunner

from nanospec_fx.eval import cli, loaders
from nanospec_fx.eval import train_eagle as T
from nanospec_fx.eagle.speculative import final_norm

transformers = pytest.importorskip("transformers")

V = 256


def tiny_target(layers: int = 1):
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval().requires_grad_(False)


def windows(n: int, window: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # repetitive text (a few motifs), so that a drafter can learn something in a few steps
    motifs = torch.randint(0, V, (4, 8), generator=g)
    for _ in range(n):
        yield motifs[torch.randint(0, 4, (window // 8,), generator=g)].flatten().tolist()


def test_features_are_the_final_norms_input_and_extraction_resumes(tmp_path):
    target = tiny_target()
    shards = T.extract_features(target, windows(8, 32), tmp_path, tokens=128, window=32, windows_per_shard=2)
    assert shards == 2
    first = (tmp_path / T.SHARD.format(0)).stat().st_mtime_ns
    shards = T.extract_features(target, windows(8, 32), tmp_path, tokens=256, window=32, windows_per_shard=2)
    assert shards == 4 and (tmp_path / T.SHARD.format(0)).stat().st_mtime_ns == first  # kept, not recomputed
    ids, feats = T.load_shards(tmp_path)
    assert ids.shape == (8, 32) and feats.shape == (8, 32, 32) and feats.dtype == torch.float16
    assert ids.tolist() == list(windows(8, 32))
    with torch.inference_mode():
        normed = target.model(input_ids=ids[:2]).last_hidden_state
    torch.testing.assert_close(final_norm(target)(feats[:2].float()), normed, rtol=2e-3, atol=2e-3)


def test_pack_windows_cuts_long_sequences():
    got = list(T.pack_windows([[1] * 10, [2] * 3, [3] * 5], window=4, max_per_sequence=6))
    assert got == [[1, 1, 1, 1], [1, 1, 2, 2], [2, 3, 3, 3]]  # 6 of the 10 ones; the last 2 threes wait for more


@pytest.mark.parametrize("layout", ["nanospec", "mtp"])
def test_training_learns_and_the_checkpoint_round_trips(tmp_path, layout):
    target = tiny_target()
    T.extract_features(target, windows(24, 64), tmp_path / "f", tokens=24 * 64, window=64, windows_per_shard=4)
    ids, feats = T.load_shards(tmp_path / "f", 1)
    val_ids, val_feats = T.load_shards(tmp_path / "f", 0, 1)
    drafter = T.new_drafter(target, seed=0, layout=layout)
    before = T.validate(drafter, val_ids, val_feats)["top1_agreement"]
    frequent = torch.argsort(-torch.bincount(ids.flatten(), minlength=V))[:32]
    cfg = T.TrainConfig(steps=60, minutes=5, batch=4, lr=3e-3, warmup=5, random_negatives=32, checkpoint_every=30)
    log = T.train(drafter, ids, feats, cfg, frequent, state_path=tmp_path / "state.pt")
    assert log.steps == 60 and (tmp_path / "state.pt").exists()
    first, last = log.history[0], log.history[-1]
    assert last["reg"] < first["reg"] and last["kl"] < first["kl"]
    after = T.validate(drafter, val_ids, val_feats, static_rows=frequent)
    assert after["top1_agreement"] > max(before, 0.3), (before, after)
    assert 0 <= after["top1_agreement_static"] <= 1 and after["positions"] == 4 * 63
    # only the drafter's own tensors are saved, and loading gives the same drafter
    T.save_drafter(drafter, tmp_path / "ckpt", {"note": "test"})
    saved = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(tmp_path / "ckpt" / T.WEIGHTS))
    own = {"nanospec": ("fc.", "layer."), "mtp": ("enorm.", "hnorm.", "fc.", "layer.")}[layout]
    assert all(k.startswith(own) for k in saved) and {k.split(".")[0] + "." for k in saved} == set(own)
    loaded = T.load_drafter(target, tmp_path / "ckpt")
    assert loaded.config.layout == layout
    assert loaded.lm_head is target.lm_head and loaded.norm is final_norm(target)
    assert T.validate(loaded, val_ids, val_feats)["top1_agreement"] == after["top1_agreement"]
    # resuming from the training state continues where it stopped
    log2 = T.train(T.new_drafter(target, seed=0, layout=layout), ids, feats, T.TrainConfig(**{**cfg.__dict__, "steps": 61}), frequent,
                   state_path=tmp_path / "state.pt")
    assert log2.steps == 61


def test_loading_a_missing_or_mismatched_drafter_says_why(tmp_path):
    target = tiny_target()
    with pytest.raises(FileNotFoundError, match="train-eagle"):
        T.load_drafter(target, tmp_path)
    T.save_drafter(T.new_drafter(target), tmp_path, {})
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=2 * V, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    with pytest.raises(ValueError, match="trained for V=256"):
        T.load_drafter(other, tmp_path)


@pytest.fixture
def tiny_model_dir(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def run(*args):
    result = CliRunner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_train_eagle_then_e2e_eagle_is_lossless(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setattr(loaders, "CACHE", tmp_path / "cache")
    out = run("train-eagle", "--model", tiny_model_dir, "--tokenizer", "bytes", "--corpus", "sample", "--tokens", 2048,
              "--window", 64, "--val-tokens", 256, "--steps", 4, "--threads", 1).output
    assert "held-out top-1 agreement" in out
    folder = tmp_path / "cache" / "eagle" / "model"
    meta = json.loads((folder / T.META).read_text())
    assert (
        meta["train"]["steps_done"] == 4
        and meta["val_tokens"] == 256
        and 0 <= meta["validation"]["top1_agreement"] <= 1
    )
    # the bundled sample was the training text: the evaluation refuses it ...
    result = CliRunner().invoke(cli.main, ["e2e", "--drafter", "eagle", "--model", str(tiny_model_dir),
                                           "--tokenizer", "bytes", "--corpus", "sample[:2]", "--static-corpus",
                                           "sample", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "training text" in result.output
    # ... and measures other requests
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps({"prompt": p, "continuation": "", "category": c}) for p, c in [
        ("the cat sat on the mat and the cat", "a"), ("def f(x):\n    return x + 1\n", "b")]))
    run("e2e", "--drafter", "eagle", "--model", tiny_model_dir, "--tokenizer", "bytes", "--corpus", requests,
        "--static-corpus", "sample", "--static-n", 64, "--capacity", 64, "--depth", 1, "--depth", 2,
        "--variants", "full,full-every-row,static,context,body", "--max-new", 10, "--out", tmp_path, "--threads", 1)
    result = json.loads((tmp_path / "e2e-eagle.json").read_text())
    rows = result["rows"]
    pooled = [r for r in rows if r["category"] == "all"]
    every, body = "full head, every fed row", "body alone (no head)"
    assert [(r["variant"], r["depth"]) for r in pooled] == [("target only", 0)] + [
        (v, d) for d in (1, 2) for v in ("full head", every, "static-64", "nanospec context@64", body)]
    assert all(r["identical"] and r["tokens"] == 20 for r in pooled)
    assert {r["category"] for r in rows} == {"a", "b", "all"}
    nano = [r for r in pooled if r["variant"].startswith("nanospec")]
    assert all(0 < r["active_size"] <= 64 for r in nano)
    assert all(r["active_size"] != r["active_size"] for r in pooled if not r["variant"].startswith("nanospec"))  # NaN
    # rows counted at the drafter's calls: a head scores one position per call (the last fed one, then each draft
    # step); the every-row baseline scores each fed position, i.e. as many as the body ran
    by = {(r["variant"], r["depth"]): r for r in pooled}
    for d in (1, 2):
        for v in ("full head", "static-64", "nanospec context@64", body):
            calls = [q for q in result["requests"] if (q["variant"], q["depth"]) == (v, d)]
            assert all(q["head_rows"] == q["rounds"] * d + 1 for q in calls), calls  # prefill + d per round
        assert by[(every, d)]["head_rows_per_round"] == by[(every, d)]["body_rows_per_round"]
        assert by[(every, d)]["head_rows_per_round"] > by[("full head", d)]["head_rows_per_round"]
    against = {(c["a"], c["b"], c["metric"]) for c in result["comparisons"]}
    assert ("nanospec context@64", body, "draft_ms_per_round") in against
    assert ("nanospec context@64", every, "tokens_per_s") in against
    assert (tmp_path / "e2e-eagle.png").exists()
