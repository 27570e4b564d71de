"""explain() and the sympy cost model."""
from __future__ import annotations

import pytest
import sympy
import torch

import nanospec_fx
from nanospec_fx.diagnostics.cost_model import MACHINE, HeadCost, active, rows
from drafters import TinyDrafter
from helpers import compile_nanospec


def test_explain_reports_the_rewrite_and_the_active_set():
    model = TinyDrafter(500, 16, head="linear", post="softcap", returns="log_softmax_topk").eval()
    assert "no head rewritten in TinyDrafter: it is not compiled" in str(nanospec_fx.explain(model, quiet=True))
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


def test_cost_model_follows_the_path_that_runs():
    """Host path: bucket(active) rows; reference: all C rows; Triton: the active rows (hand-counted)."""
    V, H, C, b = 1000, 10, 64, 4
    host = HeadCost(V, H, b, compact_output=True, path="host", capacity=C)
    ref = HeadCost(V, H, b, compact_output=True, path="reference", capacity=C)
    tri = HeadCost(V, H, b, compact_output=True, path="triton", capacity=C)
    dense = b * (V * H + 2 * H + 2 * V)
    # 5 active: the host computes a bucket of 16 rows, the reference 64, Triton 5; all write [2, C]
    for cost, computed in ((host, 16), (ref, 64), (tri, 5)):
        assert cost.predict(2, 5) == pytest.approx(dense / (b * (computed * H + 2 * H + 2 * C) + 8 * 5))
    assert host.predict(2, 5) > ref.predict(2, 5) and tri.predict(2, 5) > host.predict(2, 5)
    assert active not in ref.nanospec_flops.free_symbols  # the reference multiplies all C rows whatever |A|
    assert str(host.nanospec_flops) == "20*rows*bucket(active)"
    with pytest.raises(ValueError, match="path"):
        HeadCost(V, H, b, path="gpu")


def test_fixed_cost_and_dense_roofline():
    cost = HeadCost(1000, 10, 4, compact_output=True, path="triton", capacity=64, fixed_bytes=5000,
                    dense_efficiency=0.5, dense_flops_per_byte=0.25)
    nano_bytes = 4 * (5 * 10 + 3 * 10 + 3 * 64) + 8 * 5  # 1,128
    nano_flops = 2 * 3 * 10 * 5 / 0.25  # 1,200 > 1,128: the compact product is compute-bound too
    nano = 5000 + max(nano_bytes, nano_flops)
    dense_streamed = 4 * (1000 * 10 + 3 * 10 + 3 * 1000) / 0.5
    dense_flops = 2 * 3 * 10 * 1000 / 0.25  # 240,000 > 52,120: compute-bound
    assert cost.predict(3, 5) == pytest.approx(max(dense_streamed, dense_flops) / nano)
    assert HeadCost.for_path(1000, 10, 4, True, "host", 64).fixed_bytes == MACHINE["host"][0]
    # a [rows, V] output takes a second op call (the scatter), which pays the fixed cost again
    full = HeadCost(1000, 10, 4, compact_output=False, path="triton", capacity=64, fixed_bytes=5000)
    assert full.op_calls == 2 and cost.op_calls == 1
    assert full.predict(3, 5) == pytest.approx(4 * (1000 * 10 + 3 * 10 + 3 * 1000)
                                               / (2 * 5000 + 4 * (5 * 10 + 3 * 10 + 3 * 1000) + 8 * 5))


def test_measured_constants_replace_the_fitted_ones(monkeypatch, fresh_calibration):
    """A real measurement gives constants said as measured; whether they are plausible depends on the machine's load
    (calibrate refuses implausible ones: the test below), so the cache and the cost model are checked with a
    plausible stand-in for the measurement."""
    calibration = fresh_calibration
    MachineConstants, calibrate = calibration.MachineConstants, calibration.calibrate
    real = calibration.measure(16, repeats=1)
    assert isinstance(real, MachineConstants) and "measured on this machine" in real.describe()
    measured = MachineConstants(4096, 0.8, 2.0, 2e10, "measured on this machine")
    monkeypatch.setattr(calibration, "measure", lambda *a: measured)
    machine = calibrate(16)
    assert machine is measured and machine is calibrate(16)  # measured once per process and width
    cost = HeadCost.for_path(1000, 16, 4, True, "host", 64, machine)
    assert (cost.fixed_bytes, cost.dense_efficiency, cost.dense_flops_per_byte) == (
        machine.fixed_bytes, machine.dense_efficiency, machine.dense_flops_per_byte)
    fitted = MachineConstants(*MACHINE["host"])
    assert "calibrate=True" in fitted.describe()
    with pytest.raises(ValueError, match="hidden_size"):
        calibrate(0)


