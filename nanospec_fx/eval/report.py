"""What every measuring verb shares: the terminal, thread and device choice, failures, and its outputs
(JSON with how the rows were made, CSV, PNG plots)."""
from __future__ import annotations

import csv
import json
import os
import platform
import sys
from pathlib import Path

from rich.console import Console

console = Console(width=None if sys.stdout.isatty() else 160)


def set_threads(n: int | None) -> None:
    import torch

    torch.set_num_threads(n or min(2, os.cpu_count() or 1))


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def machine() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
            "device": "cuda:" + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def command_line() -> str:
    return "nanospec-fx " + " ".join(sys.argv[1:])


def write_outputs(out: Path, name: str, rows: list[dict], meta: dict) -> None:
    """``name.json`` (rows + how they were made) and ``name.csv`` (rows)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if rows:
        with open(out / f"{name}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    written = ".json, .csv" + (", .png" if (out / f"{name}.png").exists() else "")
    console.print(f"wrote {(out / name).resolve()}{written}", markup=False, highlight=False)


def fail(err: Exception | str) -> None:
    """Print ``error: ...`` (as plain text: messages hold ``[eval]``-like brackets) and exit with 2."""
    console.print("[red]error:[/red] ", end="")
    console.print(str(err), markup=False, highlight=False)
    sys.exit(2)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def progress():
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=console)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_plot(rows: list[dict], label: str, value: str, path: Path, ylabel: str, title: str) -> None:
    plt = pyplot()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar([r[label] for r in rows], [r[value] for r in rows], color="tab:blue")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=7)
    ax.tick_params(axis="x", labelsize=7, rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
