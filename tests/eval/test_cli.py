"""The ``nanospec-fx`` verbs end to end on tiny random models and the bundled text sample (seconds)."""
import json

import pytest
import torch
from click.testing import CliRunner

from nanospec_fx.eval import cli, loaders
from nanospec_fx.eval.bench import draft as D
from nanospec_fx.eval.bench import e2e as E2E
from helpers import tiny_llama


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A 3-layer random Llama over the 256 byte ids (the ``bytes`` tokenizer), saved as a HF directory."""
    model = tiny_llama(256, 3, 0, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Model outputs are cached on disk: give each test its own cache so nothing stale is reused."""
    monkeypatch.setattr(loaders, "CACHE", tmp_path / "cache")


def run(*args):
    result = CliRunner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def rows_of(path):
    return json.loads(path.read_text())["rows"]


def test_coverage_inputs_only(tmp_path):
    run("coverage", "--tokenizer", "bytes", "--corpus", "sample[1:]",
        "--static-corpus", "sample[:1]",  # disjoint records
        "--static-sizes", "16,64", "--capacities", "32,0", "--cores", "16", "--capacity", "64", "--out", tmp_path)
    rows = {(r["category"], r["policy"]): r for r in rows_of(tmp_path / "coverage.json")}
    assert {"conversation", "code", "literature", "all"} <= {c for c, _ in rows}
    assert rows[("all", "full")]["coverage"] == 1.0 and rows[("all", "full")]["mean_size"] == 256
    assert rows[("all", "static-64")]["mean_size"] == 64
    # a larger static table and an unbounded context set cover at least as much
    assert rows[("all", "static-64")]["coverage"] >= rows[("all", "static-16")]["coverage"]
    assert rows[("all", "context@inf")]["coverage"] >= rows[("all", "context@32")]["coverage"]
    assert rows[("all", "context@32")]["p95_size"] <= 32
    # English text in bytes: most next bytes were already seen
    assert 0.5 < rows[("all", "context@inf")]["coverage"] < 1.0
    assert (tmp_path / "coverage.csv").exists() and (tmp_path / "coverage.png").stat().st_size > 1000


def test_coverage_with_target_topk(tmp_path, tiny_model_dir):
    run("coverage", "--tokenizer", "bytes", "--model", tiny_model_dir, "--corpus", "sample[:4]", "--static-corpus",
        "sample", "--static-sizes", "32", "--capacities", "0", "--cores", "16", "--capacity", "64",
        "--compare-no-prompt-topk", "--out", tmp_path)
    data = json.loads((tmp_path / "coverage.json").read_text())
    rows = {(r["category"], r["policy"]): r for r in data["rows"]}
    assert data["meta"]["topk"] == 3
    # unbounded: adding the target's guesses only adds tokens, so coverage cannot drop
    assert rows[("all", "context+top3@inf")]["coverage"] >= rows[("all", "context@inf")]["coverage"]
    assert rows[("all", "context+top3@inf")]["mean_size"] >= rows[("all", "context@inf")]["mean_size"]
    # without the guesses at prompt positions (the vLLM plugin): in between, set by set
    noprompt = rows[("all", "context+top3-noprompt@inf")]
    for key in ("coverage", "mean_size"):
        assert rows[("all", "context@inf")][key] <= noprompt[key] <= rows[("all", "context+top3@inf")][key]
    assert noprompt["mean_size"] < rows[("all", "context+top3@inf")]["mean_size"]
    assert ("all", "hybrid+top3-16@64") in rows


def test_bench_head(tmp_path):
    run("bench", "head", "--shapes", "32x2000", "--active", "64", "--static-n", "256", "--repeats", "2",
        "--sweep", "32,128", "--no-inductor", "--out", tmp_path, "--threads", "1")
    rows = rows_of(tmp_path / "bench-head.json")
    variants = {r["variant"] for r in rows}
    assert variants == {"dense", "static-256", "nanospec-ops compact", "nanospec-ops +scatter", "nanospec-compiled"}
    assert {r["rows"] for r in rows} == {1, 10}
    for r in rows:
        assert r["ms"] > 0 and r["limit"] == pytest.approx(2000 / r["size"])
    assert sorted(r["size"] for r in rows if r["variant"] == "nanospec-ops compact") == [32, 32, 64, 64, 128, 128]
    assert (tmp_path / "bench-head.png").exists()