@pytest.fixture
def fresh_calibration():
    """calibrate() caches per process and width: a test that replaces the measurement starts and ends with an empty
    cache, so neither a real measurement of an earlier test nor its stand-in constants outlive it."""
    from nanospec_fx.diagnostics import calibration
    calibration.calibrate.cache_clear()
    yield calibration
    calibration.calibrate.cache_clear()


def test_explain_calibrated_says_where_its_constants_come_from(monkeypatch, fresh_calibration):
    """Which constants the report uses and where they come from. The measurement is replaced by plausible constants:
    real timings of a 16-wide head depend on the machine's load (two blocks timed alike give an implausible slope,
    which calibrate refuses: the next test), and no test here may depend on load."""
    calibration = fresh_calibration
    measured = calibration.MachineConstants(4096, 0.8, 2.0, 2e10, "measured on this machine")
    monkeypatch.setattr(calibration, "measure", lambda *a: measured)
    model = TinyDrafter(500, 16, head="linear", returns="logits").eval()
    compiled = compile_nanospec(model, capacity=64)
    with torch.no_grad():
        compiled(torch.tensor([[4, 5, 6]]))
    assert "fitted on the project's 2-core test machine" in str(nanospec_fx.explain(compiled))
    text = str(nanospec_fx.explain(compiled, calibrate=True))
    assert "cost model: constants measured on this machine" in text and "GB/s" in text


def test_implausible_calibration_is_refused_and_explain_keeps_the_fitted_constants(monkeypatch, fresh_calibration):
    """Timings on a busy machine (two blocks timed alike: a zero slope) gave 786432 GB/s and a dense head at 0.00,
    said as measured: calibrate now measures again, then refuses, and explain warns and uses the fitted constants."""
    calibration = fresh_calibration
    busy = calibration.MachineConstants(10, 1e-6, 0.5, 7.9e14, "measured on this machine")
    attempts = []
    monkeypatch.setattr(calibration, "measure", lambda *a: attempts.append(a) or busy)
    with pytest.raises(calibration.CalibrationError, match=r"bandwidth = 7.9e\+14, outside"):
        calibration.calibrate(24)
    assert len(attempts) == calibration.ATTEMPTS
    model = TinyDrafter(500, 24, head="linear", returns="logits").eval()
    compiled = compile_nanospec(model, capacity=64)
    with torch.no_grad():
        compiled(torch.tensor([[4, 5, 6]]))
    with pytest.warns(nanospec_fx.NanoSpecWarning, match="implausible constants"):
        text = str(nanospec_fx.explain(compiled, calibrate=True, quiet=True))
    assert "calibration was implausible" in text and "GB/s" not in text


def test_explain_names_the_kernels_and_predicts_for_them(use_kernels):
    model = TinyDrafter(500, 16, head="linear", returns="logits").eval()
    compiled = compile_nanospec(model, capacity=64)
    with torch.no_grad():
        compiled(torch.tensor([[4, 5, 6]]))
    use_kernels("auto")
    (head,) = nanospec_fx.explain(compiled).heads
    assert head.path == "host" and head.cost.path == "host" and head.cost.capacity == 64
    assert "CPU host path" in str(nanospec_fx.explain(compiled))
    host_prediction = head.predictions()[1]
    use_kernels("reference")
    (head,) = nanospec_fx.explain(compiled).heads
    assert head.path == "reference" and "computes all capacity rows" in str(nanospec_fx.explain(compiled))
    assert head.predictions()[1] < host_prediction


