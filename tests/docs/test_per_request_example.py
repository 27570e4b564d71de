"""examples/per_request.py runs and says what it should."""
from __future__ import annotations

import pytest

from helpers import run_python


@pytest.mark.slow  # a fresh interpreter (imports torch): like the other examples' tests
def test_per_request_example():
    out = run_python(None, "examples/per_request.py").stdout
    assert out.count("logits equal the full head's there: True") == 3
    assert "row 1 (req-B): active tokens [7, 8, 9]" in out
    assert "isolation: a token of req-A is never active for req-B: True" in out
    assert "req-A now holds [3, 5, 17, 42, 99]" in out and "req-B now holds [4, 5, 7, 8, 9]" in out
    assert "req-C got row 0, holding 0 tokens after release: True" in out
