"""``nanospec-fx e2e --drafter eagle``: a trained EAGLE drafter with each head, on the target's KV cache."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

EAGLE_CORPORA = ("sharegpt[:8]", "humaneval[:8]", "shakespeare[:8]", "mtbench-math[:8]",
                 "sharegpt-translate[:8]", "sharegpt-summarize[:8]")


def run(*, models, tokenizer, corpora, depths, variants, observe, eagle_dir, prompt_topk=False, static_corpus, static_n,
        capacity, observe_topk, max_prompt, max_new, inductor, out, name, threads, repeats=1, paired_prompt_topk=False,
        shard=(0, 1), compile_all=None):
    import hashlib
    import itertools

    import torch

    from nanospec_fx import FrequencyTable
    from nanospec_fx.eval import loaders
    from nanospec_fx.eval import train_eagle as T
    from nanospec_fx.eval.bench import eagle_e2e as B
    from nanospec_fx.eval.commands.sources import load_option
    from nanospec_fx.eval.train_eagle import eagle_dir as default_dir
    from nanospec_fx.eval.commands.sources import disjoint_static_samples
    from nanospec_fx.eval.report import command_line, console, fail, file_digest, machine, progress, set_threads

    set_threads(threads)
    name = "e2e-eagle" if name == "e2e" else name
    kinds = tuple(v.strip() for v in variants.split(",") if v.strip())
    if not set(kinds) <= set(B.VARIANTS) or not kinds:
        fail(f"--variants takes a comma list of {', '.join(B.VARIANTS)}; got {variants!r}")
    if any(d < 1 for d in depths):
        fail(f"--depth must be >= 1, got {depths}")
    if repeats < 1:
        fail(f"--repeats must be >= 1, got {repeats}")
    observes = [o.strip() for o in observe.split(",") if o.strip()]
    if not observes or not set(observes) <= {"verified", "accepted", "none"}:
        fail(f"--observe takes verified, accepted, none or a comma list of them; got {observe!r}")
    if not 0 <= shard[0] < shard[1]:
        fail(f"--shard K/N takes 0 <= K < N, got {shard[0]}/{shard[1]}")
    settings = list(itertools.product(dict.fromkeys(observes), (False, True) if paired_prompt_topk else (prompt_topk,)))
    runs_by_model, metas, checks, statics, digests, request_ids, splits = {}, {}, {}, {}, {}, [], {}
    for spec in models[:1] if models == ("gemma3-270m", "smollm2-135m") else models:  # the default: Gemma only
        folder = eagle_dir or default_dir(spec)
        try:
            target = load_option("--model", loaders.load_model, spec)
            tok = load_option("--tokenizer", loaders.load_tokenizer, tokenizer or spec)
            samples = [s for c in (corpora or EAGLE_CORPORA) for s in load_option("--corpus", loaders.load_corpus, c)]
            static_samples = load_option("--static-corpus", loaders.load_corpus, static_corpus)
            drafter = T.load_drafter(target, folder)
        except (loaders.MissingAsset, FileNotFoundError, ValueError) as e:
            fail(e)
        trained = folder / "train-prompts.txt"
        if not trained.exists():
            fail(f"{trained} is missing: without the list of the drafter's training prompts nothing proves the "
                 "evaluation requests were not trained on. Retrain with `nanospec-fx train-eagle` (it writes the list) "
                 "or restore the file.")
        seen = set(trained.read_text().split())
        overlap = [s.prompt[:60] for s in samples if T.prompt_digest(s.prompt) in seen]
        if overlap:
            fail(f"{len(overlap)} evaluation request(s) were in the drafter's training text, e.g. {overlap[0]!r}: "
                 "choose other --corpus slices")
        checks[spec] = {"list": str(trained), "training_prompts": len(seen), "requests_checked": len(samples),
                        "overlap": 0, "passed": True}
        static_samples, statics[spec] = disjoint_static_samples(static_samples, samples, static_corpus)
        vocab = target.get_output_embeddings().weight.shape[0]
        requests = [(s.category, tok.encode(s.prompt, bos=True)[-max_prompt:]) for s in samples]
        if shard[1] > len(requests):
            fail(f"--shard {shard[0]}/{shard[1]}: more shards than the {len(requests)} requests")
        request_ids = [s.record or T.prompt_digest(s.prompt) for s in samples]
        digests[spec] = hashlib.sha256(json.dumps(requests).encode()).hexdigest()  # what the shards must share
        table = FrequencyTable.from_token_ids(
            (tok.encode(s.prompt) + tok.encode(s.continuation) for s in static_samples), vocab)
        torch._dynamo.reset()
        try:
            drafters = B.drafter_variants(drafter, table.top(min(static_n, vocab)), capacity, table,
                                          inductor=inductor, which=kinds, compile=compile_all)
        except ValueError as e:
            fail(e)
        nano = sum(B.is_nanospec(n) for n in drafters)
        mine = sum(B.in_shard(i, shard) for i in range(len(requests)))
        plan = repeats * mine * (1 + (len(drafters) + nano * (len(settings) - 1)) * len(depths))
        with progress() as prog:
            task = prog.add_task(spec, total=plan)
            def step(text, task=task, spec=spec):
                prog.update(task, advance=1, description=f"{spec}: {text}")
                if not console.is_terminal:  # a log file: one line per decoded request
                    console.print(f"{spec}: {text}")
            runs_by_model[spec] = B.run_eagle_e2e(
                target, drafters, requests, list(depths), max_new, observes[0], observe_topk, prompt_topk=prompt_topk,
                progress=step, repeats=repeats, settings=settings, shard=shard)
            longest = max(len(ids) for _, ids in requests)
            splits[spec] = B.call_split(drafters, -(-(longest + max_new + 2 * max(depths) + 3) // 64) * 64, longest)
        meta_path = folder / T.META
        metas[spec] = {k: v for k, v in json.loads(meta_path.read_text()).items() if k not in ("history", "config")}
        metas[spec]["checkpoint_sha256"] = file_digest(folder / T.WEIGHTS)
        del target, drafters, drafter
    meta = {"command": command_line(), "models": list(runs_by_model), "variants": list(kinds), "max_new": max_new,
            "max_prompt": max_prompt, "depths": list(depths),
            "observe": observe, "observe_topk": observe_topk, "prompt_topk": prompt_topk, "capacity": capacity,
            "repeats": repeats, "settings": [B.setting_name(*s) for s in settings],
            "order": "variants rotated per request and repeat; ratios: median over requests, 95% bootstrap interval",
            "shard": {"index": shard[0], "count": shard[1]}, "request_ids": request_ids, "requests_sha256": digests,
            "training_text_check": checks, "static_table": statics,
            "static_n": static_n,
            "static_corpus": static_corpus, "inductor": inductor if compile_all is None else compile_all == "inductor",
            "compile_all": compile_all, "target_topk": "verify time (taken over the verified rows, the target's work)",
            "drafter_training": metas,
            "draft": "chain (EAGLE drafter, greedy), target verifies [last token] + drafts on its KV cache",
            "machine": machine()}
    report(out, name, meta, runs_by_model, torch.get_num_threads(), splits)


def report(out: Path, name: str, meta: dict, runs_by_model: dict, threads: int, splits: dict | None = None) -> None:
    """Summaries, paired comparisons, tables, plot and outputs from the decoded runs of each model: the one path
    for a whole run and for merged shards (``nanospec-fx e2e-merge``). Fails (after writing) on any output that
    differs from the target's greedy output."""
    from rich.table import Table

    from nanospec_fx.eval.bench import eagle_e2e as B
    from nanospec_fx.eval.report import console, fail, write_outputs

    rows, requests_all, compared, replays, rounds = [], [], [], [], []
    for spec, runs in runs_by_model.items():
        summaries = B.summarise(runs)
        rounds += [{"model": spec, **r} for r in B.round_split(summaries, (splits or {}).get(spec, []))]
        requests_all += [{"model": spec, **r} for r in B.request_rows(runs)]
        compared += [{"model": spec, **c} for c in B.comparisons(runs)]
        replays += [{"model": spec, **c} for c in B.replay_checks(runs)]
        _print(console, Table, spec, summaries, len({r.request for r in runs}), meta["max_new"], meta["observe"],
               threads)
        rows += [{"model": spec, **dataclasses.asdict(s)} for s in summaries]
    out.mkdir(parents=True, exist_ok=True)
    _plot(rows, out / f"{name}.png")
    sections = {"replay": replays} if replays else {}
    if splits:
        sections["call_split"] = [{"model": spec, **c} for spec, cs in splits.items() for c in cs]
        sections["round_split"] = rounds
    write_outputs(out, name, rows, meta, requests=requests_all, comparisons=compared, **sections)
    _print_comparisons(console, Table, compared)
    bad = [r for r in requests_all if not r["identical"]]
    if bad:
        fail(f"{len(bad)} decoded request(s) differ from the target's greedy output (lossless decoding is broken), "
             f"e.g. {bad[0]['variant']} depth {bad[0]['depth']} on request {bad[0]['request']} ({bad[0]['category']}); "
             "every one is listed under \"requests\" in the JSON")


