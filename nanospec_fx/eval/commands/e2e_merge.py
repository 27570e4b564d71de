"""``nanospec-fx e2e-merge``: the shards of one ``e2e --drafter eagle --shard K/N`` run joined into that run.

A long run (48 requests x every variant x depths x repeats is hours on a small CPU) is done in pieces: each
shard decodes every N-th request, with the variant order of the whole run. The merge checks that the pieces
are one run (same settings, requests and drafter; no shard twice), says which shards are missing, keeps each
piece's provenance, and computes the tables and paired ratios over all requests with the code a whole run uses
(:func:`nanospec_fx.eval.commands.e2e_eagle.report`).
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from nanospec_fx.eval.cli import out_option

# What every piece of one run must share (meta keys written by `e2e --drafter eagle`); the drafter checkpoint's
# digest and the threads are checked besides.
SAME_SETTINGS = ("models", "variants", "depths", "observe", "observe_topk", "prompt_topk", "settings", "max_new",
                 "max_prompt", "capacity", "static_n", "static_corpus", "static_table", "inductor", "repeats",
                 "request_ids", "requests_sha256", "draft")
LOAD_SPREAD = 1.0  # warn when the pieces' mean load averages differ by more than this (cores busy with other work)


class MergeError(ValueError):
    """The pieces are not shards of one run."""


def load_piece(path: Path) -> dict:
    """One shard's JSON; refused when it is not an ``e2e --drafter eagle`` JSON written with shard information."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise MergeError(f"{path}: cannot read it as JSON ({e})") from e
    shard = data.get("meta", {}).get("shard")
    if not isinstance(shard, dict) or "index" not in shard or "requests" not in data:
        raise MergeError(f"{path}: not a shard of `nanospec-fx e2e --drafter eagle` (its meta has no shard: an older "
                         "JSON, another verb's, or a merged one)")
    return data


def _fingerprint(meta: dict) -> dict:
    """The settings a piece must share with the others, by name."""
    out = {k: meta.get(k) for k in SAME_SETTINGS}
    out["drafter checkpoint sha256"] = {m: t.get("checkpoint_sha256") for m, t in meta.get("drafter_training", {}).items()}
    out["threads"] = meta.get("provenance", {}).get("threads")
    out["shard count (N)"] = meta["shard"]["count"]
    return out


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check(paths: list[Path], pieces: list[dict]) -> tuple[list[int], list[str]]:
    """``(missing shard indices, warnings)``; raises :class:`MergeError` when the pieces are not shards of one
    run: a setting differs, a shard is given twice, or a piece's requests are not its shard's."""
    from nanospec_fx.eval.bench.eagle_e2e import in_shard

    first = _fingerprint(pieces[0]["meta"])
    for path, piece in zip(paths[1:], pieces[1:]):
        mine = _fingerprint(piece["meta"])
        for key in first:
            if mine[key] != first[key]:
                raise MergeError(f"{path} is not a shard of the run of {paths[0]}: {key} differs "
                                 f"({_short(mine[key])} vs {_short(first[key])})")
    count = first["shard count (N)"]
    seen: dict[int, Path] = {}
    for path, piece in zip(paths, pieces):
        k = piece["meta"]["shard"]["index"]
        if k in seen:
            raise MergeError(f"shard {k}/{count} is given twice ({seen[k]} and {path}): the pieces overlap")
        seen[k] = path
        expected = {i for i in range(len(first["request_ids"])) if in_shard(i, (k, count))}
        got = {r["request"] for r in piece["requests"]}
        if got != expected:
            raise MergeError(f"{path}: its requests {sorted(got)} are not shard {k}/{count}'s {sorted(expected)}")
    missing = [k for k in range(count) if k not in seen]
    provs = [(path, piece["meta"].get("provenance", {})) for path, piece in zip(paths, pieces)]
    warnings = []
    for key in ("git_commit", "torch", "transformers"):
        values = {p.get(key) for _, p in provs}
        if len(values) > 1:
            warnings.append(f"the pieces ran with different {key.replace('_', ' ')}s: "
                            + ", ".join(f"{path.name}: {p.get(key)}" for path, p in provs))
    if any(p.get("git_dirty") for _, p in provs):
        warnings.append("a piece ran on a tree with uncommitted changes: "
                        + ", ".join(path.name for path, p in provs if p.get("git_dirty")))
    cpus = {piece["meta"].get("machine", {}).get("cpu") for piece in pieces}
    if len(cpus) > 1:
        warnings.append(f"the pieces ran on different CPUs: {sorted(map(str, cpus))}")
    loads = {path.name: _mean_load(p) for path, p in provs}
    known = [x for x in loads.values() if x is not None]
    if known and max(known) - min(known) > LOAD_SPREAD:
        warnings.append("the machine's load differed between pieces (mean of the 1-minute load average at start and "
                        "end): " + ", ".join(f"{n}: {x:.1f}" for n, x in loads.items() if x is not None)
                        + "; the paired ratios hold within each request, absolute tokens/s less so")
    return missing, warnings


