"""Both ranks of a two-process gloo scenario of tp_worker.py, run as subprocesses: what the slow tensor-parallel
tests compare across ranks. A hang ends in a failure at the timeout, never in a stuck suite."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TP = 2


def run_ranks(scenario: str, timeout: float = 420) -> list[dict]:
    """Both ranks of ``scenario`` (tp_worker.py) as subprocesses, meeting at a file store; fails (never hangs) past
    ``timeout``. A rank killed by a signal (an allocator abort) prints every thread's Python stack first
    (``PYTHONFAULTHANDLER``), and the failure says where it was (:func:`killed_rank_report`)."""
    worker = Path(__file__).with_name("tp_worker.py")
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        procs = [subprocess.Popen([sys.executable, str(worker), scenario, str(r), str(TP), store], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(TP)]
        outputs = []
        try:
            for p in procs:
                outputs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{scenario}: the ranks did not finish within {timeout} s (a hang)")
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        if p.returncode == -6 and "malloc()" in out:  # a known open defect (issue 40), said as such, never a pass
            pytest.xfail(f"{scenario}: rank {rank} aborted in the allocator (heap corruption, intermittent since the "
                         "merge of the TP check-in and the fused observe; open, issue 40): "
                         + killed_rank_report(out))
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n" + (
            killed_rank_report(out) if p.returncode < 0 else out[-4000:])  # < 0: killed by a signal
    return [json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]) for out in outputs]


def killed_rank_report(out: str) -> str:
    """Where a rank killed by a signal was, from its output: whether it had finished its scenario (its ``RESULT``
    line printed: killed in the teardown, after every check passed) or not, the C library's message, and the stack
    of the thread that took the signal as faulthandler prints it, each other thread's innermost frame, and the
    output before the fatal error. The tail of the output alone is mostly faulthandler's list of extension modules,
    which says nothing of where the rank was."""
    fatal = out.find("Fatal Python error")
    before, dump = (out, "") if fatal < 0 else (out[:fatal], out[fatal:])
    finished = any(ln.startswith("RESULT ") for ln in before.splitlines())
    where = "after its scenario finished (RESULT printed: in the teardown)" if finished else "during its scenario"
    libc = [ln for ln in before.splitlines()[-20:] if re.search(r"malloc|free\(\)|corrupted|terminate called", ln)]
    blocks = re.split(r"\n\s*\n", dump)
    current = next((b.strip() for b in blocks if b.lstrip().startswith("Current thread")), "")
    others = [b.strip().splitlines()[:2] for b in blocks if b.lstrip().startswith("Thread 0x")]
    lines = [f"killed {where}", *libc[-3:], dump.splitlines()[0] if dump else "no faulthandler output",
             current or "no stack of the current thread",
             *(f"other thread: {' / '.join(s.strip() for s in b)}" for b in others),
             "output before the fatal error:", before[-1500:]]
    return "\n".join(lines)
