"""``nanospec-fx``: measure NanoSpec on real models and real text.

    nanospec-fx coverage      # how often the next token is in the active vocabulary, per task and policy
    nanospec-fx bench head    # LM-head time at real shapes: dense vs static 32k vs nanospec
    nanospec-fx bench draft   # one EAGLE-2-style draft round with each head
    nanospec-fx e2e           # generate(assistant_model=...) with each drafter head, output checked
    nanospec-fx explain       # what the pass rewrote in a model, and the predicted head speedup

Every verb prints a table and writes JSON, CSV and a PNG plot into ``--out``.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import os
import platform
import sys
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from nanospec_fx import loaders

console = Console(width=None if sys.stdout.isatty() else 160)


def _threads(n: int | None) -> None:
    torch.set_num_threads(n or min(2, os.cpu_count() or 1))


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
            "device": "cuda:" + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def write_outputs(out: Path, name: str, rows: list[dict], meta: dict) -> None:
    """``name.json`` (rows + how they were made) and ``name.csv`` (rows)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if rows:
        with open(out / f"{name}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    console.print(f"wrote {out / name}.json, .csv" + (", .png" if (out / f"{name}.png").exists() else ""))


def fail(err: Exception) -> None:
    console.print(f"[red]error:[/red] {err}")
    sys.exit(2)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


@click.group()
@click.version_option(package_name="nanospec-fx")
def main() -> None:
    """Measure NanoSpec (a dynamic active vocabulary for drafter LM heads) on real models and text."""


# ----------------------------------------------------------------------------- coverage
@main.command()
@click.option("--corpus", "corpora", multiple=True, metavar="SPEC",
              help="NAME[a:b] of a built-in corpus (" + ", ".join(loaders.CORPORA) + ") or a JSON/JSONL file; repeatable. "
              "Default: one slice per task category.")
@click.option("--tokenizer", default="gemma3", show_default=True, help="gemma3, smollm2, cl100k, tekken, bytes, or a path.")
@click.option("--model", default=None, help="Target model (gemma3-270m, smollm2-135m, HF dir, .gguf): adds its top-k.")
@click.option("--topk", default=3, show_default=True, help="How many of the target's predictions join the set.")
@click.option("--continuation", type=click.Choice(["reference", "greedy"]), default="reference", show_default=True,
              help="Score the corpus's reference text, or the target's own greedy continuation of each prompt "
              "(needs --model): the tokens a drafter really has to propose.")
@click.option("--static-corpus", default="sharegpt[1000:3000]", show_default=True,
              help="Where FR-Spec's frequency table is counted (kept apart from the evaluated text).")
@click.option("--static-sizes", default="1024,3072,8192,16384,32768", show_default=True)
@click.option("--capacities", default="256,512,1024,2048,3072,0", show_default=True, help="Context set capacities (0: unbounded).")
@click.option("--cores", default="256,512,1024,2048", show_default=True, help="Hybrid: static core sizes (capacity 3072).")
@click.option("--capacity", default=3072, show_default=True, help="Capacity of the headline context/hybrid policies.")
@click.option("--verify-every", default=1, show_default=True, help="Tokens per verified round (the target's top-k lag).")
@click.option("--compare-lru", is_flag=True, help="Also score the context policies with LRU eviction (re-observing refreshes).")
@click.option("--max-prompt", default=512, show_default=True, help="Keep the last N prompt tokens.")
@click.option("--max-new", default=128, show_default=True, help="Score the first N continuation tokens.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("benchmarks/results"), show_default=True)
@click.option("--name", default="coverage", show_default=True, help="Output file stem.")
@click.option("--threads", type=int, default=None)
def coverage(corpora, tokenizer, model, topk, continuation, static_corpus, static_sizes, capacities, cores, capacity, verify_every,
             compare_lru, max_prompt, max_new, out, name, threads):
    """Coverage of the next token by the active vocabulary, per task category and policy."""
    from nanospec_fx import coverage as C

    _threads(threads)
    try:
        tok = loaders.load_tokenizer(tokenizer)
        samples = [s for spec in (corpora or loaders.DEFAULT_CORPORA) for s in loaders.load_corpus(spec)]
        static_samples = loaders.load_corpus(static_corpus)
        target = loaders.load_model(model) if model else None
    except loaders.MissingAsset as e:
        fail(e)
    if continuation == "greedy" and target is None:
        fail(click.UsageError("--continuation greedy needs --model"))
    if target is not None and target.config.vocab_size < tok.vocab_size:
        fail(ValueError(f"the model's vocabulary ({target.config.vocab_size}) is smaller than the tokenizer's ({tok.vocab_size})"))
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
            r.continuation = _cached(cache, r.prompt, lambda: _greedy(target, r.prompt, max_new))
        requests = [r for r in requests if r.continuation]
    table = C.frequency_order((tok.encode(s.prompt) + tok.encode(s.continuation)
                               for s in track(static_samples, description="frequency table", console=console)), tok.vocab_size)
    if target is not None:
        cache = loaders.CACHE / "topk" / f"{Path(str(model)).name}-{topk}"
        for r in track(requests, description=f"target top-{topk}", console=console):
            r.predicted = _cached_predictions(cache, target, r.ids, topk)

    k = topk if target is not None else 0
    caps = _ints(capacities)
    policies = [C.full(tok.vocab_size)]
    policies += [C.static(table, n) for n in _ints(static_sizes) if n <= len(table)]
    policies += [C.context(c) for c in caps]
    if k:
        policies += [C.context(c, topk=k) for c in caps]
    if compare_lru:
        policies += [C.context(c, topk=t, eviction="lru") for t in sorted({0, k}) for c in caps]
    policies += [C.hybrid(table, c, capacity, topk=k) for c in _ints(cores) if c < capacity]
    results = C.evaluate(requests, policies, verify_every)
    rows = [dataclasses.asdict(r) for r in results]
    meta = {"command": "nanospec-fx " + " ".join(sys.argv[1:]), "tokenizer": tok.name, "vocab_size": tok.vocab_size,
            "model": model, "topk": k, "continuation": continuation, "static_corpus": static_corpus,
            "corpora": list(corpora or loaders.DEFAULT_CORPORA), "requests": len(requests), "verify_every": verify_every,
            "max_prompt": max_prompt, "max_new": max_new, "machine": machine(),
            # how repetitive the scored text is (degenerate loops make any context set look good)
            "distinct_token_ratio": sum(len(set(r.continuation)) / len(r.continuation) for r in requests) / len(requests)}
    headline = ["full", f"static-{max(_ints(static_sizes) or [0])}", f"static-{capacity}", f"context@{capacity}"]
    if k:
        headline.append(f"context+top{k}@{capacity}")
    headline += [f"hybrid{'+top%d' % k if k else ''}-1024@{capacity}"]
    _coverage_table(results, headline, f"next-token coverage ({tok.name}, V={tok.vocab_size:,}"
                    + (f", target {model} top-{k}" if k else ", inputs only") + f", {len(requests)} requests, "
                    + f"{continuation} continuations, verified every {verify_every})")
    console.print(f"distinct tokens / continuation tokens, mean over requests: {meta['distinct_token_ratio']:.2f}")
    out.mkdir(parents=True, exist_ok=True)
    _coverage_plot(results, out / f"{name}.png", f"{tok.name} V={tok.vocab_size:,}" + (f", +{model} top-{k}" if k else ""))
    write_outputs(out, name, rows, meta)


def _cached_predictions(cache: Path, model, ids: list[int], k: int) -> list[list[int]]:
    from nanospec_fx.coverage import target_predictions

    return _cached(cache, ids, lambda: target_predictions(model, ids, k))


def _cached(cache: Path, ids: list[int], compute):
    """``compute()`` for the token ids ``ids``, kept as JSON under ``cache`` (model outputs are slow on CPU)."""
    import hashlib

    path = cache / (hashlib.sha1(torch.tensor(ids).numpy().tobytes()).hexdigest() + ".json")
    if path.exists():
        return json.loads(path.read_text())
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)  # atomic: a concurrent run never reads half a file
    return value


@torch.inference_mode()
def _greedy(model, prompt: list[int], max_new: int) -> list[int]:
    pad = model.generation_config.pad_token_id
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                         pad_token_id=pad if pad is not None else 0)
    return out[0, len(prompt):].tolist()


