"""Markdown tables from the JSON files that ``nanospec-fx`` writes (for docs/results.md): :func:`render` one file,
:func:`eagle_sweep` several depths. ``python benchmarks/report.py`` is the script that prints them."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

#: a drafter cell (request, variant, depth, repeat) whose verify ms per round exceeds this multiple of its depth's
#: median is a load spike: every variant's target verifies the same rows at a depth, so only load moves it that far
SPIKE = 2.0


class Untrustworthy(ValueError):
    """A results JSON that says its own timings cannot be trusted (oversubscribed, or load spikes)."""


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def coverage(data: dict) -> str:
    rows, meta = data["rows"], data["meta"]
    cats = list(dict.fromkeys(r["category"] for r in rows))
    by = {(r["policy"], r["category"]): r for r in rows}
    k = meta.get("topk") or 0
    pols = ["full", "static-32768", "static-3072", "context@3072"] + ([f"context+top{k}@3072"] if k else [])
    pols += [f"hybrid{'+top%d' % k if k else ''}-1024@3072"]
    out = [[p] + [pct(by[(p, c)]["coverage"]) for c in cats] + [f"{by[(p, 'all')]['mean_size']:,.0f}",
                                                                  f"{by[(p, 'all')]['p95_size']:,.0f}"]
           for p in pols if (p, "all") in by]
    return table(["policy", *cats, "mean \\|A\\|", "p95 \\|A\\|"], out)


CENTROID_METHODS = {"centroids": "centroids", "nanospec": "nanospec", "union": "union",
                    "union_filled": "union, filled", "nanospec_in_centroids": "nanospec within centroids"}


def centroid_coverage(data: dict) -> str:
    """``benchmarks/centroid_coverage.py``: per (C, R), each method's coverage of the greedy / reference next token
    (mean rows scored)."""
    by = {(r["centroids"], r["rows"], r["method"]): r for r in data["rows"]}
    shapes = list(dict.fromkeys((r["centroids"], r["tokens_per_cluster"], r["rows"]) for r in data["rows"]))
    methods = [m for m in CENTROID_METHODS if any(r["method"] == m for r in data["rows"])]
    out = [[f"{c} ({per})", f"{rows:,}"] + [
        f"{pct(r['coverage_greedy'])} / {pct(r['coverage_reference'])} ({r['mean_rows']:,.0f})"
        for r in (by[(c, rows, m)] for m in methods)] for c, per, rows in shapes]
    return table(["C (tokens per cluster)", "R", *(CENTROID_METHODS[m] for m in methods)], out)


def head(data: dict) -> str:
    rows = [r for r in data["rows"]]
    sweep_start = next((i for i in range(1, len(rows))
                        if rows[i]["shape"] == rows[0]["shape"] and rows[i]["variant"] == "dense"
                        and rows[i - 1]["shape"] != rows[0]["shape"]), len(rows))
    main, sweep = rows[:sweep_start], rows[sweep_start:]
    t = table(["shape (H x V)", "rows", "variant", "rows computed", "ms", "speedup", "limit V/N", "of limit"],
              [[f"{r['shape']} ({r['hidden']}x{r['vocab']})", str(r["rows"]), r["variant"], f"{r['size']:,}",
                f"{r['ms']:.2f}", f"{r['speedup']:.2f}x", f"{r['limit']:.1f}x", f"{100 * r['of_limit']:.0f}%"]
               for r in main])
    if sweep:
        t += "\n\nSweep (" + sweep[0]["shape"] + "):\n\n" + table(
            ["rows", "variant", "rows computed", "ms", "speedup vs dense"],
            [[str(r["rows"]), r["variant"], f"{r['size']:,}", f"{r['ms']:.2f}", f"{r['speedup']:.2f}x"] for r in sweep])
    return t


def draft(data: dict) -> str:
    return table(["head", "round ms", "head ms", "head share", "vs full"],
                 [[r["variant"], f"{r['round_ms']:.1f}", f"{r['head_ms']:.1f}", f"{100 * r['head_share']:.0f}%",
                   f"{100 * r['vs_full']:+.1f}%"] for r in data["rows"]])


def e2e(data: dict) -> str:
    return table(["model", "variant", "tok/s", "tokens/round", "draft share", "mean \\|A\\|", "== target greedy"],
                 [[r["model"], r["variant"], f"{r['tokens_per_s']:.2f}", f"{r['tokens_per_round']:.2f}",
                   f"{100 * r['draft_share']:.0f}%",
                   "" if r["active_size"] != r["active_size"] else f"{r['active_size']:,.0f}",
                   "yes" if r["identical"] else "**no**"] for r in data["rows"]])


#: parts of an `e2e --drafter eagle` rendering that ``render(..., section=...)`` prints alone
EAGLE_SECTIONS = ("pooled", "paired", "split")


def e2e_eagle(data: dict, section: str | None = None) -> str:
    """Pooled: tau, speed and where the time goes per variant and depth; then tau and speedup per category, the
    paired ratios and the draft time's split (``section``: only one of :data:`EAGLE_SECTIONS`)."""
    rows = data["rows"]
    pooled = _eagle_pooled(_with_full_rate([r for r in rows if r["category"] == "all"]), detail=True)
    if section == "pooled":
        return pooled
    if section == "paired":
        return paired_table(data.get("comparisons") or [])
    if section == "split":
        return draft_split(data)
    cats = [c for c in dict.fromkeys(r["category"] for r in rows)]
    keys = list(dict.fromkeys((r["variant"], r["depth"]) for r in rows if r["depth"]))
    by = {(r["variant"], r["depth"], r["category"]): r for r in rows}

    def per_category(cell, variants=keys) -> str:  # one row per (variant, depth), one column per category
        return table(["variant", "depth", *cats],
                     [[v, str(d), *(cell(v, d, c) if (v, d, c) in by else "" for c in cats)] for v, d in variants])

    per_cat = per_category(lambda v, d, c: f"{by[(v, d, c)]['tau']:.2f} / {interval(by[(v, d, c)])}")
    full = {(d, c): by[(v, d, c)] for v, d, c in by if v == "full head" and d}

    def against_full(r, f):
        return f"{100 * r['tau'] / f['tau']:.1f}% / {r['tokens_per_s'] / f['tokens_per_s']:.2f}x"

    text = pooled + "\n\ntau / speedup over the target alone [95% interval], per category:\n\n" + per_cat
    draft_ms = per_category(lambda v, d, c: f"{by[(v, d, c)]['draft_ms_per_round']:.1f}")
    text += "\n\ndraft ms per round, per category:\n\n" + draft_ms
    if full:  # a run without the full head (e.g. --variants context) has nothing to share it with
        ratio = per_category(lambda v, d, c: against_full(by[(v, d, c)], full[(d, c)]) if (d, c) in full else "",
                             [k for k in keys if k[0] != "full head"])
        text += ("\n\nAgainst EAGLE with the full head (the paper's baseline; same depth, same requests): "
                 "tau as a share of its tau / tokens/s ratio, per category:\n\n" + ratio)
    if data.get("comparisons"):
        text += "\n\nPaired ratios (same requests, this run): median over requests [95% bootstrap interval]:\n\n"
        text += paired_table(data["comparisons"])
    split = draft_split(data)
    if split:
        text += "\n\n" + split
    return text