def test_bench_draft(tmp_path):
    run("bench", "draft", "--shape", "tiny", "--active", "64", "--static-n", "128", "--prefix", "8", "--repeats", "1",
        "--no-inductor", "--out", tmp_path, "--threads", "1")
    rows = rows_of(tmp_path / "bench-draft.json")
    assert [r["variant"] for r in rows] == ["full", "static-128", "nanospec-ops +scatter", "nanospec-compiled"]
    assert rows[0]["vs_full"] == 0 and all(0 < r["head_share"] < 1 for r in rows)


def test_draft_round_is_eagles_tree_with_each_head():
    """The benchmark drafts with nanospec_fx.eagle's tree; a nanospec head drafts active tokens only, and with
    every token active it drafts the full head's tree."""
    config = D.DRAFTER_SHAPES["tiny"]()
    config.vocab_size = 96
    body = D.random_drafter(config)
    weight = torch.randn(96, config.hidden_size) / config.hidden_size**0.5
    feature = torch.randn(config.hidden_size)
    depth, topk, prefix = 3, 4, 8

    def tree(head):
        cache = body.new_cache(prefix + 1 + (depth - 1) * topk)
        torch.manual_seed(1)
        cache.k[:, :, :prefix].normal_()
        cache.v[:, :, :prefix].normal_()
        with torch.inference_mode():
            return D.draft_round(D.TimedHead(body, head), cache, prefix, 5, feature, depth, topk)

    partial = D.head_variants(weight, active=20, static_n=40, compiled=False)
    state = D.filled_state(weight, 20)  # the same random ids as the heads' state
    small = tree(partial["nanospec-ops +scatter"])
    assert len(small.tokens) == topk + (depth - 1) * topk * topk
    assert state.contains(small.tokens).all()
    assert all(p < i and (p == -1) == (i < topk) for i, p in enumerate(small.parents.tolist()))
    every = D.head_variants(weight, active=96, static_n=96, compiled=False)
    full, nano = tree(every["full"]), tree(every["nanospec-ops +scatter"])
    assert torch.equal(full.tokens, nano.tokens) and torch.equal(full.parents, nano.parents)
    torch.testing.assert_close(full.scores, nano.scores)


@pytest.mark.slow
def test_e2e_output_is_the_targets(tmp_path, tiny_model_dir):
    run("e2e", "--model", tiny_model_dir, "--tokenizer", "bytes", "--corpus", "sample[:2]", "--static-corpus", "sample",
        "--static-n", "64", "--capacity", "64", "--max-new", "12", "--draft-layers", "1", "--out", tmp_path,
        "--threads", "1")
    rows = rows_of(tmp_path / "e2e.json")
    assert [r["variant"] for r in rows] == ["target only", "full head", "static-64", "nanospec@64"]
    assert all(r["identical"] for r in rows)
    assert all(r["tokens"] == 24 for r in rows)
    nano = rows[-1]
    assert 0 < nano["active_size"] <= 64 and nano["rounds"] >= 2
    # the full and static heads share the head weight, but keep no active set of their own: no |A| for them
    assert all(r["active_size"] != r["active_size"] for r in rows[:-1])
    data = json.loads((tmp_path / "e2e.json").read_text())
    assert len(data["requests"]) == 4 * 2 and all(r["identical"] and r["seconds"] > 0 for r in data["requests"])
    (static,) = data["meta"]["static_table"].values()
    assert static["records_dropped_as_requests"] == 2  # sample[:2] are the requests
    assert data["meta"]["provenance"]["threads"] == 1
    assert (tmp_path / "e2e.png").exists()


def test_truncated_drafter_shares_the_targets_tensors(tiny_model_dir):
    target = loaders.load_model(str(tiny_model_dir))
    drafter = E2E.truncated_drafter(target, 2)
    assert len(drafter.model.layers) == 2 and drafter.lm_head.weight is target.lm_head.weight
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert all(p.data_ptr() in target_ptrs for p in drafter.parameters())
    table = torch.tensor([3, 7, 9])
    head = E2E.StaticHead(target.lm_head.weight, table)
    h = torch.randn(2, target.config.hidden_size)
    out = head(h)
    assert torch.isinf(out).sum() == 2 * (256 - 3)
    torch.testing.assert_close(out[:, table], target.lm_head(h)[:, table])


