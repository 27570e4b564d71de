"""The examples run and say what they should (small settings)."""
from __future__ import annotations

import pytest

from helpers import run_python


def run(*args: str) -> str:
    return run_python(None, *args).stdout


@pytest.mark.slow
def test_policies_example():
    out = run("examples/policies.py")
    assert "static   active=['the', '.', 'cat', 'dog']" in out
    assert "hybrid   active=['the', '.', 'a', 'dog', 'met', 'cat']" in out


@pytest.mark.slow
def test_assisted_generation_example():
    out = run("examples/assisted_generation.py", "--no-inductor", "--vocab", "3000", "--new-tokens", "8")
    assert out.count("assisted output == greedy target output: True") == 2
    assert "nanospec: 1 head(s) rewritten" in out


@pytest.mark.slow
def test_mtp_transformers_example():
    out = run("examples/mtp_transformers.py", "--no-inductor", "--new-tokens", "8")
    assert "MTP: output == greedy target output: True" in out
    assert "DFlash: output == greedy target output: True" in out


@pytest.mark.slow
def test_tensor_parallel_example():
    out = run("examples/tensor_parallel.py", "--no-inductor")
    assert "same active set and slot order on every rank: True" in out
    assert "logits == dense tensor-parallel drafter masked to the active set: True" in out


@pytest.mark.slow
def test_head_layouts_example():
    out = run("examples/head_layouts.py")
    for kind in ("[H, V] weight", "Medusa [K, V, H]", "int8 weight-only", "weight_norm"):
        assert f"{kind:18s} rewritten, exact: True, active tokens: 4" in out
    assert "column-normalised  dense: True" in out