def sample(data: dict) -> str:
    """Requests per cell, repeats and the machine's load: the line every e2e table is read with."""
    pooled = [r for r in data["rows"] if r.get("category") == "all" and r.get("depth")]
    prov = data["meta"].get("provenance") or {}
    requests = sorted({r.get("requests") for r in pooled if r.get("requests")})
    repeats = sorted({r.get("repeats", 1) for r in pooled})
    return (f"{'/'.join(map(str, requests)) or '?'} request(s) per cell (pooled over categories), "
            f"{'/'.join(map(str, repeats))} repeat(s), {prov.get('threads', '?')} thread(s), load "
            f"{(prov.get('load_average_start') or ['?'])[0]} -> {(prov.get('load_average_end') or ['?'])[0]}")


def draft_split(data: dict) -> str:
    """Like-for-like runs (``--compile-all``): where each round's draft time goes, measured in the run (the target's
    top-k joining the set, the drafter's calls, the loop around them), one call's parts timed apart, and whether
    the replayed body ran the compared variant's rows."""
    pooled = [r for r in data["rows"] if r.get("category") == "all" and r.get("depth")
              and r.get("calls_per_round", float("nan")) == r.get("calls_per_round", float("nan"))]
    if not pooled:
        return ""
    text = ("Draft ms per round, split (measured in the run; the target's top-k is in verify): observe = the "
            "target's top-k joining the set, calls = inside the drafter's calls (body, head, selection, Dynamo "
            f"entry), loop = the rest of the draft phase ({data['meta'].get('compile_all') or 'nanospec only'} "
            "compile):\n\n")
    text += table(["variant", "depth", "draft", "observe", "calls", "loop", "calls/round", "verify", "body rows/round"],
                  [[r["variant"], str(r["depth"]), f"{r['draft_ms_per_round']:.2f}", f"{r['observe_ms_per_round']:.2f}",
                    f"{r['calls_ms_per_round']:.2f}", f"{r['loop_ms_per_round']:.2f}", f"{r['calls_per_round']:.2f}",
                    f"{r['verify_ms_per_round']:.2f}", f"{r['body_rows_per_round']:.2f}"] for r in pooled])
    if data.get("call_split"):
        text += ("\n\nOne draft call (one row, the loop's top-1) timed in parts, ms (medians of interleaved calls; "
                 "an estimate from parts: overhead = call - the parts):\n\n")
        text += table(["variant", "active", "call", "body", "head", "top-k", "observe", "overhead"],
                      [[c["variant"], "" if c["active"] is None else f"{c['active']:,}", f"{c['call']:.3f}",
                        f"{c['body']:.3f}", f"{c['head']:.3f}", f"{c['topk']:.3f}", f"{c['observe']:.3f}",
                        f"{c['overhead']:.3f}"] for c in data["call_split"]])
    if data.get("round_split"):
        text += ("\n\nDraft ms per round by part (observe and loop measured in the run; the drafter calls' measured time "
                 "apportioned by the parts of one call, above; observe = the target's top-k joining the set + the "
                 "calls' own fed-id observes):\n\n")
        text += table(["variant", "depth", "draft", "body", "head", "top-k", "observe", "overhead", "loop"],
                      [[r["variant"], str(r["depth"]), *(f"{r[k]:.2f}" for k in
                                                         ("draft", "body", "head", "topk", "observe", "overhead", "loop"))]
                       for r in data["round_split"]])
    if data.get("replay"):
        text += "\n\nReplayed body: runs with the compared variant's rounds and body rows exactly:\n\n"
        text += table(["variant", "depth", "replays", "same rows"],
                      [[c["variant"], str(c["depth"]), c["replays"], f"{c['same_rows']} of {c['runs']}"]
                       for c in data["replay"]])
    return text


