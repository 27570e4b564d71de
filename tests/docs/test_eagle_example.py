"""examples/eagle_drafting.py runs losslessly on its tiny fallback (what CI has: no trained drafter)."""
from __future__ import annotations

import pytest

from helpers import run_python


@pytest.mark.slow
def test_eagle_example_tiny_fallback_is_lossless():
    out = run_python(None, "examples/eagle_drafting.py", "--tiny", "--new-tokens", "8", "--vocab", "2000").stdout
    assert "tiny random Llama target" in out
    rows = [
        line.split()
        for line in out.splitlines()
        if line.split()[-1:] != [] and line.split()[0] in ("target", "full", "nanospec")
    ]
    lossless = [r for r in rows if "True" in r]
    assert len(lossless) == 6 and not any("False" in r for r in rows)
