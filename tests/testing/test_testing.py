"""nanospec_fx.testing: the checker passes on correct drafters and catches every broken contract.

The failing cases break the compiled drafter on purpose (monkeypatched reference kernels, a wrong
reference, an observer that does nothing), so a checker that always passes would fail here.
"""
from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import run_python, tiny_llama
from drafters import EagleLikeDrafter, HiddenOnlyDrafter, NoHead, TinyDrafter
import nanospec_fx
from nanospec_fx import NanoSpecWarning
from nanospec_fx.testing import active_sets, assert_equivalent, token_ids

V = 200


def tiny(head="linear", post="none", returns="logits", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return TinyDrafter(V, 16, head, post, returns).to(dtype).eval()


def ids(shape=(2, 5), seed=1):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- passes
@pytest.mark.parametrize("head,post,returns,dtype", [
    ("linear", "none", "logits", torch.float32),
    ("tied", "softcap", "tuple", torch.float32),
    ("matmul_T_bias", "bias_add", "logits", torch.bfloat16),
    ("linear_bias", "last_position", "logits", torch.float16),
])
def test_passes_on_correct_drafters(head, post, returns, dtype):
    state = assert_equivalent(tiny(head, post, returns, dtype), (ids(),), options={"capacity": 32})
    assert 0 < len(state) <= 32


def test_passes_with_a_chosen_active_set_and_returns_the_state():
    x = ids((1, 3))
    state = assert_equivalent(tiny(), (x,), active_ids=[7, 8, 9, 150])
    assert set(state.token_ids().tolist()) == {7, 8, 9, 150} | set(x.flatten().tolist())


def test_passes_on_eagle_like_and_hidden_only_drafters():
    torch.manual_seed(0)
    eagle = EagleLikeDrafter(V, 16).eval()
    assert_equivalent(eagle, (ids(), torch.randn(2, 5, 16)), options={"capacity": 64})
    hidden_only = HiddenOnlyDrafter(V, 8).eval()
    state = assert_equivalent(hidden_only, (torch.randn(3, 8),), active_ids=torch.tensor([1, 5, 199]))
    assert sorted(state.token_ids().tolist()) == [1, 5, 199]


def test_passes_with_a_reference_for_drafters_that_select_themselves():
    model, x = tiny(returns="log_softmax_topk"), ids()
    assert_equivalent(model, (x,), reference=lambda mask: model(x, _mask=mask))


def test_keyword_inputs_and_explicit_token_inputs():
    model, x = tiny(), ids()
    assert_equivalent(model, {"ids": x}, token_inputs=["ids"])


def test_capacity_smaller_than_the_input_is_reported_not_failed():
    state = assert_equivalent(tiny(), (torch.arange(40).view(4, 10),), options={"capacity": 16})
    assert len(state) == 16


MODEL = tiny("tied", "softcap")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=token_ids(V, (2, 4)), active=active_sets(V, 24))
def test_three_line_property_test(x, active):
    assert_equivalent(MODEL, (x,), active_ids=active, options={"capacity": 32})


@settings(max_examples=20, deadline=None)
@given(x=token_ids(50, st.tuples(st.integers(1, 3), st.integers(1, 4))), active=active_sets(50, 10, min_size=2))
def test_strategies_draw_valid_values(x, active):
    assert x.dtype == torch.int64 and 1 <= x.shape[0] <= 3 and 1 <= x.shape[1] <= 4
    assert ((0 <= x) & (x < 50)).all()
    assert active.dtype == torch.int64 and 2 <= active.numel() <= 10
    assert active.unique().numel() == active.numel() and ((0 <= active) & (active < 50)).all()


# ----------------------------------------------------------------------------- failures
@pytest.fixture
def patch_reference(monkeypatch, use_kernels):
    """``patch_reference(name, wrap)``: replace reference kernel ``name`` by ``wrap(original)`` (and run the
    reference, not the CPU host path) for the test."""
    def patch(name, wrap):
        use_kernels("reference")
        module = sys.modules["nanospec_fx.kernels.reference"]
        monkeypatch.setattr(module, name, wrap(getattr(module, name)))
    return patch


def test_fails_when_active_logits_are_wrong(patch_reference):
    patch_reference("compact_logits", lambda original: lambda *a: original(*a) + 0.01)
    with pytest.raises(AssertionError, match=r"out \(active tokens\): \d+ of \d+ entries differ .*max abs error") as caught:
        assert_equivalent(tiny(seed=3), (ids(),))
    assert "drafter.eval()" in str(caught.value) and "rtol=/atol=" in str(caught.value)