def paired_table(comparisons: list[dict]) -> str:
    """The paired comparisons an `e2e --drafter eagle` run made (JSONs with a "comparisons" section); a ratio is a
    lead (or a loss) only where its interval excludes 1."""
    return table(["variant", "depth", "against", "depth ", "metric", "ratio [95% interval]", "requests", "excludes 1"],
                 [[c["a"], str(c["a_depth"]), c["b"], str(c["b_depth"] or ""), c["metric"].replace("_", " "),
                   f"{c['median']:.2f}x [{c['low']:.2f}, {c['high']:.2f}]", str(c["requests"]),
                   "yes" if c["low"] > 1 or c["high"] < 1 else "no"] for c in comparisons])


def trust_problems(data: dict) -> list[str]:
    """Why a results JSON's timings cannot be trusted (empty: no reason found): a provenance (its own or a merged
    piece's) that says oversubscribed, or drafter cells whose verify time is a load spike (:data:`SPIKE`)."""
    meta = data["meta"]
    problems = [p["oversubscribed"] for p in [meta.get("provenance") or {}]
                + [piece.get("provenance") or {} for piece in meta.get("pieces", [])] if p.get("oversubscribed")]
    cells: dict[int, list[float]] = {}
    for r in data.get("requests") or []:
        if r.get("depth") and r.get("rounds"):
            cells.setdefault(r["depth"], []).append(r["verify_s"] / r["rounds"])
    spikes = [(d, v / statistics.median(vs)) for d, vs in cells.items() for v in vs if v > SPIKE * statistics.median(vs)]
    if spikes:
        problems.append(f"{len(spikes)} of {sum(map(len, cells.values()))} drafter cells have a verify time per round "
                        f"over {SPIKE:g}x their depth's median (up to {max(x for _, x in spikes):.1f}x): load spikes")
    return problems


def interval(r: dict) -> str:
    """The speedup over the target alone: with its 95% interval where the JSON has one (paired runs)."""
    if r.get("speedup_low") is None or r["speedup_low"] != r["speedup_low"]:
        return f"{r['speedup']:.2f}x"
    return f"{r['speedup']:.2f}x [{r['speedup_low']:.2f}, {r['speedup_high']:.2f}]"