def _coverage_table(results, headline: list[str], title: str) -> None:
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


def _coverage_plot(results, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


# ----------------------------------------------------------------------------- bench
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@main.group()
def bench() -> None:
    """Timing at real shapes: the LM head alone, or a whole draft round."""


def _shapes(names: str) -> list[tuple[str, int, int]]:
    from nanospec_fx.bench import SHAPES

    out = []
    for name in names.split(","):
        if name in SHAPES:
            out.append((name, *SHAPES[name]))
        elif "x" in name:  # HxV
            h, v = name.split("x")
            out.append((name, int(h), int(v)))
        else:
            raise click.BadParameter(f"unknown shape {name!r}: use {', '.join(SHAPES)} or HxV")
    return out


@bench.command("head")
@click.option("--shapes", default="llama3-8b,qwen2-7b,gemma3-270m,gemma3-27b", show_default=True,
              help="Comma-separated names or HxV.")
@click.option("--active", default=3072, show_default=True, help="Active vocabulary size (= capacity).")
@click.option("--static-n", default=32768, show_default=True)
@click.option("--rows", default="1,10", show_default=True)
@click.option("--repeats", default=10, show_default=True)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="fp32", show_default=True)
@click.option("--compiled/--no-compiled", default=True, show_default=True,
              help="Also time the head through torch.compile(backend='nanospec').")
