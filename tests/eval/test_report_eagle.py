"""nanospec_fx.eval.markdown (printed by benchmarks/report.py) renders `e2e --drafter eagle` JSON with the issue's
comparisons computed right."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _report():
    from nanospec_fx.eval import markdown

    return markdown


def _script():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(variant, depth, category, tau, tok_s, speedup):
    return {"model": "m", "variant": variant, "depth": depth, "category": category, "tau": tau, "tokens_per_s": tok_s,
            "speedup": speedup, "draft_share": 0.1, "draft_ms_per_round": 1.0, "verify_ms_per_round": 2.0,
            "active_size": float("nan"), "identical": True}


def test_eagle_report_gives_tau_share_and_speed_ratio_against_the_full_head(tmp_path):
    rows = []
    for c in ("code", "all"):
        rows += [_row("target only", 0, c, 1.0, 10.0, 1.0), _row("full head", 2, c, 2.0, 8.0, 0.8),
                 _row("nanospec context@64", 2, c, 1.5 if c == "code" else 1.9, 12.0, 1.2)]
    path = tmp_path / "e2e-eagle-x.json"
    path.write_text(json.dumps({"rows": rows, "meta": {"command": "nanospec-fx e2e --drafter eagle"}}))
    text = _report().render(path)
    pooled = next(line for line in text.splitlines() if line.startswith("| nanospec context@64 | 2 | 1.90"))
    assert "| 1.20x | 1.50x |" in pooled  # vs target alone, vs full head (12 / 8)
    share = text.split("Against EAGLE with the full head")[1]
    assert "| nanospec context@64 | 2 | 75.0% / 1.50x | 95.0% / 1.50x |" in share
    assert "**no**" not in text
    # a run without the full head (e.g. --variants context, settings compared) has no share table to print
    without = tmp_path / "e2e-eagle-settings.json"
    without.write_text(json.dumps({"rows": [r for r in rows if r["variant"] != "full head"], "meta": {}}))
    assert "Against EAGLE with the full head" not in _report().render(without)


def test_depth_sweep_lists_every_run_by_variant_then_depth(tmp_path):
    paths = []
    for depth, tau in ((2, 2.0), (1, 1.5)):
        rows = [_row("target only", 0, "all", 1.0, 10.0, 1.0), _row("full head", depth, "all", tau, 5.0, 0.5),
                _row("nanospec context@64", depth, "all", tau, 10.0 * depth, 1.0 * depth)]
        paths.append(tmp_path / f"d{depth}.json")
        paths[-1].write_text(json.dumps({"rows": rows, "meta": {}}))
    lines = [line for line in _report().eagle_sweep(paths).splitlines()[2:]]
    assert [line.split(" | ")[:2] for line in lines] == [["| full head", "1"], ["| full head", "2"],
                                                         ["| nanospec context@64", "1"], ["| nanospec context@64", "2"]]
    assert "| 2.00x | 4.00x |" in lines[3]  # depth 2: 20 tok/s = 2x the target, 4x the full head


def test_paired_runs_show_intervals_comparisons_and_provenance(tmp_path):
    rows = [_row("target only", 0, "all", 1.0, 10.0, 1.0),
            {**_row("full head", 1, "all", 2.0, 12.0, 1.21), "speedup_low": 1.1, "speedup_high": 1.3}]
    comparisons = [{"a": "full head", "a_depth": 1, "b": "target only", "b_depth": 0, "metric": "tokens_per_s",
                    "median": 1.21, "low": 1.1, "high": 1.3, "requests": 5}]
    meta = {
        "command": "c",
        "provenance": {
            "git_commit": "abcdef0123456789",
            "git_dirty": False,
            "torch": "2.13.0",
            "threads": 2,
            "load_average_start": [0.5, 0, 0],
            "load_average_end": [0.7, 0, 0],
        },
    }
    path = tmp_path / "e2e-eagle-p.json"
    path.write_text(json.dumps({"rows": rows, "meta": meta, "comparisons": comparisons}))
    text = _report().render(path)
    assert "| full head | 1 | 2.00 | 12.00 | 1.21x [1.10, 1.30] |" in text
    assert "| full head | 1 | target only |  | tokens per s | 1.21x [1.10, 1.30] | 5 |" in text
    assert "commit abcdef0123, torch 2.13.0, 2 threads, load 0.5 -> 0.7" in text


def test_a_merged_run_says_which_shards_it_joins_and_which_are_missing(tmp_path):
    rows = [_row("target only", 0, "all", 1.0, 10.0, 1.0), _row("full head", 1, "all", 2.0, 12.0, 1.2)]
    pieces = [{"shard": {"index": k, "count": 3}, "provenance": {"git_commit": c * 40, "torch": "2.13.0", "threads": 2,
                                                                "load_average_start": [x, 0, 0],
                                                                "load_average_end": [x + 1, 0, 0]}}
              for k, c, x in ((0, "a", 0.5), (2, "b", 3.0))]
    meta = {"command": "nanospec-fx e2e-merge", "shards": {"count": 3, "merged": [0, 2], "missing": [1]},
            "pieces": pieces}
    path = tmp_path / "e2e-eagle-merged.json"
    path.write_text(json.dumps({"rows": rows, "meta": meta}))
    text = _report().render(path)
    assert ("merged from shards 0, 2 of 3 (**missing: 1**):\n"
            "- shard 0: commit aaaaaaaaaa, torch 2.13.0, 2 threads, load 0.5 -> 1.5\n"
            "- shard 2: commit bbbbbbbbbb, torch 2.13.0, 2 threads, load 3.0 -> 4.0\n") in text


def test_the_report_script_prints_the_library_tables(tmp_path):
    rows = [_row("target only", 0, "all", 1.0, 10.0, 1.0), _row("full head", 2, "all", 2.0, 8.0, 0.8)]
    path = tmp_path / "e2e-eagle-y.json"
    path.write_text(json.dumps({"rows": rows, "meta": {"command": "nanospec-fx e2e --drafter eagle"}}))
    assert _script().main([str(path)]) == _report().render(path)
    assert _script().main(["--sweep", str(path)]) == _report().eagle_sweep([path])


def test_centroid_coverage_report_pivots_methods_per_shape(tmp_path):
    rows = [{"centroids": 16, "tokens_per_cluster": 4, "rows": 8, "method": m, "coverage_greedy": g,
             "coverage_reference": r, "mean_rows": n} for m, g, r, n in
            (("centroids", 0.5, 0.25, 8), ("nanospec", 0.75, 0.5, 3.4), ("union", 0.875, 0.625, 6.6))]
    path = tmp_path / "centroid-coverage-x.json"
    path.write_text(json.dumps({"rows": rows, "meta": {"command": "python benchmarks/centroid_coverage.py"}}))
    lines = _report().render(path).splitlines()
    assert "| C (tokens per cluster) | R | centroids | nanospec | union |" in lines
    assert "| 16 (4) | 8 | 50.0% / 25.0% (8) | 75.0% / 50.0% (3) | 87.5% / 62.5% (7) |" in lines


def _cells(verify_ms: list[float]) -> list[dict]:
    return [{"variant": "v", "depth": 1, "request": i, "rounds": 10, "verify_s": ms / 100} for i, ms in
            enumerate(verify_ms)]


def test_the_report_refuses_a_run_its_json_calls_untrustworthy_unless_forced(tmp_path):
    markdown = _report()
    rows = [_row("target only", 0, "all", 1.0, 10.0, 1.0), _row("full head", 1, "all", 1.5, 8.0, 0.8)]
    clean = {"rows": rows, "meta": {"provenance": {"oversubscribed": None, "threads": 1}},
             "requests": _cells([10, 11, 12, 10.5])}
    busy = {**clean, "meta": {"provenance": {"oversubscribed": "oversubscribed: 2 threads on 2 cores"}}}
    spiky = {**clean, "requests": _cells([10, 11, 12, 10.5, 31])}  # one cell 3x its depth's median
    for name, data in (("clean", clean), ("busy", busy), ("spiky", spiky)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    assert "Not trustworthy" not in markdown.render(tmp_path / "clean.json")
    for name, why in (("busy", "oversubscribed: 2 threads"), ("spiky", "1 of 5 drafter cells")):
        try:
            markdown.render(tmp_path / f"{name}.json")
        except markdown.Untrustworthy as e:
            assert why in str(e)
        else:
            raise AssertionError(f"{name} was rendered")
        assert f"**Not trustworthy** (rendered with --force): {why}" in markdown.render(tmp_path / f"{name}.json",
                                                                                       force=True)
    script = _script()
    try:
        script.main([str(tmp_path / "busy.json")])
    except markdown.Untrustworthy:
        pass
    else:
        raise AssertionError("report.py printed an oversubscribed run")
    assert "Not trustworthy" in script.main(["--force", str(tmp_path / "busy.json")])


def test_tables_state_their_sample_and_claim_a_lead_only_where_the_interval_excludes_1(tmp_path):
    rows = [{**_row("target only", 0, "all", 1.0, 10.0, 1.0), "requests": 6, "repeats": 2},
            {**_row("full head", 1, "all", 1.5, 8.0, 0.8), "requests": 6, "repeats": 2}]
    comparisons = [{"a": "x", "a_depth": 1, "b": "y", "b_depth": 1, "metric": "tokens_per_s", "median": 1.04,
                    "low": 1.01, "high": 1.09, "requests": 6},
                   {"a": "x", "a_depth": 2, "b": "y", "b_depth": 2, "metric": "tokens_per_s", "median": 1.06,
                    "low": 0.98, "high": 1.23, "requests": 6}]
    path = tmp_path / "e2e-eagle-x.json"
    path.write_text(json.dumps({"rows": rows, "comparisons": comparisons, "meta": {
        "command": "c", "provenance": {"threads": 1, "load_average_start": [0.1], "load_average_end": [0.2]}}}))
    text = _report().render(path)
    assert "6 request(s) per cell (pooled over categories), 2 repeat(s), 1 thread(s), load 0.1 -> 0.2" in text
    paired = _script().main(["--section", "paired", str(path)])
    assert "| 1.04x [1.01, 1.09] | 6 | yes |" in paired and "| 1.06x [0.98, 1.23] | 6 | no |" in paired
    assert "tau / speedup" not in paired  # the section alone
