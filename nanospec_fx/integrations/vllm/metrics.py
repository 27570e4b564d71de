"""What the plugin reports: its heads' counters, record files, and whether it is active at all.

"Never silently inactive": the adapters count each model runner's steps (at a hook every runner reaches) and its
drafter steps through a NanoSpec head; once ``NANOSPEC_VLLM_ACTIVE_AFTER`` steps ran with none, :func:`status` says
``inactive`` and one warning names the runner and the remedy. No vLLM here.
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
    from nanospec_fx.diagnostics.warning import warn_once

    warn_once(f"nanospec (vLLM): {message}", stacklevel=4)


def add_head(head) -> None:
    with _LOCK:
        _HEADS.add(head)


def heads() -> list:
    """The NanoSpec heads of this process (one per loaded drafter): counters and sets, for tests and metrics."""
    return list(_HEADS)


class Activity:
    """One model runner's evidence that the hooks run: model steps seen, drafter hook calls, and the verdict."""

    def __init__(self):
        self.steps = 0  # model steps with scheduled tokens (any runner)
        self.hook_calls = 0  # drafter steps through a NanoSpec head
        self.runner: str | None = None  # the model runner's class, as seen at a step
        self.reason: str | None = None  # why the plugin is inactive (None: active or not known yet)

    def status(self) -> str:
        """``active`` (a drafter step went through a NanoSpec head), ``inactive`` (:attr:`reason` says why) or
        ``pending`` (too few steps yet)."""
        if self.hook_calls:
            return "active"
        return "pending" if self.reason is None else "inactive"

    def hooked(self) -> None:
        self.hook_calls += 1

    def explained(self, reason: str) -> None:
        """Inactive for a reason a warning has given already (an unsupported drafter)."""
        if self.reason is None:
            self.reason = reason

    def step(self, runner_name: str, limit: int, remedy) -> None:
        """One model step ran on ``runner_name``; after ``limit`` steps with no drafter step through a NanoSpec
        head, say so once (``remedy()``: what the user can do)."""
        self.steps += 1
        self.runner = runner_name
        if self.hook_calls or self.reason is not None or self.steps < limit:
            return
        self.reason = (f"NANOSPEC_VLLM=1 but the plugin is inactive: {self.steps} model steps ran on "
                       f"{runner_name} and no drafter step went through a NanoSpec head (vLLM runs unchanged). "
                       f"{safe_remedy(remedy)}")
        warn(self.reason)

    def as_dict(self) -> dict:
        return {"status": self.status(), "steps": self.steps, "hook_calls": self.hook_calls, "runner": self.runner,
                "reason": self.reason}


def safe_remedy(remedy) -> str:
    """``remedy()``, or a sentence saying it could not be worked out: the warning runs inside vLLM's model step,
    where an exception of the plugin's own (a module a release removed, an attribute it renamed) would stop the
    engine instead of informing."""
    try:
        return remedy()
    except Exception as e:  # noqa: BLE001 - the step must go on; the warning names what failed
        return (f"(The plugin could not work out the remedy here: {type(e).__name__}: {e}.) Unset NANOSPEC_VLLM to "
                "run vLLM without NanoSpec")


_ACTIVITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def activity_of(runner) -> Activity:
    """The :class:`Activity` of one model runner (created on first use; gone with the runner)."""
    with _LOCK:
        activity = _ACTIVITIES.get(runner)
        if activity is None:
            activity = _ACTIVITIES[runner] = Activity()
        return activity


def status() -> list[dict]:
    """The plugin's status on each live model runner of this process (``status``: active / inactive / pending,
    with the steps counted, the drafter steps through a NanoSpec head, the runner's class and the reason)."""
    with _LOCK:
        return [a.as_dict() for a in _ACTIVITIES.values()]


def snapshot(head) -> dict:
    """A head's counters, released sets and held rows, with the plugin's status, as plain data (``module``: the
    installed nanospec_fx package's ``__init__.py``, to tell which copy the engine's processes import)."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return {"rank": head.rank, "pid": os.getpid(), "module": os.path.join(package, "__init__.py"), "compact_calls":
            head.compact_calls, "dense_calls": head.dense_calls, "assigned": head.assigned, "released":
            head.released, "checked": head.checked, "disabled": head.disabled, "sharded": head.group_name
            is not None, "holding": [str(r) for r in head.vocabs.request_ids],
            "released_sets": head.released_sets, "active_sizes": head.active_sizes}


def write_record(head) -> None:
    """Write :func:`snapshot` to ``NANOSPEC_VLLM_RECORD_DIR/nanospec-head-rank{rank}-{pid}.json`` (replaced
    atomically): vLLM's workers are other processes under tensor parallelism, this is how tests read them."""
    path = Path(head.record_dir) / f"nanospec-head-rank{head.rank}-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(snapshot(head)))
    tmp.replace(path)