@click.option("--inductor/--no-inductor", default=True, show_default=True,
              help="Compile the rewritten graph with inductor (else run it eagerly).")
@click.option("--sweep", default="256,1024,3072,8192,32768", show_default=True,
              help="Active sizes for the head-time-vs-size plot (first shape only; empty: none).")
@click.option("--device", default="cuda" if torch.cuda.is_available() else "cpu", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("benchmarks/results"), show_default=True)
@click.option("--name", default="bench-head", show_default=True)
@click.option("--threads", type=int, default=None)
def bench_head(shapes, active, static_n, rows, repeats, dtype, compiled, inductor, sweep, device, out, name, threads):
    """Head time: dense vs static top-N vs nanospec at one active size, 1 and 10 rows."""
    from nanospec_fx import bench as B

    _threads(threads)
    shape_list, row_list = _shapes(shapes), tuple(_ints(rows))
    results = []
    with _progress() as prog:
        task = prog.add_task("head", total=len(shape_list) * len(row_list) * (4 + compiled))
        for shape, h, v in shape_list:
            results += B.bench_head(shape, h, v, active, static_n, row_list, repeats, DTYPES[dtype], compiled, device,
                                    progress=lambda s: prog.update(task, advance=1, description=s), inductor=inductor)
        sweep_rows = []
        if _ints(sweep):
            shape, h, v = shape_list[0]
            task = prog.add_task("sweep", total=len(row_list) * len(_ints(sweep)))
            sweep_rows = B.bench_head_sweep(shape, h, v, _ints(sweep), row_list, repeats, DTYPES[dtype], device,
                                            progress=lambda s: prog.update(task, advance=1, description=s))
    t = Table(title=f"LM head, {dtype}, {device}, median of {repeats} (active {active}, static {static_n})")
    for col in ("shape", "rows", "variant", "rows computed", "median ms", "min ms", "speedup", "limit V/N", "of limit"):
        t.add_column(col, justify="left" if col in ("shape", "variant") else "right")
    for r in results:
        t.add_row(r.shape, str(r.rows), r.variant, f"{r.size:,}", f"{r.ms:.3f}", f"{r.min_ms:.3f}", f"{r.speedup:.2f}x",
                  f"{r.limit:.1f}x", f"{100 * r.of_limit:.0f}%")
    console.print(t)
    out.mkdir(parents=True, exist_ok=True)
    if sweep_rows:
        _head_plot(sweep_rows, results, out / f"{name}.png", f"{sweep_rows[0].shape} head, {dtype}, {device}")
    meta = {"command": "nanospec-fx " + " ".join(sys.argv[1:]), "dtype": dtype, "device": device, "repeats": repeats,
            "nanospec_ops": "reference (torch) on CPU; Triton kernels on CUDA (NANOSPEC_KERNELS)", "machine": machine()}
    write_outputs(out, name, [dataclasses.asdict(r) for r in results + sweep_rows], meta)