def test_fails_when_inactive_logits_are_not_minus_inf(patch_reference):
    patch_reference("scatter_logits", lambda original: lambda *a: original(*a).clamp(min=-1e4))
    with pytest.raises(AssertionError, match=r"out\[0\]: \d+ of \d+ inactive logits are not -inf"):
        assert_equivalent(tiny("tied", "softcap", "tuple", seed=4), (ids(),))


def test_fails_when_input_tokens_are_not_observed(patch_reference):
    patch_reference("observe", lambda original: lambda *a: None)
    with pytest.raises(AssertionError, match=r"input 0: \d+ of \d+ distinct token ids are not active") as caught:
        assert_equivalent(tiny(seed=7), (ids(),), active_ids=[3])
    assert "pass token_inputs= naming the inputs that do" in str(caught.value)  # positions or a mask: the remedy
    with pytest.raises(AssertionError, match="not active") as caught:
        assert_equivalent(tiny(seed=7), (ids(),), active_ids=[3], token_inputs=[0])
    assert "token_inputs=" not in str(caught.value)  # named already: the tokens are not observed, nothing to advise


def test_ids_the_drafter_picks_itself_differ_with_the_reference_remedy():
    """A drafter that returns argmax ids: compiled, it picks among active tokens only, so its ids differ from the
    eager drafter's; the failure names the remedy (reference=), which then passes."""
    model, x = tiny(returns="argmax", seed=8), ids()
    with pytest.raises(AssertionError, match=r"out: \d+ of \d+ entries differ from the eager drafter") as caught:
        assert_equivalent(model, (x,), active_ids=[3, 4])
    assert "pass reference=lambda mask:" in str(caught.value)
    assert_equivalent(model, (x,), active_ids=[3, 4], reference=lambda mask: model(x, _mask=mask))


def test_torch_trace_log_stays_out_of_pytests_capture(caplog):
    """pytest captures every non-propagating logger, torch's always-DEBUG structured trace log included; a check
    keeps its compile events out of the user's report (and plain torch.compile shows they would be there)."""
    import logging

    caplog.set_level(logging.DEBUG, logger="torch.__trace")
    torch.compile(torch.nn.Linear(4, 4), backend="eager")(torch.randn(2, 4))
    if not any(r.name == "torch.__trace" for r in caplog.records):
        pytest.skip("this torch sends no trace records to other handlers")
    caplog.clear()
    assert_equivalent(tiny(seed=9), (ids(),))
    assert not [r for r in caplog.records if r.name == "torch.__trace"]
    assert caplog.handler in logging.getLogger("torch.__trace").handlers  # given back after the check


def test_fails_on_a_wrong_reference():
    model, x = tiny(returns="log_softmax_topk", seed=5), ids()
    with pytest.raises(AssertionError, match=r"out\[0\].*differ from reference\(mask\)"):
        assert_equivalent(model, (x,), reference=lambda mask: model(x))  # unmasked: not what nanospec computes


def test_fails_on_a_reference_with_minus_inf_where_the_drafter_has_a_finite_logit():
    """An infinite expectation is met only exactly: its relative bound is infinite, so a finite logit where the
    reference says -inf (a token the set holds that the reference masks) would pass any rtol > 0."""
    model, x = tiny(seed=5), ids()
    one_more = torch.zeros(V, dtype=torch.bool)
    one_more[int(x[0, 0])] = True  # fed, so active: the compiled logit is finite there
    with pytest.raises(AssertionError, match=r"differ from reference\(mask\)"):
        assert_equivalent(model, (x,), reference=lambda mask: model(x, _mask=mask & ~one_more))


def test_fails_on_a_wrong_reference_structure():
    model, x = tiny(returns="tuple", seed=6), ids()
    with pytest.raises(AssertionError, match="output structure differs from the reference"):
        assert_equivalent(model, (x,), reference=lambda mask: model(x, _mask=mask)[0])


def test_fails_without_a_head():
    with (
        pytest.raises(AssertionError, match="did not rewrite a head"),
        pytest.warns(NanoSpecWarning, match="no LM head"),
    ):
        assert_equivalent(NoHead(4).eval(), (torch.randn(2, 4),))



def test_transformers_model_with_keyword_inputs_and_a_cache_object():
    model = tiny_llama(V, 1, 0, hidden=16, num_attention_heads=2, num_key_value_heads=1)
    state = assert_equivalent(model, {"input_ids": ids(), "use_cache": True}, options={"capacity": 64})
    assert state.contains(ids()).all()


