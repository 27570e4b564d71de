"""What every measuring verb shares: the terminal, thread and device choice, failures, and its outputs
(JSON with how the rows were made, CSV, PNG plots)."""
from __future__ import annotations

import csv
import hashlib
import json
import platform
import subprocess
import sys
from pathlib import Path

from rich.console import Console

# markup off: variant labels ("... [observe accepted]") and messages ("the [eval] extra") hold brackets that rich
# would otherwise take for style tags and silently drop, from printed lines and table cells alike.
console = Console(width=None if sys.stdout.isatty() else 160, markup=False)


_START_LOAD: list[float] | None = None  # the load average when the measuring verb started (set_threads)
_OVERSUBSCRIBED: str | None = None  # what set_threads found: torch's threads exceed the free cores


def set_threads(n: int | None, timed: bool = True) -> None:
    """Torch's CPU threads for this verb; also the verb's start, whose load average the JSON records, and where
    threads that exceed the cores the machine leaves free are said (cores.oversubscription), for a verb that
    prints timings (``timed``; ``coverage`` times nothing: its JSON still records the load)."""
    import torch

    from nanospec_fx.eval import cores

    global _START_LOAD, _OVERSUBSCRIBED
    torch.set_num_threads(n or min(2, cores.usable_cores()))
    _START_LOAD, _OVERSUBSCRIBED = cores.check(torch.get_num_threads())
    if _OVERSUBSCRIBED and timed:
        warn(_OVERSUBSCRIBED)


def warn(message: str) -> None:
    """Print ``warning: ...`` (the run goes on)."""
    console.print("warning: ", style="yellow", end="")
    console.print(message, highlight=False)


def file_digest(path: Path) -> str | None:
    """sha256 of a file (a drafter checkpoint), None when it is missing."""
    if not Path(path).is_file():
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def provenance() -> dict:
    """What a results JSON needs to be traced and trusted: the code (git commit, and whether the tree had
    uncommitted changes), the library versions, the threads, and how busy the machine was at start and end."""
    import torch

    from nanospec_fx.eval import cores

    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": _git("rev-parse", "HEAD"), "git_dirty": None if status is None else bool(status),
            "nanospec_fx": _package_version(), "torch": torch.__version__, "transformers": tf_version,
            "python": platform.python_version(), "threads": torch.get_num_threads(),
            "load_average_start": _START_LOAD, "load_average_end": cores.load_average(),
            "oversubscribed": _OVERSUBSCRIBED}


def _package_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nanospec-fx")
    except PackageNotFoundError:
        return None


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
    return {"cpu": cpu, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version(),
            "device": "cuda:" + torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}


def command_line() -> str:
    return "nanospec-fx " + " ".join(sys.argv[1:])


def write_outputs(out: Path, name: str, rows: list[dict], meta: dict, **sections: list) -> None:
    """``name.json`` (rows, how they were made with their provenance, and any further ``sections``, e.g. the
    per-request measurements) and ``name.csv`` (rows)."""
    out.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "provenance": provenance()}
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows, **sections}, indent=1))
    if rows:
        with open(out / f"{name}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    written = ".json, .csv" + (", .png" if (out / f"{name}.png").exists() else "")
    console.print(f"wrote {(out / name).resolve()}{written}", highlight=False)
    if _OVERSUBSCRIBED:  # said again under the table, which it concerns
        warn(_OVERSUBSCRIBED)


def fail(err: Exception | str) -> None:
    """Print ``error: ...`` and exit with 2."""
    console.print("error: ", style="red", end="")
    console.print(str(err), highlight=False)
    sys.exit(2)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def progress():
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}", markup=False), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console)


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
