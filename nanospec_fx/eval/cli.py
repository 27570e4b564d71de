"""``nanospec-fx``: measure NanoSpec on real models and real text.

    nanospec-fx coverage      # how often the next token is in the active vocabulary, per task and policy
    nanospec-fx bench head    # LM-head time at real shapes: dense vs static 32k vs nanospec
    nanospec-fx bench draft   # one EAGLE-2 draft round with each head
    nanospec-fx e2e           # generate(assistant_model=...) with each drafter head, output checked
                              # (--drafter eagle: a trained EAGLE drafter on the target's KV cache)
    nanospec-fx e2e-merge     # the JSONs of `e2e --drafter eagle --shard K/N` pieces joined into the whole run
    nanospec-fx explain       # what the pass rewrote in a model, and the predicted head speedup
    nanospec-fx train-eagle   # train an EAGLE drafter for a target (features cached, resumable)

Every measuring verb prints a table and writes JSON, CSV and a PNG plot into ``--out``. The verbs
live in :mod:`nanospec_fx.eval.commands` and are imported only when run (``--help`` stays fast).
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path

import click

RESULTS_ENV = "NANOSPEC_FX_RESULTS"
DEFAULT_OUT = Path(os.environ.get(RESULTS_ENV, "nanospec-fx-results"))


def out_option(name: str):
    """``--out`` and ``--name``: where the JSON, CSV and PNG go (said in the help and after writing)."""
    def decorate(fn):
        fn = click.option("--name", default=name, show_default=True,
                          help="Stem of the output files (NAME.json, .csv, .png).")(fn)
        return click.option(
            "--out", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_OUT, show_default=True,
            help=f"Directory for the results (created if needed); relative paths are from the current directory. "
                 f"Default: ${RESULTS_ENV} if set, else ./nanospec-fx-results.")(fn)
    return decorate


def threads_option(fn):
    return click.option("--threads", type=int, default=None,
                        help="CPU threads for torch (default: min(2, CPU count)).")(fn)


def device_option(fn):
    return click.option("--device", default="auto", show_default=True,
                        help="cuda, cpu, or auto (cuda when available).")(fn)


class LazyGroup(click.Group):
    """A group whose subcommands are imported from ``module:attribute`` only when used or listed."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy = lazy or {}

    def list_commands(self, ctx):
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx, name):
        if name in self.lazy:
            module, attribute = self.lazy[name].split(":")
            return getattr(importlib.import_module(module), attribute)
        return super().get_command(ctx, name)


COMMANDS = "nanospec_fx.eval.commands"


@click.group(cls=LazyGroup, lazy={
    "coverage": f"{COMMANDS}.coverage:coverage",
    "bench": f"{COMMANDS}.bench:bench",
    "e2e": f"{COMMANDS}.e2e:e2e",
    "e2e-merge": f"{COMMANDS}.e2e_merge:e2e_merge",
    "explain": f"{COMMANDS}.explain:explain",
    "train-eagle": f"{COMMANDS}.train_eagle:train_eagle",
})
@click.version_option(package_name="nanospec-fx")
def main() -> None:
    """Measure NanoSpec (a dynamic active vocabulary for drafter LM heads) on real models and text."""


if __name__ == "__main__":
    main()
