"""The pass's decisions are counted in ``torch._dynamo.utils.counters["nanospec"]`` and logged at debug level (as
inductor's passes do); the pass report is kept in ``nanospec_fx.vocab.reports``, not on the runtime state."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import nanospec_fx
from drafters import TinyDrafter
from helpers import compile_nanospec
from nanospec_fx.vocab import reports as pass_reports
from nanospec_fx.diagnostics.warning import NanoSpecWarning

V, H = 48, 8


class HeadInVmap(nn.Module):
    """The whole drafter under ``torch.vmap``: the head runs dense (its values are batched tensors)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, ids):
        return torch.vmap(lambda i: self.lm_head(self.embed(i)))(ids)


def test_a_rewritten_head_is_counted_with_its_observers_and_reported_beside_its_state(caplog):
    torch.manual_seed(0)
    model = TinyDrafter(97, 8).eval()
    counters.clear()
    with caplog.at_level(logging.DEBUG, logger="nanospec_fx.compiler"), torch.no_grad():
        compile_nanospec(model, capacity=8)(torch.randint(0, 97, (1, 4)))
    seen = counters["nanospec"]
    assert (seen["heads_found"], seen["heads_rewritten"], seen["heads_dense"]) == (1, 1, 0)
    assert seen["observers_inserted"] == 1  # the token embedding's lookup
    assert "dce_removed" in seen  # dead-code elimination ran (and counted what it removed)
    state = nanospec_fx.active_vocab(model)
    (report,) = pass_reports.reports(state)
    assert report.head == "lm_head.weight" and report.observers == 1
    assert not hasattr(state, "rewrites")  # compiler output is not stored on the runtime state
    assert any("lm_head.weight rewritten" in r.getMessage() for r in caplog.records)


def test_a_dense_head_is_counted_under_its_reason(caplog):
    torch.manual_seed(0)
    model = HeadInVmap().eval()
    counters.clear()
    with pytest.warns(NanoSpecWarning, match=r"runs inside torch\.vmap"), \
            caplog.at_level(logging.DEBUG, logger="nanospec_fx.compiler"), torch.no_grad():
        compile_nanospec(model)(torch.randint(0, V, (2, 3)))
    seen = counters["nanospec"]
    assert (seen["heads_found"], seen["heads_rewritten"], seen["heads_dense"]) == (1, 0, 1)
    assert seen["dense: it runs inside torch.vmap, which Dynamo inlines"] == 1
    assert any("runs dense: it runs inside torch.vmap" in r.getMessage() for r in caplog.records)


def test_a_graph_without_a_head_is_counted():
    class NoHead(nn.Module):
        def forward(self, x):
            return x * 2

    counters.clear()
    with pytest.warns(NanoSpecWarning, match="no LM head found"):
        torch.compile(NoHead(), backend="nanospec", options={"inductor": False})(torch.ones(3))
    assert counters["nanospec"]["graphs_without_head"] == 1 and counters["nanospec"]["heads_found"] == 0
