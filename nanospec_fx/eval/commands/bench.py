"""``nanospec-fx bench head`` and ``bench draft``: LM-head and draft-round timing at real shapes."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from nanospec_fx.eval.cli import device_option, out_option, threads_option
from nanospec_fx.vocab.config import DEFAULT_CAPACITY, DEFAULT_STATIC_SIZE

DTYPES = ("fp32", "bf16", "fp16")
DRAFTER_SHAPES = ("llama3-8b", "tiny")


def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


@click.group()
def bench() -> None:
    """Timing at real shapes: the LM head alone, or a whole draft round."""


def _shapes(names: str) -> list[tuple[str, int, int]]:
    from nanospec_fx.eval.bench.head import SHAPES

    out = []
    for name in names.split(","):
        if name in SHAPES:
            out.append((name, *SHAPES[name]))
        elif "x" in name:  # HxV
            h, v = name.split("x")
            out.append((name, int(h), int(v)))
        else:
            raise click.BadParameter(f"unknown shape {name!r}: use {', '.join(SHAPES)} or HxV", param_hint="--shapes")
    return out


def head_variant_options(fn):
    """The options both benchmarks share: which heads are timed, in which dtype."""
    for option in reversed([
        click.option("--active", default=DEFAULT_CAPACITY, show_default=True,
                     help="Active vocabulary size (= capacity)."),
        click.option("--static-n", default=DEFAULT_STATIC_SIZE, show_default=True,
                     help="Rows of the FR-Spec static head."),
        click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True,
                     help="Weight and activation dtype."),
        click.option("--compiled/--no-compiled", default=True, show_default=True,
                     help="Also time the head through torch.compile(backend='nanospec')."),
        click.option("--inductor/--no-inductor", default=True, show_default=True,
                     help="Compile the rewritten head with inductor (else run it eagerly)."),
    ]):
        fn = option(fn)
    return fn


@bench.command("head")
@click.option("--shapes", default="llama3-8b,qwen2-7b,gemma3-270m,gemma3-27b", show_default=True,
              help="Comma-separated model names or HxV (hidden x vocabulary).")
@click.option("--rows", default="1,10", show_default=True, help="Hidden-state rows per call (comma-separated).")
@click.option("--repeats", default=10, show_default=True, help="Timed calls per variant (at least; medians reported).")
@click.option("--sweep", default="256,1024,3072,8192,32768", show_default=True,
              help="Active sizes for the head-time-vs-size plot (first shape only; empty: none).")
@head_variant_options
@device_option
@out_option("bench-head")
@threads_option
def bench_head(shapes, active, static_n, rows, repeats, dtype, compiled, inductor, sweep, device, out, name, threads):
    """Head time: dense vs static top-N vs nanospec at one active size, 1 and 10 rows."""
    from rich.table import Table

    from nanospec_fx.eval.bench import head as B
    from nanospec_fx.eval.report import (command_line, console, ints, machine, progress, resolve_device, set_threads,
                                         write_outputs)

    set_threads(threads)
    device = resolve_device(device)
    shape_list, row_list = _shapes(shapes), tuple(ints(rows))
    results = []
    with progress() as prog:
        task = prog.add_task("head", total=len(shape_list) * len(row_list) * (4 + compiled))
        for shape, h, v in shape_list:  # sizes past the vocabulary mean the whole vocabulary
            results += B.bench_head(shape, h, v, min(active, v), min(static_n, v), row_list, repeats,
                                    torch_dtype(dtype), compiled, device,
                                    progress=lambda s: prog.update(task, advance=1, description=s), inductor=inductor)
        sweep_rows = []
        if ints(sweep):
            shape, h, v = shape_list[0]
            task = prog.add_task("sweep", total=len(row_list) * len(ints(sweep)))
            sweep_rows = B.bench_head_sweep(shape, h, v, sorted({min(n, v) for n in ints(sweep)}), row_list, repeats,
                                            torch_dtype(dtype), device,
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
    meta = {"command": command_line(), "dtype": dtype, "device": device, "repeats": repeats,
            "nanospec_ops": "reference (torch) on CPU; Triton kernels on CUDA (NANOSPEC_KERNELS)", "machine": machine()}
    write_outputs(out, name, [dataclasses.asdict(r) for r in results + sweep_rows], meta)


def _head_plot(sweep_rows, results, path: Path, title: str) -> None:
    from nanospec_fx.eval.report import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for rows in sorted({r.rows for r in sweep_rows}):
        pts = sorted((r.size, r.ms) for r in sweep_rows if r.rows == rows and r.variant != "dense")
        line, = ax.plot(*zip(*pts), marker="o", ms=3, label=f"nanospec compact, {rows} row(s)")
        dense = next(r.ms for r in sweep_rows if r.rows == rows and r.variant == "dense")
        ax.axhline(dense, ls="--", color=line.get_color(), lw=1, label=f"dense, {rows} row(s)")
        for r in results:
            if r.shape == sweep_rows[0].shape and r.rows == rows and r.variant.startswith("static"):
                ax.plot([r.size], [r.ms], marker="s", color=line.get_color(), ls="none",
                        label=f"{r.variant}, {rows} row(s)")
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
@click.option("--shape", type=click.Choice(DRAFTER_SHAPES), default="llama3-8b", show_default=True,
              help="Drafter shape: llama3-8b (EAGLE's drafter of Llama-3.1-8B) or tiny (a smoke run).")
@click.option("--depth", default=6, show_default=True, help="Drafter calls per round (the root + depth-1 tree levels).")
@click.option("--topk", default=10, show_default=True, help="Frontier nodes per tree level (EAGLE-2's top-k).")
@click.option("--prefix", default=512, show_default=True, help="Tokens already in the drafter's KV cache.")
@click.option("--repeats", default=5, show_default=True, help="Timed rounds per variant (median reported).")
@head_variant_options
@device_option
@out_option("bench-draft")
@threads_option
def bench_draft(shape, active, static_n, depth, topk, prefix, repeats, dtype, compiled, inductor, device, out, name,
                threads):
    """One EAGLE-2 draft round (nanospec_fx.eagle's drafter and tree) with the full, static and nanospec heads."""
    from rich.table import Table

    from nanospec_fx.eval.bench import draft as D
    from nanospec_fx.eval.report import (bar_plot, command_line, console, machine, progress, resolve_device,
                                         set_threads, write_outputs)

    set_threads(threads)
    device = resolve_device(device)
    config = D.DRAFTER_SHAPES[shape]()
    with progress() as prog:
        task = prog.add_task("draft", total=3 + compiled)
        rows = D.bench_draft(config, active, static_n, depth, topk, prefix, repeats, torch_dtype(dtype), device,
                             compiled, progress=lambda s: prog.update(task, advance=1, description=s),
                             inductor=inductor)
    t = Table(title=f"EAGLE-2 draft round, H={config.hidden_size} V={config.vocab_size:,}, depth {depth} x top-{topk}, "
                    f"{dtype}, {device}, median of {repeats}")
    for col in ("head", "round ms", "head ms", "head share", "vs full"):
        t.add_column(col, justify="left" if col == "head" else "right")
    for r in rows:
        t.add_row(r["variant"], f"{r['round_ms']:.1f}", f"{r['head_ms']:.1f}", f"{100 * r['head_share']:.0f}%",
                  f"{100 * r['vs_full']:+.1f}%")
    console.print(t)
    bar_plot(rows, "variant", "round_ms", out / f"{name}.png", "draft round ms", t.title)
    meta = {"command": command_line(), "config": dataclasses.asdict(config), "dtype": dtype,
            "device": device, "inductor": inductor, "machine": machine()}
    write_outputs(out, name, rows, meta)