def test_corpus_files_and_slices(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"prompt": "a", "completion": "b", "category": "x"}\n{"text": "hello world"}\n')
    s = loaders.load_corpus(f"{p}[1:]")
    assert len(s) == 1 and (s[0].prompt, s[0].continuation, s[0].category) == ("hello", " world", "c")
    q = tmp_path / "d.json"
    q.write_text(json.dumps([{"prompt": "p", "answer": "q"}]))
    assert loaders.read_corpus(q, category="qa")[0].category == "qa"
    assert len(loaders.load_corpus("sample[:3]")) == 3


def test_long_code_files_are_prefixes_of_the_installed_torchs_sources():
    samples = loaders.load_corpus("code-files")
    assert len(samples) >= 4 and {s.category for s in samples} == {"long code"}
    for s in samples[:3]:
        name = s.record.rsplit("/", 1)[1]
        text = (loaders.Path(torch.__file__).parent / "nn" / "modules" / name).read_text(encoding="utf-8")
        assert len(s.prompt) == 10_000 and text.startswith(s.prompt + s.continuation)
        assert s.record.startswith(f"torch-{torch.__version__.split('+')[0]}:")
    assert len(loaders.load_corpus("code-files[:2]")) == 2


def test_missing_assets_say_how_to_install():
    with pytest.raises(loaders.MissingAsset, match="pip install some-pkg"):
        loaders._require("surely_not_an_installed_module", "pip install some-pkg")
    result = CliRunner().invoke(cli.main, ["coverage", "--tokenizer", "bytes", "--corpus", "no-such-corpus"])
    assert result.exit_code == 2 and "unknown corpus" in result.output


def test_coverage_on_the_targets_greedy_continuations(tmp_path, tiny_model_dir):
    run("coverage", "--tokenizer", "bytes", "--model", tiny_model_dir, "--continuation", "greedy", "--max-new", "10",
        "--corpus", "sample[:3]", "--static-corpus", "sample", "--static-sizes", "32", "--capacities", "0",
        "--cores", "16", "--capacity", "64", "--out", tmp_path, "--name", "greedy")
    data = json.loads((tmp_path / "greedy.json").read_text())
    assert data["meta"]["continuation"] == "greedy"
    rows = {(r["category"], r["policy"]): r for r in data["rows"]}
    assert rows[("all", "full")]["tokens"] == 3 * 10  # the tiny model has no EOS: exactly --max-new each
    # unbounded, the target's guesses only add tokens
    assert rows[("all", "context+top3@inf")]["coverage"] >= rows[("all", "context@inf")]["coverage"]


@pytest.mark.slow
def test_e2e_through_speculative_pair(tmp_path, tiny_model_dir):
    run("e2e", "--model", tiny_model_dir, "--tokenizer", "bytes", "--corpus", "sample[5:7]",
        "--static-corpus", "sample", "--static-n", "64", "--capacity", "64", "--max-new", "10", "--draft-layers", "1",
        "--observer", "api", "--out", tmp_path, "--threads", "1")
    data = json.loads((tmp_path / "e2e.json").read_text())
    assert data["meta"]["observer"] == "api"
    assert all(r["identical"] for r in data["rows"])
    assert 0 < data["rows"][-1]["active_size"] <= 64


def test_explain_on_a_local_model_directory(tiny_model_dir):
    out = run("explain", "--model", tiny_model_dir, "--capacity", "64", "--prompt-tokens", "5").output
    assert "head model.embed_tokens.weight" in out and "V=256, H=32" in out  # tied head
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(0))
    assert f"active vocabulary: {ids.unique().numel()} / 64 slots" in out
    assert "predicted model.embed_tokens.weight speedup with 64 active tokens" in out
    assert "fitted on the project's 2-core test machine" in out
    calibrated = run("explain", "--model", tiny_model_dir, "--capacity", "64", "--prompt-tokens", "5",
                     "--calibrate").output
    assert "cost model: constants measured on this machine" in calibrated


def test_explain_missing_model_is_a_clear_error():
    result = CliRunner().invoke(cli.main, ["explain", "--model", "no-such-model"])
    assert result.exit_code == 2 and "unknown model" in result.output
