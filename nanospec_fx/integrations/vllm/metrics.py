"""What the plugin reports: its heads' counters, record files, and whether it is active at all.

"Never silently inactive": the adapters count the model steps of this process (a hook every runner reaches) and the
calls of the drafter hooks; once ``NANOSPEC_VLLM_ACTIVE_AFTER`` steps ran with no drafter hook call, :func:`status`
says ``inactive`` and one warning names the runner and the remedy. No vLLM here.
"""
from __future__ import annotations

import json
import os
import threading
import weakref
from pathlib import Path

_LOCK = threading.Lock()
_HEADS: weakref.WeakSet = weakref.WeakSet()


def warn(message: str) -> None:
    from nanospec_fx.warning import warn_once

    warn_once(f"nanospec (vLLM): {message}", stacklevel=4)


def add_head(head) -> None:
    with _LOCK:
        _HEADS.add(head)


def heads() -> list:
    """The NanoSpec heads of this process (one per loaded drafter): counters and sets, for tests and metrics."""
    return list(_HEADS)


class Activity:
    """This process's evidence that the hooks run: model steps seen, drafter hook calls, and the verdict."""

    def __init__(self):
        self.steps = 0  # model steps this process ran (any runner)
        self.hook_calls = 0  # calls of the drafter hooks (the V1 runner's propose step)
        self.runner: str | None = None  # the model runner's class, as seen at a step
        self.reason: str | None = None  # why the plugin is inactive (None: active or not known yet)

    def status(self) -> str:
        """``active`` (a drafter hook ran), ``inactive`` (:attr:`reason` says why) or ``pending`` (too few steps)."""
        if self.reason is not None:
            return "inactive"
        return "active" if self.hook_calls else "pending"

    def hooked(self) -> None:
        self.hook_calls += 1

    def step(self, runner_name: str, limit: int, remedy: str) -> None:
        """One model step ran on ``runner_name``; after ``limit`` steps with no drafter hook call, say so once."""
        self.steps += 1
        self.runner = runner_name
        if self.hook_calls or self.reason is not None or self.steps < limit:
            return
        self.reason = (f"NANOSPEC_VLLM=1 but the plugin is inactive: {self.steps} model steps ran on "
                       f"{runner_name} and none reached its drafter hooks, so no drafter uses a NanoSpec head "
                       f"(vLLM runs unchanged). {remedy}")
        warn(self.reason)

    def as_dict(self) -> dict:
        return {"status": self.status(), "steps": self.steps, "hook_calls": self.hook_calls, "runner": self.runner,
                "reason": self.reason}


ACTIVITY = Activity()


def status() -> dict:
    """This process's plugin status (``status``: active / inactive / pending, with the steps and hook calls)."""
    return ACTIVITY.as_dict()


def snapshot(head) -> dict:
    """A head's counters, released sets and held rows, with the plugin's status, as plain data."""
    import nanospec_fx

    return {"rank": head.rank, "pid": os.getpid(), "module": nanospec_fx.__file__, "compact_calls":
            head.compact_calls, "dense_calls": head.dense_calls, "assigned": head.assigned, "released":
            head.released, "checked": head.checked, "disabled": head.disabled, "sharded": head.group_name
            is not None, "holding": [str(r) for r in head.vocabs.request_ids],
            "released_sets": head.released_sets, "active_sizes": head.active_sizes, "plugin": status()}


def write_record(head) -> None:
    """Write :func:`snapshot` to ``NANOSPEC_VLLM_RECORD_DIR/nanospec-head-rank{rank}-{pid}.json`` (replaced
    atomically): vLLM's workers are other processes under tensor parallelism, this is how tests read them."""
    path = Path(head.record_dir) / f"nanospec-head-rank{head.rank}-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(snapshot(head)))
    tmp.replace(path)