def _mean_load(prov: dict) -> float | None:
    ends = [x[0] for x in (prov.get("load_average_start"), prov.get("load_average_end")) if x]
    return sum(ends) / len(ends) if ends else None


def merge(paths: list[Path], out: Path, name: str) -> None:
    """Check, then write ``name``'s JSON, CSV and plot and print the tables, as one unsharded run would."""
    from nanospec_fx.eval.bench.eagle_e2e import runs_from_rows
    from nanospec_fx.eval.commands.e2e_eagle import report
    from nanospec_fx.eval.report import command_line, console, fail

    paths = [Path(p) for p in paths]
    target = (out / f"{name}.json").resolve()
    if target in {p.resolve() for p in paths}:
        fail(f"--name {name} would overwrite the piece {target}: choose another name")
    try:
        pieces = [load_piece(p) for p in paths]
        missing, warnings = check(paths, pieces)
    except MergeError as e:
        fail(e)
    order = sorted(range(len(pieces)), key=lambda i: pieces[i]["meta"]["shard"]["index"])
    paths, pieces = [paths[i] for i in order], [pieces[i] for i in order]
    first = pieces[0]["meta"]
    count = first["shard"]["count"]
    for w in warnings:
        console.print(f"warning: {w}", highlight=False)
    covered = sum(len({r["request"] for r in p["requests"]}) for p in pieces)
    left = (f"warning: shards still missing: {', '.join(f'{k}/{count}' for k in missing)}; this merge covers "
            f"{covered} of {len(first['request_ids'])} requests (run the missing shards, then merge all {count})")
    if missing:
        console.print(left, highlight=False)
    runs_by_model = {spec: runs_from_rows([{k: v for k, v in r.items() if k != "model"}
                                           for p in pieces for r in p["requests"] if r["model"] == spec])
                     for spec in first["models"]}
    kept = ("command", "shard", "machine", "provenance")
    meta = {"command": command_line(), **{k: v for k, v in first.items() if k not in kept},
            "shard": None, "shards": {"count": count, "merged": [p["meta"]["shard"]["index"] for p in pieces],
                                      "missing": missing},
            "merge_warnings": warnings,
            "pieces": [{"path": str(path), **{k: p["meta"].get(k) for k in kept}} for path, p in zip(paths, pieces)]}
    report(out, name, meta, runs_by_model, first["provenance"]["threads"])
    if missing:  # again under the tables
        console.print(left, highlight=False)


@click.command("e2e-merge")
@click.argument("pieces", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@out_option("e2e-eagle-merged")
def e2e_merge(pieces, out, name):
    """Join the JSONs of `e2e --drafter eagle --shard K/N` runs (K = 0 .. N-1) into the one run they are pieces of.

    Refuses pieces that differ in a setting (model, drafter checkpoint, depths, variants, observe, new tokens,
    capacity, static table, threads, repeats, requests, N) or that give a shard twice; warns when their git
    commits, library versions or machine load differ (each piece's provenance is kept in the JSON), and says which
    shards are missing. Writes NAME.json, .csv and .png and prints the tables and paired ratios (median over all
    requests, 95% bootstrap interval) as the unsharded run would.
    """
    merge(list(pieces), out, name)