def _progress():
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=console)


def _head_plot(sweep_rows, results, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4))
    for rows in sorted({r.rows for r in sweep_rows}):
        pts = sorted((r.size, r.ms) for r in sweep_rows if r.rows == rows and r.variant != "dense")
        line, = ax.plot(*zip(*pts), marker="o", ms=3, label=f"nanospec compact, {rows} row(s)")
        dense = next(r.ms for r in sweep_rows if r.rows == rows and r.variant == "dense")
        ax.axhline(dense, ls="--", color=line.get_color(), lw=1, label=f"dense, {rows} row(s)")
        for r in results:
            if r.shape == sweep_rows[0].shape and r.rows == rows and r.variant.startswith("static"):
                ax.plot([r.size], [r.ms], marker="s", color=line.get_color(), ls="none", label=f"{r.variant}, {rows} row(s)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("head rows computed (active size)")
    ax.set_ylabel("ms")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


@bench.command("draft")
@click.option("--shape", default="llama3-8b", show_default=True, help="Drafter shape: llama3-8b (Llama-3.1-8B EAGLE) or tiny.")
@click.option("--active", default=3072, show_default=True)
@click.option("--static-n", default=32768, show_default=True)
@click.option("--depth", default=6, show_default=True)
@click.option("--topk", default=10, show_default=True)
@click.option("--prefix", default=512, show_default=True, help="Tokens already in the drafter's KV cache.")
@click.option("--repeats", default=5, show_default=True)
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="fp32", show_default=True)
@click.option("--compiled/--no-compiled", default=True, show_default=True)
@click.option("--inductor/--no-inductor", default=True, show_default=True)
@click.option("--device", default="cuda" if torch.cuda.is_available() else "cpu", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("benchmarks/results"), show_default=True)
@click.option("--name", default="bench-draft", show_default=True)
@click.option("--threads", type=int, default=None)
def bench_draft(shape, active, static_n, depth, topk, prefix, repeats, dtype, compiled, inductor, device, out, name, threads):
    """One EAGLE-2 draft round (depth x top-k tree) with the full, static and nanospec heads."""
    from nanospec_fx import bench as B

    _threads(threads)
    if shape == "llama3-8b":
        config = B.DrafterConfig()
    elif shape == "tiny":
        config = B.DrafterConfig.tiny()
    else:
        raise click.BadParameter("shape must be llama3-8b or tiny")
    with _progress() as prog:
        task = prog.add_task("draft", total=3 + compiled)
        rows = B.bench_draft(config, active, static_n, depth, topk, prefix, repeats, DTYPES[dtype], device, compiled,
                             progress=lambda s: prog.update(task, advance=1, description=s), inductor=inductor)
    t = Table(title=f"EAGLE-2 draft round, H={config.hidden} V={config.vocab:,}, depth {depth} x top-{topk}, "
                    f"{dtype}, {device}, median of {repeats}")
    for col in ("head", "round ms", "head ms", "head share", "vs full"):
        t.add_column(col, justify="left" if col == "head" else "right")
    for r in rows:
        t.add_row(r["variant"], f"{r['round_ms']:.1f}", f"{r['head_ms']:.1f}", f"{100 * r['head_share']:.0f}%",
                  f"{100 * r['vs_full']:+.1f}%")
    console.print(t)
    _bars(rows, "variant", "round_ms", out / f"{name}.png", "draft round ms", t.title)
    meta = {"command": "nanospec-fx " + " ".join(sys.argv[1:]), "config": dataclasses.asdict(config), "dtype": dtype,
            "device": device, "inductor": inductor, "machine": machine()}
    write_outputs(out, name, rows, meta)


