"""explain() and the sympy cost model."""
from __future__ import annotations

import sympy
import torch

import nanospec_fx
from nanospec_fx.cost_model import HeadCost, active, rows
from drafters import TinyDrafter
from helpers import compile_nanospec


def test_explain_reports_the_rewrite_and_the_active_set():
    model = TinyDrafter(500, 16, head="linear", post="softcap", returns="log_softmax_topk").eval()
    assert "no head rewritten yet" in str(nanospec_fx.explain(model))
    compiled = compile_nanospec(model, capacity=32)
    with torch.no_grad():
        compiled(torch.tensor([[4, 5, 6]]))
    (head,) = nanospec_fx.explain(compiled).heads
    assert (head.name, head.module_path, head.vocab_size, head.hidden_size) == ("lm_head.weight", "lm_head", 500, 16)
    assert head.post_ops == ["truediv", "tanh", "mul", "float"]
    assert head.consumers == ["log_softmax", "topk"] and head.exits == []
    assert head.observers == 1 and len(head.state) == 3
    assert head.cost.compact_output
    text = str(nanospec_fx.explain(model))
    assert "lm_head.weight (module lm_head): V=500, H=16" in text and "3 / 32 slots" in text


def test_cost_model_matches_hand_counted_bytes():
    cost = HeadCost(vocab_size=1000, hidden_size=10, bytes_per_element=2)
    assert cost.dense_bytes.subs(rows, 3) == 2 * (1000 * 10 + 3 * 10 + 3 * 1000)
    assert cost.nanospec_bytes.subs({rows: 3, active: 100}) == 2 * (100 * 10 + 3 * 10 + 3 * 1000) + 8 * 100
    assert cost.dense_flops.subs(rows, 3) == 2 * 3 * 10 * 1000
    assert cost.predict(3, 100) == float(sympy.Rational(2 * (10000 + 30 + 3000), 2 * (1000 + 30 + 3000) + 800))


def test_llama3_shape_prediction_is_bounded_by_the_bytes_ratio():
    cost = HeadCost(128256, 4096, 2, compact_output=True)
    assert 35 < cost.predict(10, 3000) < 128256 / 3000
    assert cost.predict(1, 3000) > cost.predict(64, 3000)  # more rows, more activation traffic
    even = cost.break_even_active(10)
    assert 0.9 * 128256 < even < 128256 * 1.01
