"""What makes an `e2e` figure trustworthy: paired repeats in rotated order, intervals, loud mismatches,
provenance, the training-text guard and a static table disjoint from the requests (tiny models, seconds)."""
import json
import statistics

import pytest
import torch
from click.testing import CliRunner

from nanospec_fx.eval import cli, loaders
from nanospec_fx.eval.bench import eagle_e2e
from nanospec_fx.eval.stats import median_interval

transformers = pytest.importorskip("transformers")

from tiny_eagle import train_tiny_pair  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama over byte ids and an EAGLE drafter trained on the bundled sample (cached in ``cache``)."""
    root = tmp_path_factory.mktemp("rigour")
    mp = train_tiny_pair(root, invoke)
    requests = root / "requests.jsonl"
    requests.write_text("\n".join(json.dumps({"prompt": p, "continuation": "", "category": c}) for p, c in [
        ("the cat sat on the mat and the cat", "a"), ("def f(x):\n    return x + 1\n", "b"),
        ("one two three four five six", "a")]))
    yield root, requests
    mp.undo()


def invoke(*args, code=0):
    result = CliRunner().invoke(cli.main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result


def eagle(root, requests, *extra, code=0):
    return invoke("e2e", "--drafter", "eagle", "--model", root / "model", "--tokenizer", "bytes", "--corpus", requests,
                  "--static-corpus", "sample", "--static-n", 64, "--capacity", 64, "--max-new", 8, "--out", root,
                  "--threads", 1, *extra, code=code)


def test_median_interval_brackets_the_median_and_narrows_with_agreement():
    values = [1.0, 1.2, 0.9, 1.1, 1.05, 0.95, 1.3]
    median, low, high = median_interval(values)
    assert median == statistics.median(values) and low <= median <= high
    assert low in values and high in values  # a bootstrap median of an odd count is one of the values
    assert median_interval([2.0] * 5) == (2.0, 2.0, 2.0)
    wide = median_interval([0.5, 2.0, 1.0, 3.0, 0.2])
    assert wide[2] - wide[1] > high - low


def test_paired_repeats_rotate_the_order_and_report_intervals(trained):
    root, requests = trained
    printed = eagle(root, requests, "--depth", 1, "--depth", 2, "--variants", "full,static,context", "--repeats", 2,
                    "--observe", "verified,accepted", "--name", "paired").output
    data = json.loads((root / "paired.json").read_text())
    # the bracketed setting names survive the terminal (rich must not take them for style tags): in the progress
    # lines and in the tables, where the two settings' rows would otherwise print with the same name
    cells = [c.strip() for line in printed.splitlines() for c in line.split("\u2502")]
    for setting in ("observe verified", "observe accepted"):
        assert f"a: nanospec context@64 [{setting}] depth 2 (repeat 2)" in printed
        assert cells.count(f"nanospec context@64 [{setting}]") >= 2  # its rows in the printed tables
    runs = data["requests"]
    # per depth: full, static, and context under each of the two settings; plus the target alone
    variants = {(r["variant"], r["depth"]) for r in runs}
    assert len(variants) == 1 + 2 * 4
    assert ("nanospec context@64 [observe accepted]", 2) in variants
    assert len(runs) == len(variants) * 3 * 2  # every variant x 3 requests x 2 repeats
    assert all(
        r["identical"] and r["new_tokens"] == 8 and len(r["accepted"]) == r["rounds"] for r in runs if r["depth"]
    )
    # rotated: the target alone is not always decoded first, and each (request, repeat) starts elsewhere
    firsts = [(r["request"], r["repeat"]) for r in runs if r["order"] == 0]
    starts = {next(x["variant"] + str(x["depth"]) for x in runs if (x["request"], x["repeat"]) == k and x["order"] == 0)
              for k in firsts}
    assert len(starts) == 6
    # the interval is the median of per-request ratios, computed here from the raw rows
    pooled = {(r["variant"], r["depth"]): r for r in data["rows"] if r["category"] == "all"}
    full = pooled[("full head", 1)]

    def rate(variant, depth, i):
        rs = [r for r in runs if (r["variant"], r["depth"], r["request"]) == (variant, depth, i)]
        return sum(r["new_tokens"] for r in rs) / sum(r["total_s"] for r in rs)

    ratios = [rate("full head", 1, i) / rate("target only", 0, i) for i in range(3)]
    assert full["speedup"] == pytest.approx(statistics.median(ratios), rel=1e-3)
    assert full["speedup_low"] <= full["speedup"] <= full["speedup_high"] and full["repeats"] == 2
    pairs = {(c["a"], c["a_depth"], c["b"], c["b_depth"], c["metric"]) for c in data["comparisons"]}
    assert ("nanospec context@64 [observe accepted]", 1, "nanospec context@64 [observe verified]", 1,
            "tokens_per_s") in pairs  # a setting against the default, same requests
    assert ("nanospec context@64 [observe verified]", 1, "static-64", 1, "draft_ms_per_round") in pairs
    assert ("full head", 2, "full head", 1, "tokens_per_s") in pairs  # depth against the first depth
    meta = data["meta"]
    prov = meta["provenance"]
    assert prov["torch"] == torch.__version__ and prov["transformers"] == transformers.__version__
    assert prov["threads"] == 1 and len(prov["load_average_start"]) == 3 and len(prov["load_average_end"]) == 3
    assert len(prov["git_commit"] or "0" * 40) == 40
    (training,) = meta["drafter_training"].values()
    assert len(training["checkpoint_sha256"]) == 64
    (check,) = meta["training_text_check"].values()
    assert check["passed"] and check["requests_checked"] == 3 and check["training_prompts"] > 0


def test_a_mismatch_with_the_target_fails_the_run_and_is_recorded(trained, monkeypatch):
    root, requests = trained
    real = eagle_e2e.eagle_generate

    def corrupt(runner, drafter, *args, **kwargs):
        out, stats = real(runner, drafter, *args, **kwargs)
        if drafter is not None and not isinstance(drafter, torch._dynamo.eval_frame.OptimizedModule):
            out = out.clone()
            out[..., -1] = (out[..., -1] + 1) % 256  # the full head "drafts" a wrong last token
        return out, stats

    monkeypatch.setattr(eagle_e2e, "eagle_generate", corrupt)
    result = eagle(root, requests, "--depth", 1, "--variants", "full,context", "--name", "bad", code=2)
    assert "differ from the target's greedy output" in result.output
    runs = json.loads((root / "bad.json").read_text())["requests"]
    assert {r["variant"] for r in runs if not r["identical"]} == {"full head"}
    assert all(r["identical"] for r in runs if r["variant"] != "full head")


def test_missing_training_list_fails_loudly(trained, tmp_path):
    root, requests = trained
    folder = root / "cache" / "eagle" / "model"
    listed = folder / "train-prompts.txt"
    saved = listed.read_text()
    listed.unlink()
    try:
        result = eagle(root, requests, "--depth", 1, "--variants", "full", "--name", "nolist", code=2)
    finally:
        listed.write_text(saved)
    assert "train-prompts.txt is missing" in result.output and not (root / "nolist.json").exists()


def test_static_table_drops_the_records_the_requests_come_from(tmp_path):
    from nanospec_fx.eval.commands.e2e import disjoint_static_samples

    static = loaders.load_corpus("sample")
    requests = loaders.load_corpus("sample[1:3]")
    kept, info = disjoint_static_samples(static, requests, "sample")
    assert len({s.record for s in static}) == len(static)  # every bundled record has its own id
    assert [s.record for s in kept] == [s.record for i, s in enumerate(static) if i not in (1, 2)]
    assert info["records_dropped_as_requests"] == 2 and info["records_counted"] == len(static) - 2


def test_like_for_like_rounds_compile_every_variant_and_replay_the_body_on_the_same_rows(trained):
    """--compile-all: every variant through torch.compile; the replayed body runs the rounds (accepted lengths, so
    body rows) of the nanospec variant it is compared with; the draft time is split and the target's top-k is
    verify time (only the variant with an active set observes)."""
    root, requests = trained
    eagle(root, requests, "--depth", 1, "--depth", 2, "--variants", "full,static,context,body,body-replayed",
          "--compile-all", "eager", "--name", "like")
    data = json.loads((root / "like.json").read_text())
    assert data["meta"]["compile_all"] == "eager" and data["meta"]["inductor"] is False
    assert all(r["identical"] for r in data["requests"])
    nano = next(r["variant"] for r in data["rows"] if r["variant"].startswith("nanospec"))
    replayed = f"{eagle_e2e.REPLAYED} ({nano})"
    assert {c["runs"] for c in data["replay"]} == {3} and all(c["same_rows"] == c["runs"] for c in data["replay"])
    by = {(r["variant"], r["depth"], r["request"]): r for r in data["requests"]}
    for (variant, depth, request), r in by.items():
        if variant == replayed:
            assert r["accepted"] == by[(nano, depth, request)]["accepted"]
            assert r["body_rows"] == by[(nano, depth, request)]["body_rows"]
    pooled = {(r["variant"], r["depth"]): r for r in data["rows"] if r["category"] == "all"}
    for (variant, depth), r in pooled.items():
        if depth:  # one feed and depth - 1 chain steps per round
            assert r["calls_per_round"] == depth
            assert (r["observe_ms_per_round"] > 0) == variant.startswith("nanospec")
            parts = r["observe_ms_per_round"] + r["calls_ms_per_round"] + r["loop_ms_per_round"]
            assert parts == pytest.approx(r["draft_ms_per_round"])
    assert {(c["a"], c["b"], c["metric"]) for c in data["comparisons"]} >= {(nano, replayed, "draft_ms_per_round")}
    split = {c["variant"]: c for c in data["call_split"]}
    assert set(split) == {v for v, d in pooled if d}
    assert split[nano]["head"] > 0 and split[nano]["observe"] > 0 and split[replayed]["head"] == 0
    for c in split.values():
        assert c["overhead"] == pytest.approx(c["call"] - c["body"] - c["head"] - c["topk"] - c["observe"], abs=1e-3)
    for r in data["round_split"]:  # the parts add up to the measured draft time per round
        parts = sum(r[k] for k in ("body", "head", "topk", "observe", "overhead", "loop"))
        assert parts == pytest.approx(r["draft"], rel=1e-3, abs=1e-3)
        assert (r["head"] > 0) == (split[r["variant"]]["head"] > 0)
    text = invoke("e2e", "--help").output  # the flag is documented
    assert "--compile-all" in text
