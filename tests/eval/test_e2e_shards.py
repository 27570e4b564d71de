"""A long `e2e --drafter eagle` run done in pieces: `--shard K/N` runs merged by `e2e-merge` are the whole run
(same requests, same variant order, ratios over all requests), and pieces of different runs are refused."""
import json
import shutil
import statistics

import pytest
from click.testing import CliRunner

from nanospec_fx.eval import cli

transformers = pytest.importorskip("transformers")

from tiny_eagle import train_tiny_pair  # noqa: E402

# What a decode produced (not how long it took): equal in a merged run and the whole run.
DECODED = ("model", "variant", "depth", "category", "request", "repeat", "order", "head", "setting", "identical",
           "new_tokens", "rounds", "accepted", "drafted", "active_size")


def invoke(*args, code=0) -> str:
    """The command's output with its line breaks folded (the terminal wraps long messages, e.g. at long paths)."""
    result = CliRunner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return " ".join(result.output.split())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A tiny Llama, an EAGLE drafter trained for 2 steps, 4 requests in 2 categories; the whole run and its two
    shards (``whole``, ``s0``, ``s1`` in the returned folder)."""
    root = tmp_path_factory.mktemp("shards")
    mp = train_tiny_pair(root, invoke)
    requests = root / "requests.jsonl"
    requests.write_text("\n".join(json.dumps({"prompt": p, "continuation": "", "category": c}) for p, c in [
        ("the cat sat on the mat and the cat", "prose"), ("one two three four five six", "prose"),
        ("def f(x):\n    return x + 1\n", "code"), ("for i in range(3):\n", "code")]))
    common = ("e2e", "--drafter", "eagle", "--model", root / "model", "--tokenizer", "bytes", "--corpus", requests,
              "--static-corpus", "sample", "--static-n", 64, "--capacity", 64, "--max-new", 8, "--out", root,
              "--threads", 1, "--depth", 1, "--variants", "full,static,context", "--repeats", 2)
    invoke(*common, "--name", "whole")
    for k in (0, 1):
        invoke(*common, "--shard", f"{k}/2", "--name", f"s{k}")
    yield root
    mp.undo()


def load(path):
    return json.loads(path.read_text())


def decoded(data):
    return [{k: r[k] for k in DECODED} for r in data["requests"]]


def test_two_shards_merged_are_the_whole_run(runs):
    s0, s1, whole = load(runs / "s0.json"), load(runs / "s1.json"), load(runs / "whole.json")
    assert {r["request"] for r in s0["requests"]} == {0, 2} and {r["request"] for r in s1["requests"]} == {1, 3}
    assert s0["meta"]["shard"] == {"index": 0, "count": 2} and len(s0["meta"]["request_ids"]) == 4
    invoke("e2e-merge", runs / "s1.json", runs / "s0.json", "--out", runs, "--name", "merged")
    merged = load(runs / "merged.json")
    # the same decodes, in the same order, with the same place in each request's rotated plan
    assert decoded(merged) == decoded(whole)
    assert merged["meta"]["shards"] == {"count": 2, "merged": [0, 1], "missing": []}
    assert [p["shard"] for p in merged["meta"]["pieces"]] == [{"index": 0, "count": 2}, {"index": 1, "count": 2}]
    assert all(len(p["provenance"]["load_average_start"]) == 3 for p in merged["meta"]["pieces"])
    assert (runs / "merged.csv").exists()
    # the same summaries and comparisons (timings differ: compare what does not depend on them)
    key = ("model", "variant", "depth", "category")
    assert {tuple(r[k] for k in key): (r["tau"], r["requests"], r["tokens"]) for r in merged["rows"]} == {
        tuple(r[k] for k in key): (r["tau"], r["requests"], r["tokens"]) for r in whole["rows"]}
    pair = ("a", "a_depth", "b", "b_depth", "metric", "category", "requests")
    assert [tuple(c[k] for k in pair) for c in merged["comparisons"]] == [
        tuple(c[k] for k in pair) for c in whole["comparisons"]]
    # each ratio: the median over all 4 requests of the per-request ratio, summed over repeats (plain python here)
    rows = merged["requests"]

    def per_request(variant, depth, i, metric):
        rs = [r for r in rows if (r["variant"], r["depth"], r["request"]) == (variant, depth, i)]
        if metric == "tokens_per_s":
            return sum(r["new_tokens"] for r in rs) / sum(r["total_s"] for r in rs)
        return 1e3 * sum(r["draft_s"] for r in rs) / sum(r["rounds"] for r in rs)

    for c in merged["comparisons"]:
        ratios = [per_request(c["a"], c["a_depth"], i, c["metric"]) / per_request(c["b"], c["b_depth"], i, c["metric"])
                  for i in range(4)]
        assert c["requests"] == 4 and c["median"] == pytest.approx(statistics.median(ratios), rel=1e-9)
        assert c["low"] <= c["median"] <= c["high"]
    speed = {r["variant"]: r["speedup"] for r in merged["rows"] if r["category"] == "all"}
    full = [per_request("full head", 1, i, "tokens_per_s") / per_request("target only", 0, i, "tokens_per_s")
            for i in range(4)]
    assert speed["full head"] == pytest.approx(statistics.median(full), rel=1e-9)


def test_a_missing_shard_is_reported_and_the_merge_says_so(runs):
    output = invoke("e2e-merge", runs / "s0.json", "--out", runs, "--name", "partial")
    assert "shards still missing: 1/2" in output and "covers 2 of 4 requests" in output
    partial = load(runs / "partial.json")
    assert partial["meta"]["shards"] == {"count": 2, "merged": [0], "missing": [1]}
    assert {r["request"] for r in partial["requests"]} == {0, 2}


def edited(runs, name, change):
    data = load(runs / "s1.json")
    change(data["meta"])
    (runs / name).write_text(json.dumps(data))
    return runs / name


def test_pieces_of_different_runs_or_overlapping_shards_are_refused(runs):
    shutil.copy(runs / "s0.json", runs / "s0-again.json")
    output = invoke("e2e-merge", runs / "s0.json", runs / "s0-again.json", "--out", runs, "--name", "m", code=2)
    assert "shard 0/2 is given twice" in output
    capacity = edited(runs, "capacity.json", lambda m: m.update(capacity=32))
    output = invoke("e2e-merge", runs / "s0.json", capacity, "--out", runs, "--name", "m", code=2)
    assert "capacity differs" in output
    drafter = edited(runs, "drafter.json", lambda m: next(iter(m["drafter_training"].values())).update(
        checkpoint_sha256="0" * 64))
    output = invoke("e2e-merge", runs / "s0.json", drafter, "--out", runs, "--name", "m", code=2)
    assert "drafter checkpoint sha256 differs" in output
    thirds = edited(runs, "thirds.json", lambda m: m["shard"].update(count=3))
    output = invoke("e2e-merge", runs / "s0.json", thirds, "--out", runs, "--name", "m", code=2)
    assert "shard count (N) differs" in output
    output = invoke("e2e-merge", runs / "whole.json", "--out", runs, "--name", "whole", code=2)
    assert "would overwrite the piece" in output
    assert not (runs / "m.json").exists()
    output = invoke("e2e", "--drafter", "eagle", "--shard", "2/2", code=2)
    assert "0 <= K < N" in output


def test_a_different_commit_or_load_warns_and_keeps_each_provenance(runs):
    def change(meta):
        meta["provenance"].update(git_commit="f" * 40, load_average_start=[9.0, 9, 9], load_average_end=[9.0, 9, 9])

    other = edited(runs, "other-commit.json", change)
    output = invoke("e2e-merge", runs / "s0.json", other, "--out", runs, "--name", "warned")
    assert "different git commits" in output and "load differed" in output
    meta = load(runs / "warned.json")["meta"]
    assert meta["pieces"][1]["provenance"]["git_commit"] == "f" * 40
    assert meta["pieces"][0]["provenance"]["git_commit"] == load(runs / "s0.json")["meta"]["provenance"]["git_commit"]
    assert sum("git commits" in w or "load differed" in w for w in meta["merge_warnings"]) == 2
