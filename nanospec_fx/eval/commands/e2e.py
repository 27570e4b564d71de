"""``nanospec-fx e2e``: transformers' assisted generation with a self-speculative drafter and each head."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from nanospec_fx.eval.cli import out_option, threads_option
from nanospec_fx.eval.commands.sources import STATIC_CORPUS, disjoint_static_samples, load_option
from nanospec_fx.vocab.config import DEFAULT_CAPACITY, DEFAULT_STATIC_SIZE


def _shard(ctx, param, text: str | None) -> tuple[int, int] | None:
    """``--shard K/N`` -> ``(K, N)`` with ``0 <= K < N``."""
    if text is None:
        return None
    k, _, n = text.partition("/")
    if not (k.strip().isdigit() and n.strip().isdigit()) or not 0 <= int(k) < int(n):
        raise click.BadParameter(f"takes K/N with 0 <= K < N (e.g. 0/4 ... 3/4), got {text!r}")
    return int(k), int(n)


@click.command()
@click.option("--model", "models", multiple=True, default=("gemma3-270m", "smollm2-135m"), show_default=True,
              help="Target model (repeatable): gemma3-270m, smollm2-135m, a HF directory or a .gguf file.")
@click.option("--tokenizer", default=None, help="Tokenizer of the model (default: the model's own).")
@click.option("--draft-layers", default=None, type=int,
              help="Layers of the self-speculative drafter (default: a third).")
@click.option("--corpus", "corpora", multiple=True, default=(), show_default=False,
              help="Prompts: NAME[a:b] of a built-in corpus or a JSON/JSONL file (repeatable). Default: "
                   "sharegpt[:3] and humaneval[:3]; with --drafter eagle the six task categories, [:8] each.")
@click.option("--drafter", type=click.Choice(["truncated", "eagle"]), default="truncated", show_default=True,
              help="truncated: the target's first layers, through transformers' assisted generation. eagle: the "
                   "EAGLE (or MTP) drafter trained by `nanospec-fx train-eagle`, chain drafts on the target's KV cache "
                   "(nanospec_fx.eagle.speculative), variants full / static / nanospec context / hybrid.")
@click.option("--depth", "depths", multiple=True, type=int, default=(1, 2, 3, 4), show_default=True,
              help="--drafter eagle: drafts per round (repeatable: each depth is measured).")
@click.option("--variants", default="full,static,context,hybrid", show_default=True,
              help="--drafter eagle: drafter heads to measure: full, static, context, hybrid, and two references: "
                   "full-every-row (the full head scoring every fed position, as runs before 2026-12 did), body "
                   "(no head: the drafter body's own time per round, which a head restriction can approach) and "
                   "body-replayed (the body given the first nanospec variant's accepted lengths: the same rows).")
@click.option("--observe", default="verified", show_default=True,
              help="--drafter eagle: where the target's top-k joins the active set: every verified position "
                   "(rejected drafts included, as in the paper), the accepted ones only, or nowhere (none). A comma "
                   "list (verified,accepted) runs each nanospec head under each, paired on the same requests.")
@click.option("--paired-prompt-topk", is_flag=True, default=False,
              help="--drafter eagle: run each nanospec head both without and with --prompt-topk, paired on the same "
                   "requests (instead of comparing two separate runs).")
@click.option("--repeats", default=1, show_default=True, type=int,
              help="--drafter eagle: decode every request this many times (the order of the variants rotated per "
                   "request and repeat); ratios are medians over requests with a 95% bootstrap interval.")
@click.option("--shard", default=None, callback=_shard,
              help="--drafter eagle: K/N decodes only the requests whose index in the whole list is K mod N "
                   "(0 <= K < N), rotated and keyed as in the whole run; `nanospec-fx e2e-merge` joins the N JSONs "
                   "into the whole run's (a long run done in pieces).")
@click.option("--prompt-topk/--no-prompt-topk", default=False, show_default=True,
              help="--drafter eagle: also seed the active set with the target's top-k at every prompt position (the "
                   "paper's seed; costs the target's head over the whole prompt at prefill, ~0.5 s per 256 tokens "
                   "on 2 CPU cores).")
@click.option("--eagle-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="--drafter eagle: folder of the trained drafter (default: train-eagle's cache for --model).")
@click.option("--static-corpus", default=STATIC_CORPUS, show_default=True,
              help="Where the FR-Spec static head's frequency table is counted.")
@click.option("--static-n", default=DEFAULT_STATIC_SIZE, show_default=True, help="Rows of the FR-Spec static head.")
@click.option("--capacity", default=DEFAULT_CAPACITY, show_default=True,
              help="Capacity of the nanospec drafter's active vocabulary.")
@click.option("--observe-topk", default=3, show_default=True,
              help="Target top-k added to the active set per verified position.")
@click.option("--max-prompt", default=256, show_default=True, help="Keep the last N prompt tokens.")
@click.option("--max-new", default=None, type=int,
              help="New tokens generated per prompt (default: 64; 128 with --drafter eagle).")
@click.option("--draft-tokens", default=6, show_default=True, help="Tokens drafted per round (constant schedule).")
@click.option("--observer", type=click.Choice(["processor", "api"]), default="processor", show_default=True,
              help="How the target's top-k reaches the drafter: a LogitsProcessor on the target (verified positions; "
              "the target stays eager), or nanospec_fx.speculative_pair (the target compiled in place as an observer: "
              "every scored position, prefill included).")
@click.option("--inductor/--no-inductor", default=False, show_default=True,
              help="Compile the nanospec drafter's graph with inductor (slow to compile on CPU) or run it eagerly.")
@click.option("--compile-all", type=click.Choice(["eager", "inductor"]), default=None,
              help="--drafter eagle, like for like: every variant through torch.compile, the dense ones too (eager: "
                   "Dynamo without inductor everywhere; inductor: inductor everywhere; overrides --inductor). "
                   "Without it only the nanospec variants are compiled, and they alone pay Dynamo's entry.")
@out_option("e2e")
@threads_option
def e2e(models, tokenizer, draft_layers, corpora, drafter, depths, variants, observe, paired_prompt_topk, repeats,
        shard, prompt_topk, eagle_dir, static_corpus, static_n, capacity, observe_topk, max_prompt, max_new, draft_tokens,
        observer, inductor, compile_all, out, name, threads):
    """Speculative decoding end to end with each drafter head (full, FR-Spec static, nanospec), output checked.

    --drafter truncated (default): generate(assistant_model=...) with a layer-truncated drafter.
    --drafter eagle: a trained EAGLE drafter (`nanospec-fx train-eagle`) on the target's KV cache.
    An output that differs from the target's greedy output fails the run (exit status 2), after the JSON,
    which lists every request, is written.
    """
    if drafter == "eagle":
        from nanospec_fx.eval.commands.e2e_eagle import run

        return run(models=models, tokenizer=tokenizer, corpora=corpora, depths=depths, variants=variants,
                   observe=observe, prompt_topk=prompt_topk,
                   eagle_dir=eagle_dir, static_corpus=static_corpus, static_n=static_n, capacity=capacity,
                   observe_topk=observe_topk, max_prompt=max_prompt, max_new=max_new or 128, inductor=inductor, out=out,
                   name=name, threads=threads, repeats=repeats, paired_prompt_topk=paired_prompt_topk,
                   shard=shard or (0, 1), compile_all=compile_all)
    if shard:
        raise click.UsageError("--shard needs --drafter eagle")
    corpora, max_new = corpora or ("sharegpt[:3]", "humaneval[:3]"), max_new or 64
    import torch
    from rich.table import Table

    from nanospec_fx import FrequencyTable
    from nanospec_fx.eval import loaders
    from nanospec_fx.eval.bench import e2e as B
    from nanospec_fx.eval.report import command_line, console, fail, machine, progress, set_threads, write_outputs

    set_threads(threads)
    rows, per_request, statics = [], [], {}
    for spec in models:
        try:
            target = load_option("--model", loaders.load_model, spec)
            tok = load_option("--tokenizer", loaders.load_tokenizer, tokenizer or spec)
            samples = [s for c in corpora for s in load_option("--corpus", loaders.load_corpus, c)]
            static_samples = load_option("--static-corpus", loaders.load_corpus, static_corpus)
        except loaders.MissingAsset as e:
            fail(e)
        vocab = target.get_output_embeddings().weight.shape[0]
        layers = draft_layers or max(1, target.config.num_hidden_layers // 3)
        prompts = [tok.encode(s.prompt, bos=True)[-max_prompt:] for s in samples]
        static_samples, statics[spec] = disjoint_static_samples(static_samples, samples, static_corpus)
        n_static = min(static_n, vocab)
        table = FrequencyTable.from_token_ids(
            (tok.encode(s.prompt) + tok.encode(s.continuation) for s in static_samples), vocab).top(n_static)
        weight = target.get_output_embeddings().weight
        torch._dynamo.reset()
        nano = B.truncated_drafter(target, layers)
        if observer == "processor":
            nano.compile(backend="nanospec", options={"capacity": capacity, "inductor": inductor})
        drafters = {
            "full head": B.truncated_drafter(target, layers),
            f"static-{n_static}": B.truncated_drafter(target, layers, B.StaticHead(weight, table)),
            f"nanospec@{capacity}": nano,
        }
        with progress() as prog:
            task = prog.add_task(spec, total=len(drafters) + 1)
            res = B.run_e2e(target, prompts, drafters, max_new, draft_tokens, observe_topk,
                            progress=lambda s: prog.update(task, advance=1, description=f"{spec}: {s}"),
                            pair=None if observer == "processor" else dict(capacity=capacity, inductor=inductor),
                            requests=per_request)
        for r in per_request:
            r.setdefault("model", spec)
        t = Table(title=f"{spec} (V={vocab:,}), drafter = first {layers} of {target.config.num_hidden_layers} layers + "
                        f"shared head, {len(prompts)} prompts x {max_new} new tokens, greedy, "
                        f"{torch.get_num_threads()} CPU threads")
        for col in ("variant", "tok/s", "tokens/round", "draft share", "mean |A|", "== target greedy"):
            t.add_column(col, justify="left" if col == "variant" else "right")
        for r in res:
            t.add_row(r.variant, f"{r.tokens_per_s:.1f}", f"{r.tokens_per_round:.2f}", f"{100 * r.draft_share:.0f}%",
                      "" if r.active_size != r.active_size else f"{r.active_size:,.0f}", "yes" if r.identical else "NO")
            rows.append({"model": spec, "draft_layers": layers, **dataclasses.asdict(r)})
        console.print(t)
        del target, drafters, nano
    out.mkdir(parents=True, exist_ok=True)
    _plot(rows, out / f"{name}.png")
    meta = {"command": command_line(), "max_new": max_new, "draft_tokens": draft_tokens,
            "observe_topk": observe_topk, "capacity": capacity, "inductor": inductor,
            "observer": observer, "target_observer": {
                "processor": "LogitsProcessor on the target calling active_vocab(drafter).observe(top-k)",
                "api": "nanospec_fx.speculative_pair(target, drafter) (target compiled in place as observer)",
            }[observer],
            "static_table": statics, "machine": machine()}
    write_outputs(out, name, rows, meta, requests=per_request)
    bad = [r for r in per_request if not r["identical"]]
    if bad:
        fail(f"{len(bad)} request(s) decoded with a drafter differ from the target's greedy output (lossless decoding "
             f"is broken), e.g. {bad[0]['variant']} on request {bad[0]['request']}; each is listed in the JSON")


def _plot(rows: list[dict], path: Path) -> None:
    from nanospec_fx.eval.report import pyplot

    plt = pyplot()
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
