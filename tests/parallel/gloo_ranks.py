"""Both ranks of a two-process gloo scenario of tp_worker.py, run as subprocesses: what the slow tensor-parallel
tests compare across ranks. A hang ends in a failure at the timeout, never in a stuck suite."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TP = 2


def run_ranks(scenario: str, timeout: float = 420) -> list[dict]:
    """Both ranks of ``scenario`` (tp_worker.py) as subprocesses, meeting at a file store; fails (never hangs) past
    ``timeout``. A rank killed by a signal (an allocator abort) prints every thread's Python stack first
    (``PYTHONFAULTHANDLER``), and the failure shows it."""
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
                         "merge of the TP check-in and the fused observe; open, issue 40):\n" + out[-1000:])
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out[-4000:]}"
    return [json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]) for out in outputs]