def test_transformers_probe_does_not_load_a_second_copy_of_the_ops():
    """From the repository root, transformers' probe for HF's `kernels` package finds our kernels/ directory first
    as a top-level package: no module of ours may load under that name (no second registration of the ops); where
    HF's library is installed (transformers >= 5.25 depends on it) the probe gets that library."""
    probe = ("import os, sys, nanospec_fx; from transformers.utils.import_utils import is_kernels_available; "
             "is_kernels_available(); import transformers.integrations.hub_kernels; "
             "print([n for n, m in sys.modules.items() if n.split('.')[0] == 'kernels' "
             "and os.path.abspath(getattr(m, '__file__', None) or '').startswith(os.path.join(os.getcwd(), 'kernels', ''))])")
    out = run_python(probe).stdout
    assert out.split() == ["[]"]


# ----------------------------------------------------------------------------- isolation of the checks
def test_options_whose_tensors_print_alike_are_compiled_separately():
    """Two static policies whose frequency tensors print alike (summarised) but rank other tokens first:
    each check must run its own configuration, judged by a reference built from the frequencies."""
    vocab, static = 1200, 5
    torch.manual_seed(0)
    model, x = TinyDrafter(vocab, 8).eval(), torch.tensor([[1, 2, 3]])
    for first in (1100, 1105):
        freqs = torch.zeros(vocab, dtype=torch.int64)
        freqs[first:first + static] = 7
        expected = torch.zeros(vocab, dtype=torch.bool)
        expected[first:first + static] = True  # the oracle: the 'static_size' most frequent tokens
        options = {"policy": "static", "frequencies": freqs, "static_size": static, "capacity": 8}
        assert repr(options) == repr({**options, "frequencies": torch.zeros(vocab, dtype=torch.int64)})
        state = assert_equivalent(model, (x,), options=options, token_inputs=[],
                                  reference=lambda mask: model(x, _mask=expected))
        assert sorted(state.token_ids().tolist()) == list(range(first, first + static))


def test_options_are_keyed_by_value_not_by_printout():
    from nanospec_fx.testing import options_key

    a, b = torch.zeros(2000), torch.zeros(2000)
    b[1000] = 1.0
    assert repr(a) == repr(b) and options_key({"f": a}) != options_key({"f": b})
    assert options_key({"f": a, "k": 1}) == options_key({"k": 1, "f": a.clone()})
    assert options_key({"k": 1}) != options_key({"k": 1.0}) != options_key({"k": True})


def test_the_check_leaves_dynamo_and_the_users_drafter_alone():
    """No torch._dynamo.reset() behind the user's back: the user's compiled drafter keeps its graph, its
    state and its options while assert_equivalent checks the same drafter with other options."""
    from nanospec_fx.compiler.backend import nanospec_backend

    compiles = []

    def backend(gm, example_inputs, **_):
        compiles.append(1)
        return nanospec_backend(gm, example_inputs, options={"capacity": 16, "inductor": False})

    model, x = tiny(seed=11), ids()
    users = torch.compile(model, backend=backend)
    with torch.inference_mode():
        before = users(x)
    mine = nanospec_fx.active_vocab(model)
    assert_equivalent(model, (x,), options={"capacity": 64})
    assert_equivalent(model, (x,), options={"capacity": 32})
    with torch.inference_mode():
        after = users(x)
    assert len(compiles) == 1, "the user's compiled graph was dropped (a global Dynamo reset)"
    assert nanospec_fx.active_vocab(model) is mine and mine.capacity == 16
    assert torch.equal(before, after)


def test_a_drafter_written_in_place_is_compiled_again():
    model, x = tiny(seed=12), ids()
    assert_equivalent(model, (x,), options={"capacity": 32})
    with torch.no_grad():
        model.lm_head.weight.mul_(3)  # the checked copy must follow the drafter, not keep the old weights
    assert_equivalent(model, (x,), options={"capacity": 32})


def test_a_check_dynamo_does_not_compile_fails_instead_of_passing(monkeypatch):
    """Past Dynamo's recompile limit the drafter would run eager: nothing checked, so it must not pass."""
    import nanospec_fx.testing as testing

    model, x = tiny(seed=13), ids()
    assert_equivalent(model, (x,), options={"capacity": 32})
    monkeypatch.setattr(testing, "RECOMPILE_LIMIT", 1)
    with pytest.raises(AssertionError, match="did not hand TinyDrafter to the nanospec backend"), \
            pytest.warns(nanospec_fx.NanoSpecWarning, match="recompile_limit"):
        assert_equivalent(model, (x,), options={"capacity": 48})
    assert_equivalent(model, (x,), options={"capacity": 48}, reset_dynamo=True)
