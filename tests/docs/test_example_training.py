"""examples/train_drafter_body.py runs: the body learns through the frozen compact head, and a
load_state_dict afterwards is picked up without refresh()."""
from __future__ import annotations

import re

import pytest

from helpers import run_python


@pytest.mark.slow
def test_train_drafter_body_example():
    out = run_python(None, "examples/train_drafter_body.py").stdout
    losses = [float(x) for x in re.findall(r"loss (\S+)", out)]
    assert len(losses) == 4 and all(x < 10 for x in losses) and losses[-1] < losses[0] - 0.5
    assert "head gradient: None" in out
    assert "after load_state_dict, compiled == dense head on the active tokens: True" in out
