"""Failures the pass fuzzer found, shrunk to small recipes and kept as explicit cases.

Each case runs ``run_case`` (tests/passes/test_pass_fuzzer.py): the compiled drafter must equal the masked
dense oracle, or warn and equal the dense drafter. A case whose defect is not fixed yet is a strict
xfail naming the defect, so the suite stays honest: fixing it turns the xfail into a failure
until the mark is removed. /work/notes/fuzz_findings.md has the observed vs expected of each.
"""
from __future__ import annotations

import os

import pytest

from fuzz_drafters import Recipe
from test_pass_fuzzer import run_case


def _open(reason: str):
    return pytest.mark.xfail(strict=True, reason=reason)


B = dict(vocab=60, hidden=16, head="linear", batch=2, seq=3, seq2=3)


def R(**kw) -> Recipe:
    return Recipe(**{**B, **kw})


# name -> (recipe, marks): found on f9ba722 (before the issue-9 fixes) or on the issue-9 branch (fuzz_findings.md).
CASES = {
    # in-place writes of the logits lost or applied to stale compact values
    "setitem_then_softcap": (R(chain=(("setitem", "-inf"), ("softcap", 2.0))), ()),
    "setitem_view_then_masked_fill_": (R(chain=(("setitem_view", 0.0), ("masked_fill_", 0.0), ("scale", 0.5)), dtype="bfloat16", batch=1, seq=1, seq2=2), ()),
    "setitem_finite_value": (R(chain=(("setitem", 0.0),)), ()),
    "setitem_view_then_clamp": (R(chain=(("setitem_view", "-inf"), ("clamp", -2.0))), ()),
    "setitem_then_sort": (R(vocab=111, head="functional_tied", body=(), chain=(("setitem", 0.0), ("sort", True, "none")), batch=2, seq=2, n_ban=3, seed=665), ()),
    "clamp_method_then_log_softmax_topk": (R(chain=(("clamp_", -2.0), ("topk", 4, True, "log_softmax"))), ()),
    "clamp_function_form": (R(chain=(("clamp_fn_", -2.0),)), ()),
    "nan_to_num_function_form": (R(chain=(("masked_fill_", "-inf"), ("nan_to_num_fn", -50.0))), ()),
    "div_out_self": (R(chain=(("out_self", 0.7),)), ()),
    "log_softmax_then_out_softcap": (R(chain=(("log_softmax",), ("out_new_softcap", 2.0))), ()),
    # head selection and the projection that is rewritten
    "position_table_dynamic_seq": (R(vocab=40, head="matmul_T", position=True, extra_outputs=("hidden",), seq2=2), ()),
    "position_table_dynamic_seq_padded_embedding": (R(vocab=40, head="matmul_T", position=True, embed_pad=3, extra_outputs=("hidden",), seq2=4), ()),
    "wider_projection_returned": (R(extra_outputs=("wide_proj",)), ()),
    "padded_table_and_wider_projection": (R(embed_pad=16, extra_outputs=("wide_proj",)), ()),
    "padded_table_buffer_head_and_wider_projection": (R(head="buffer", embed_pad=16, extra_outputs=("wide_proj",)), ()),
    "dequantised_head_and_router": (R(head="dequant", extra_outputs=("router",)), ()),
    # consumers reading the head output directly
    "topk_smallest_on_head_output": (R(chain=(("topk", 4, False, "none"),)), ()),
    "topk_smallest_after_out_write": (R(chain=(("out_new_softcap", 2.0), ("topk", 1, False, "none"))), ()),
    # state reachability, observation
    "head_weight_in_buffer": (R(head="buffer"), ()),
    "padded_embedding_table": (R(embed_pad=3), ()),
    "graph_break_between_embedding_and_head": (R(body=("mlp", "graph_break")), ()),
    "eviction_of_reobserved_token": (R(capacity=16, extra_active=20), ()),
    "head_before_embedding": (R(order="head_first", chain=(("softcap", 2.0),)), ()),
    # side effects in the body removed by dead-code elimination
    "body_clamp_function_form": (R(body=("mlp", "clamp_fn_")), ()),
    "body_tanh_function_form": (R(body=("mlp", "tanh_fn_")), ()),
    "body_out_argument": (R(body=("mlp", "out_mul")), ()),
    # training the body with a frozen head
    "grad_mode_frozen_head": (R(mode="grad"), ()),
    # graph breaks after the head
    "graph_break_softcap_then_log_softmax": (R(vocab=133, hidden=8, head="linear_tied", head_bias=True, chain=(("sub_lse",), ("graph_break",), ("out_new_softcap", 2.0), ("sub_max",), ("log_softmax",)), return_logits=False, capacity=4, batch=2, seq=2, seq2=2, extra_active=3, seed=168), ()),
    "graph_break_softcap_log_softmax": (R(chain=(("graph_break",), ("softcap", 2.0), ("log_softmax",))), ()),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=m) for n, (_, m) in CASES.items()])
def test_fuzzer_regression(name):
    os.environ["NANOSPEC_KERNELS"] = "reference"
    try:
        run_case(CASES[name][0])
    finally:
        os.environ.pop("NANOSPEC_KERNELS", None)


def test_fuzzer_regression_state_leaks_between_drafters():
    """Two drafters in one process (found by a long run: the second failed only after the first)."""
    first = Recipe(vocab=142, hidden=8, head="matmul_T", head_bias=True, embed_pad=3, position=True, body=("mlp", "tanh_fn_", "tanh_fn_"),
                   order="head_first", chain=(("max", "none"), ("sub_max",), ("sub_max",)), return_logits=False,
                   extra_outputs=("wide_proj",), dtype="bfloat16", mode="no_grad", capacity=32, batch=1, seq=4, seq2=4,
                   feed_padded_ids=True, extra_active=20, n_ban=3, seed=1)
    second = R(vocab=140, hidden=8, head="matmul_bias", body=("mlp", "graph_break"), capacity=16, extra_active=20, batch=2, seq=4, seq2=4)
    os.environ["NANOSPEC_KERNELS"] = "reference"
    try:
        run_case(first)
        run_case(second)
    finally:
        os.environ.pop("NANOSPEC_KERNELS", None)