def _print_comparisons(console, Table, compared):
    t = Table(title="paired ratios (same requests, this run): median over requests [95% bootstrap interval]")
    for col in ("model", "variant", "against", "metric", "ratio", "requests"):
        t.add_column(col, justify="left" if col in ("model", "variant", "against", "metric") else "right")
    for c in compared:
        t.add_row(c["model"], f"{c['a']} d{c['a_depth']}", f"{c['b']}" + (f" d{c['b_depth']}" if c["b_depth"] else ""),
                  c["metric"], f"{c['median']:.3f} [{c['low']:.3f}, {c['high']:.3f}]", str(c["requests"]))
    console.print(t)


def _print(console, Table, spec, summaries, n_requests, max_new, observe, threads):
    t = Table(title=f"{spec}: trained drafter, chain drafts, {n_requests} requests x {max_new} new tokens, "
                    f"greedy, target top-k at {observe} positions, {threads} CPU threads (pooled over categories)")
    for col in ("variant", "depth", "tau", "tok/s", "vs target", "draft share", "draft ms/round", "verify ms/round",
                "mean |A|", "== target greedy"):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for s in summaries:
        if s.category != "all":
            continue
        t.add_row(s.variant, str(s.depth or ""), f"{s.tau:.2f}", f"{s.tokens_per_s:.2f}",
                  f"{s.speedup:.2f}x [{s.speedup_low:.2f}, {s.speedup_high:.2f}]",
                  f"{100 * s.draft_share:.0f}%", f"{s.draft_ms_per_round:.1f}", f"{s.verify_ms_per_round:.1f}",
                  "" if s.active_size != s.active_size else f"{s.active_size:,.0f}",
                  "yes" if s.identical else "NO")
    console.print(t)
    cats = list(dict.fromkeys(s.category for s in summaries))
    t = Table(title="tau per category")
    for col in ("variant", "depth", *cats):
        t.add_column(col, justify="left" if col == "variant" else "right")
    for key in dict.fromkeys((s.variant, s.depth) for s in summaries if s.depth):
        by = {s.category: s for s in summaries if (s.variant, s.depth) == key}
        t.add_row(key[0], str(key[1]), *(f"{by[c].tau:.2f}" if c in by else "" for c in cats))
    console.print(t)


def _plot(rows: list[dict], path: Path) -> None:
    from nanospec_fx.eval.report import pyplot

    plt = pyplot()
    pooled = [r for r in rows if r["category"] == "all"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for variant in dict.fromkeys(r["variant"] for r in pooled):
        rs = sorted((r for r in pooled if r["variant"] == variant), key=lambda r: r["depth"])
        if variant == "target only":
            for ax in axes[:1]:
                ax.axhline(rs[0]["tokens_per_s"], color="black", linestyle="--", label=variant)
            continue
        axes[0].plot([r["depth"] for r in rs], [r["tokens_per_s"] for r in rs], marker="o", label=variant)
        axes[1].plot([r["depth"] for r in rs], [r["tau"] for r in rs], marker="o", label=variant)
    axes[0].set(xlabel="drafts per round (depth)", ylabel="tokens/s", title="speed (pooled)")
    axes[1].set(xlabel="drafts per round (depth)", ylabel="tau (tokens per round)", title="acceptance (pooled)")
    axes[0].legend(fontsize=6)
    for ax in axes:
        ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
