"""What run_ranks says of a rank killed by a signal (issue 40's intermittent allocator abort): where it was, from a
real process that aborts with faulthandler on, as a gloo rank does."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from gloo_ranks import killed_rank_report  # noqa: E402

RANK = textwrap.dedent("""
    import os, sys, threading, time

    def gloo_worker_loop():  # another thread, as gloo's are
        time.sleep(60)

    def teardown():
        sys.stderr.write("malloc(): unaligned tcache chunk detected\\n")
        sys.stderr.flush()
        os.abort()

    def scenario():
        if sys.argv[1] == "teardown":
            print("RESULT {}", flush=True)
        else:
            print("checking", flush=True)
            teardown_in_scenario()

    def teardown_in_scenario():
        teardown()

    threading.Thread(target=gloo_worker_loop, daemon=True).start()
    time.sleep(0.1)
    scenario()
    teardown()
""")


def _killed_rank(where: str) -> str:
    p = subprocess.run([sys.executable, "-c", RANK, where], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"}, timeout=60)
    assert p.returncode == -6
    return p.stdout


@pytest.mark.parametrize("where", ["teardown", "scenario"])
def test_a_killed_rank_is_reported_with_where_it_was(where):
    report = killed_rank_report(_killed_rank(where))
    lines = report.splitlines()
    assert lines[0] == ("killed after its scenario finished (RESULT printed: in the teardown)" if where == "teardown"
                        else "killed during its scenario")
    assert "malloc(): unaligned tcache chunk detected" in lines[1]
    current = report[report.index("Current thread"):report.index("other thread")]
    assert "in teardown" in current and ("in teardown_in_scenario" in current) == (where == "scenario")
    assert "in gloo_worker_loop" in report.split("other thread:")[1]  # the other thread's innermost frame