def render(path: Path, force: bool = False, section: str | None = None) -> str:
    """The markdown of one results JSON (``section``: one part of an EAGLE run's, :data:`EAGLE_SECTIONS`). A run
    whose JSON says it cannot be trusted (:func:`trust_problems`) is refused (:class:`Untrustworthy`) unless
    ``force``, and then rendered under a line that says why."""
    data = json.loads(path.read_text())
    problems = trust_problems(data)
    if problems and not force:
        raise Untrustworthy(f"{path.name} is not trustworthy ({'; '.join(problems)}): rerun it with --threads 1 on "
                            "a quiet machine, or render it with --force (the output then says so)")
    rows = data["rows"]
    kind = ("coverage" if "coverage" in rows[0] else "centroid_coverage" if "coverage_greedy" in rows[0] else "head" if "of_limit" in rows[0] else
            "draft" if "round_ms" in rows[0] else "e2e_eagle" if "tau" in rows[0] else "e2e")
    if section is not None and (kind != "e2e_eagle" or section not in EAGLE_SECTIONS):
        raise ValueError(f"--section {section}: only an e2e --drafter eagle result has sections ({EAGLE_SECTIONS})")
    body = {"coverage": coverage, "centroid_coverage": centroid_coverage, "head": head, "draft": draft, "e2e": e2e,
            "e2e_eagle": lambda d: e2e_eagle(d, section)}[kind](data)
    meta = data["meta"]
    shards = meta.get("shards")  # `nanospec-fx e2e-merge`: each piece's provenance, not the merge's own
    if shards:
        origin = (f"\n\nmerged from shards {', '.join(map(str, shards['merged']))} of {shards['count']}"
                  + (f" (**missing: {', '.join(map(str, shards['missing']))}**)" if shards["missing"] else "") + ":"
                  + "".join(f"\n- shard {p['shard']['index']}: {_origin(p.get('provenance'))}" for p in meta["pieces"]))
    else:
        origin = f"\n\n{_origin(meta['provenance'])}" if meta.get("provenance") else ""
    if kind == "e2e_eagle":
        origin += f"\n\n{sample(data)}"
    if problems:
        origin += f"\n\n**Not trustworthy** (rendered with --force): {'; '.join(problems)}."
    return f"### {path.stem}\n\n`{data['meta'].get('command', '')}`{origin}\n\n{body}\n"


def _origin(prov: dict | None) -> str:
    """Commit, torch, threads and load of one run (a results JSON's provenance)."""
    prov = prov or {}
    return (f"commit {(prov.get('git_commit') or '?')[:10]}{' (dirty)' * bool(prov.get('git_dirty'))}, "
            f"torch {prov.get('torch')}, {prov.get('threads')} threads, load "
            f"{(prov.get('load_average_start') or ['?'])[0]} -> {(prov.get('load_average_end') or ['?'])[0]}")


def _with_full_rate(pooled: list[dict]) -> list[tuple[dict, float | None]]:
    """Each pooled row with the full head's tokens/s at its depth (None for the target alone)."""
    full = {r["depth"]: r["tokens_per_s"] for r in pooled if r["variant"] == "full head"}
    return [(r, full.get(r["depth"])) for r in pooled]


def _eagle_pooled(pairs: list[tuple[dict, float | None]], detail: bool) -> str:
    """The pooled EAGLE table; ``detail`` adds the draft share and the identical-output check."""
    header = ["variant", "depth", "tau", "tok/s", "vs target alone", "vs full head"]
    rows_counted = any(r.get("head_rows_per_round", 0) > 0 for r, _ in pairs)  # runs before 2026-12 have none
    header += ["draft share"] * detail + ["draft ms/round", "verify ms/round", "mean \\|A\\|"]
    header += ["head rows/round"] * rows_counted + ["== target greedy"] * detail
    out = []
    for r, full in pairs:
        row = [r["variant"], str(r["depth"] or ""), f"{r['tau']:.2f}", f"{r['tokens_per_s']:.2f}", interval(r),
               f"{r['tokens_per_s'] / full:.2f}x" if full else ""]
        row += [f"{100 * r['draft_share']:.0f}%"] * detail
        row += [f"{r['draft_ms_per_round']:.1f}", f"{r['verify_ms_per_round']:.1f}",
                "" if r["active_size"] != r["active_size"] else f"{r['active_size']:,.0f}"]
        row += [f"{r['head_rows_per_round']:.2f}" if r.get("head_rows_per_round", 0) > 0 else ""] * rows_counted
        row += ["yes" if r["identical"] else "**no**"] * detail
        out.append(row)
    return table(header, out)


def eagle_sweep(paths: list[Path]) -> str:
    """One pooled table over several `e2e --drafter eagle` runs (one depth each, same requests): a depth sweep."""
    pairs = []
    for path in paths:
        pooled = [r for r in json.loads(path.read_text())["rows"] if r["category"] == "all"]
        pairs += [(r, full) for r, full in _with_full_rate(pooled) if r["depth"]]
    order = {v: i for i, v in enumerate(dict.fromkeys(r["variant"] for r, _ in pairs))}  # as the runs list them
    pairs.sort(key=lambda rf: (order[rf[0]["variant"]], rf[0]["depth"]))
    return _eagle_pooled(pairs, detail=False)