def _bars(rows: list[dict], label: str, value: str, path: Path, ylabel: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar([r[label] for r in rows], [r[value] for r in rows], color="tab:blue")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=7)
    ax.tick_params(axis="x", labelsize=7, rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------- e2e
@main.command()
@click.option("--model", "models", multiple=True, default=("gemma3-270m", "smollm2-135m"), show_default=True,
              help="Target model (repeatable): gemma3-270m, smollm2-135m, a HF directory or a .gguf file.")
@click.option("--tokenizer", default=None, help="Tokenizer of the model (default: the model's own).")
@click.option("--draft-layers", default=None, type=int, help="Layers of the self-speculative drafter (default: a third).")
@click.option("--corpus", "corpora", multiple=True, default=("sharegpt[:3]", "humaneval[:3]"), show_default=True)
@click.option("--static-corpus", default="sharegpt[1000:3000]", show_default=True)
@click.option("--static-n", default=32768, show_default=True)
@click.option("--capacity", default=3072, show_default=True)
@click.option("--observe-topk", default=3, show_default=True, help="Target top-k added to the active set per verified position.")
@click.option("--max-prompt", default=256, show_default=True)
@click.option("--max-new", default=64, show_default=True)
@click.option("--draft-tokens", default=6, show_default=True, help="Tokens drafted per round (constant schedule).")
@click.option("--observer", type=click.Choice(["processor", "api"]), default="processor", show_default=True,
              help="How the target's top-k reaches the drafter: a LogitsProcessor on the target (verified positions; "
              "the target stays eager), or nanospec_fx.speculative_pair (the target compiled in place as an observer: "
              "every scored position, prefill included).")
@click.option("--inductor/--no-inductor", default=False, show_default=True,
              help="Compile the nanospec drafter's graph with inductor (slow to compile on CPU) or run it eagerly.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("benchmarks/results"), show_default=True)
@click.option("--name", default="e2e", show_default=True)
@click.option("--threads", type=int, default=None)
def e2e(models, tokenizer, draft_layers, corpora, static_corpus, static_n, capacity, observe_topk, max_prompt, max_new,
        draft_tokens, observer, inductor, out, name, threads):
    """generate(assistant_model=...) with a layer-truncated drafter: full vs static vs nanospec head."""
    from nanospec_fx import bench as B
    from nanospec_fx.coverage import frequency_order

    _threads(threads)
    rows = []
    for spec in models:
        try:
            target = loaders.load_model(spec)
            tok = loaders.load_tokenizer(tokenizer or spec)
            samples = [s for c in corpora for s in loaders.load_corpus(c)]
            static_samples = loaders.load_corpus(static_corpus)
        except loaders.MissingAsset as e:
            fail(e)
        vocab = target.get_output_embeddings().weight.shape[0]
        layers = draft_layers or max(1, target.config.num_hidden_layers // 3)
        prompts = [tok.encode(s.prompt, bos=True)[-max_prompt:] for s in samples]
        n_static = min(static_n, vocab)
        table = frequency_order((tok.encode(s.prompt) + tok.encode(s.continuation) for s in static_samples), vocab)[:n_static]
        weight = target.get_output_embeddings().weight
        torch._dynamo.reset()
        nano = B.truncated_drafter(target, layers)
        if observer == "processor":
            nano.compile(backend="nanospec", options={"capacity": capacity, "inductor": inductor})
        drafters = {
            "full head": B.truncated_drafter(target, layers),
            f"static-{n_static}": B.truncated_drafter(target, layers, B.StaticHead(weight, torch.tensor(table))),
            f"nanospec@{capacity}": nano,
        }
        with _progress() as prog:
            task = prog.add_task(spec, total=len(drafters) + 1)
            res = B.run_e2e(target, prompts, drafters, max_new, draft_tokens, observe_topk,
                            progress=lambda s: prog.update(task, advance=1, description=f"{spec}: {s}"),
                            pair=None if observer == "processor" else dict(capacity=capacity, inductor=inductor))
        t = Table(title=f"{spec} (V={vocab:,}), drafter = first {layers} of {target.config.num_hidden_layers} layers + "
                        f"shared head, {len(prompts)} prompts x {max_new} new tokens, greedy, {torch.get_num_threads()} CPU threads")
        for col in ("variant", "tok/s", "tokens/round", "draft share", "mean |A|", "== target greedy"):
            t.add_column(col, justify="left" if col == "variant" else "right")
        for r in res:
            t.add_row(r.variant, f"{r.tokens_per_s:.1f}", f"{r.tokens_per_round:.2f}", f"{100 * r.draft_share:.0f}%",
                      "" if r.active_size != r.active_size else f"{r.active_size:,.0f}", "yes" if r.identical else "NO")
            rows.append({"model": spec, "draft_layers": layers, **dataclasses.asdict(r)})
        console.print(t)
        del target, drafters, nano
    out.mkdir(parents=True, exist_ok=True)
    _e2e_plot(rows, out / f"{name}.png")
    meta = {"command": "nanospec-fx " + " ".join(sys.argv[1:]), "max_new": max_new, "draft_tokens": draft_tokens,
            "observe_topk": observe_topk, "capacity": capacity, "inductor": inductor,
            "observer": observer, "target_observer": {
                "processor": "LogitsProcessor on the target calling active_vocab(drafter).observe(top-k)",
                "api": "nanospec_fx.speculative_pair(target, drafter) (target compiled in place as observer)"}[observer],
            "machine": machine()}
    write_outputs(out, name, rows, meta)


def _e2e_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3), squeeze=False)
    for ax, m in zip(axes[0], models):
        rs = [r for r in rows if r["model"] == m]
        bars = ax.bar([r["variant"] for r in rs], [r["tokens_per_s"] for r in rs], color="tab:blue")
        for b, r in zip(bars, rs):
            ax.annotate(f"{r['tokens_per_round']:.2f} tok/rnd", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=6)
        ax.set_title(m, fontsize=9)
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", labelsize=6, rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------- explain
@main.command()
@click.option("--model", default="tiny-llama", show_default=True,
              help="gemma3-270m, smollm2-135m, a HF directory, a .gguf file, or tiny-llama (random weights, offline).")
@click.option("--capacity", default=3072, show_default=True)
@click.option("--prompt-tokens", default=32, show_default=True, help="Random prompt tokens fed once (they become active).")
@click.option("--rows", default="1,10", show_default=True, help="Rows for the predicted head speedup.")
@click.option("--inductor/--no-inductor", default=False, show_default=True, help="Compile the rest with inductor (slow on CPU).")
def explain(model, capacity, prompt_tokens, rows, inductor):
    """Compile a model with nanospec, run it once, print what the pass did and the cost model."""
    import nanospec_fx

    try:
        lm = _tiny_llama() if model == "tiny-llama" else loaders.load_model(model)
    except loaders.MissingAsset as e:
        fail(e)
    torch._dynamo.reset()
    compiled = torch.compile(lm, backend="nanospec", options={"capacity": capacity, "inductor": inductor})
    vocab = lm.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        compiled(ids)
    report = nanospec_fx.explain(lm)
    console.print(str(report), markup=False, highlight=False)
    for head in report.heads:
        for n_active in dict.fromkeys([max(len(head.state), 1), head.state.capacity]):
            preds = ", ".join(f"{head.cost.predict(r, n_active):.1f}x at {r} row(s)" for r in _ints(rows))
            console.print(f"  predicted {head.name} speedup with {n_active} active tokens: {preds}", markup=False)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


if __name__ == "__main__":
    main()
