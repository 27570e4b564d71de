"""A timed verb whose torch threads exceed the cores the machine leaves free says so, at its start, under its
table and in its JSON; the load average and the cores are injected (nanospec_fx.eval.cores), never read."""
import json

import pytest
import torch
from click.testing import CliRunner

from nanospec_fx.eval import cli, cores


@pytest.mark.parametrize("threads, load, n_cores, processes, free, said", [
    (2, 0.3, 2, 1, 2, False),   # an idle 2-core machine: 2 threads fit
    (2, 1.2, 2, 1, 1, True),    # one core busy with other work
    (2, 8.4, 2, 1, 0, True),    # the shared machine of the report: 0.6 instead of 7.9 tok/s
    (1, 8.4, 2, 1, 0, True),    # even one thread shares a core
    (1, 0.0, 2, 3, 2, True),    # three processes of one thread each on 2 idle cores
    (4, 2.0, 8, 1, 6, False),
    (2, None, 2, 1, 2, False),  # no load average on this system: the cores alone decide
])
def test_oversubscription_counts_threads_processes_and_load(threads, load, n_cores, processes, free, said):
    assert cores.free_cores(load, n_cores) == free
    message = cores.oversubscription(threads, load, n_cores, processes)
    assert (message is not None) == said
    if said:
        assert f"on {n_cores} cores" in message and f"({free} free)" in message and "idle machine" in message
        fewer = max(1, free // processes)
        assert (f"--threads {fewer}" in message) == (fewer < threads)  # fewer threads only where that helps


def bench_head(tmp_path, threads):
    result = CliRunner().invoke(cli.main, [str(a) for a in (
        "bench", "head", "--shapes", "32x500", "--active", "32", "--static-n", "64", "--repeats", "1",
        "--no-inductor", "--out", tmp_path, "--threads", threads)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split()), json.loads((tmp_path / "bench-head.json").read_text())


def test_a_busy_machine_is_said_at_the_start_under_the_table_and_in_the_json(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.setattr(cores, "load_average", lambda: [8.4, 8.0, 7.5])
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    try:
        output, data = bench_head(tmp_path, 2)
    finally:
        torch.set_num_threads(threads)
    said = "oversubscribed: 2 threads on 2 cores with a 1-minute load average of 8.4 (0 free)"
    assert output.count(said) == 2  # at the start, and again under the table
    assert output.index(said) < output.index("median ms") < output.rindex(said)
    prov = data["meta"]["provenance"]
    assert prov["oversubscribed"].startswith(said) and prov["load_average_start"] == [8.4, 8.0, 7.5]


def test_an_idle_machine_says_nothing(tmp_path):
    threads = torch.get_num_threads()
    try:
        output, data = bench_head(tmp_path, 2)  # tests/eval/conftest.py: 2 cores, load 0.25
    finally:
        torch.set_num_threads(threads)
    assert "oversubscribed" not in output and data["meta"]["provenance"]["oversubscribed"] is None