def test_a_bypassed_compile_wrapper_is_reported_as_not_rewritten():
    """generate(assistant_model=wrapper) calls the original module: its head runs dense, and explain says so."""
    model = TinyDrafter(500, 16, head="linear", returns="logits").eval()
    wrapper = torch.compile(model, backend="nanospec", options={"inductor": False})
    nanospec_fx.attach(model, head="lm_head.weight")
    with torch.no_grad():
        model(torch.tensor([[4, 5, 6]]))  # what wrapper.generate() runs: the original module
    report = nanospec_fx.explain(wrapper)
    (head,) = report.heads
    assert head.graphs == 0 and not head.rewritten
    text = str(report)
    assert text.startswith("nanospec: 0 head(s) rewritten, 1 not rewritten")
    assert "NOT REWRITTEN" in text and "bypasses the wrapper" in text and "drafter.compile(backend='nanospec')" in text
    assert "bypasses" not in str(nanospec_fx.explain(model))  # not a wrapper: the other remedy
    with torch.no_grad():
        wrapper(torch.tensor([[4, 5, 6]]))
    assert nanospec_fx.explain(wrapper).heads[0].rewritten


def test_head_benchmark_pairs_measurement_and_prediction():
    from nanospec_fx.eval.bench.head import bench_head_vs_active

    res = bench_head_vs_active(hidden=8, vocab=512, actives=(1, 30), capacity=32, rows=(1,), repeats=2)
    assert [(t.active, t.variant, t.path) for t in res] == [
        (1, "compact", "host"), (1, "+scatter", "host"), (30, "compact", "host"), (30, "+scatter", "host")]
    for t in res:
        cost = HeadCost.for_path(512, 8, 4, t.variant == "compact", "host", 32)
        assert t.predicted == pytest.approx(cost.predict(1, t.active)) and t.speedup > 0 and t.ms > 0


def test_explain_speaks_to_users_formulas_named_speedups_readable_names_public():
    from nanospec_fx.diagnostics.explain import public_names, speedup

    assert [speedup(v) for v in (0.01234, 0.75, 3.24, 41.3)] == ["0.012x", "0.75x", "3.2x", "41x"]
    assert public_names(["_nanospec_mtp.shared_head.weight", "lm_head.weight", "lm_head"]) == ["lm_head.weight",
                                                                                               "lm_head"]
    assert public_names(["_private.weight"]) == ["_private.weight"]
    model = TinyDrafter(500, 16, head="linear", returns="logits").eval()
    model._held = model.lm_head  # a second, private path to the head (as an integration holds it)
    compiled = compile_nanospec(model, capacity=64)
    with torch.no_grad():
        compiled(torch.tensor([[4, 5, 6]]))
    text = str(nanospec_fx.explain(compiled, quiet=True))
    assert "_held" not in text and "lm_head.weight" in text
    assert "0.0x" not in text and "below 1x" in text  # V=500: the dense head is faster, said as such
    assert "rounded up to one of 4 sizes per power of two" in text  # bucket(active) defined where it is used
    assert "heads_rewritten is a count of graphs" in text


class ArgumentHead(torch.nn.Module):
    """vLLM style: the head's weight is a forward argument (``F.linear(h, head_weight)``), not held by the module."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.body = torch.nn.Linear(8, 8)

    def forward(self, ids, head_weight):
        return torch.nn.functional.linear(torch.tanh(self.body(self.embed(ids))), head_weight)


def test_explain_finds_a_head_whose_weight_is_a_call_argument():
    model = ArgumentHead().eval()
    weight = torch.nn.Parameter(torch.randn(50, 8), requires_grad=False)
    compiled = compile_nanospec(model)
    with torch.no_grad():
        compiled(torch.tensor([[1, 2]]), weight)
    state = nanospec_fx.active_vocab(weight)
    assert sorted(state.token_ids().tolist()) == [1, 2]
    for which in (model, compiled):  # neither "not compiled" nor "a wrapper generate() bypasses"
        report = nanospec_fx.explain(which, quiet=True)
        assert [h.state for h in report.heads] == [state] and report.heads[0].rewritten
        text = str(report)
        assert "head head_weight (a call argument)" in text
        assert "not compiled" not in text and "bypasses" not in text
