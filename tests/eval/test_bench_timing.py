"""The benchmarks' shared library: the one timer (nanospec_fx.eval.bench.timing), CUDA-graph capture and the kernel
choices a kernel benchmark makes (nanospec_fx.eval.bench.kernel_config). No assertion here depends on how long
anything takes: only on which calls were made and what was selected."""
from __future__ import annotations


import torch

from nanospec_fx.eval.bench import graphs, kernel_config, timing


def test_device_timings_runs_before_untimed_before_each_call():
    calls = []
    times = timing.device_timings(lambda: calls.append("fn"), iters=3, warmup=1, before=lambda: calls.append("pre"))
    assert calls == ["pre", "fn"] * 4 and len(times) == 3 and all(t >= 0 for t in times)


def test_timings_takes_the_clock_it_is_given():
    ticks = iter(range(100))
    assert timing.timings(lambda: None, repeats=3, warmup=0, min_seconds=0, clock=lambda: next(ticks)) == [1, 1, 1]


def test_graphed_is_none_off_cuda():
    assert graphs.graphed(lambda: None, "cpu") is None


def test_kernel_choices_apply_inside_the_block_only(use_kernels):
    from nanospec_fx.kernels.dispatch import path_for
    from nanospec_fx.kernels.selection import current_config

    use_kernels("host", head_config="c64_w8")
    assert path_for("cpu") == "host"
    with kernel_config.kernels("reference"):
        assert path_for("cpu") == "reference"
    assert path_for("cpu") == "host"
    with kernel_config.head_config("default"):
        assert current_config("cuda").head_config == "default"
    assert current_config("cuda").head_config == "c64_w8"


def test_op_state_is_an_empty_state_in_the_ops_order():
    weight = torch.randn(10, 4)
    state = kernel_config.op_state(weight, 6)
    named = dict(zip(kernel_config.state_names(), state))
    assert list(named) == ["ids", "slot_of", "cursor", "cache_w", "cache_b"]
    assert named["ids"].tolist() == [-1] * 6 and named["slot_of"].tolist() == [-1] * 10 and int(named["cursor"]) == 0
    torch.ops.nanospec.observe(torch.tensor([3, 7]), weight, None, *state, 0)
    assert named["ids"][:2].tolist() == [3, 7] and torch.equal(named["cache_w"][:2], weight[[3, 7]])
