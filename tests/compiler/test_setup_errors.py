"""Mistakes at setup are caught where the user can catch them, with a message that says what to do."""
from __future__ import annotations

import warnings

import pytest
import torch

import nanospec_fx
from drafters import TinyDrafter
from helpers import tiny_llama


def test_compile_checks_options_at_once():
    model = TinyDrafter(40, 8).eval()
    with pytest.raises(ValueError, match="unknown nanospec option.*'capacty'"):
        nanospec_fx.compile(model, {"capacty": 8})
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        nanospec_fx.compile(model, {"capacity": 0})
    compiled = nanospec_fx.compile(model, {"capacity": 8, "inductor": False})
    with torch.no_grad():
        compiled(torch.tensor([[1, 2, 3]]))
    assert nanospec_fx.active_vocab(model).capacity == 8


def test_compile_in_place_returns_the_module():
    model = TinyDrafter(40, 8).eval()
    assert nanospec_fx.compile(model, {"capacity": 8, "inductor": False}, in_place=True) is model
    with torch.no_grad():
        model(torch.tensor([[4, 5]]))
    assert sorted(nanospec_fx.active_vocab(model).token_ids().tolist()) == [4, 5]


def test_the_removed_option_alias_is_an_unknown_option():
    """``observe_all_positions`` (the pre-release name of ``observe_prompt``) is gone: an unknown key, said so."""
    with pytest.raises(nanospec_fx.OptionError, match=r"unknown nanospec option\(s\) \['observe_all_positions'\]"):
        nanospec_fx.NanoSpecOptions.parse({"observe_all_positions": True})
    assert nanospec_fx.NanoSpecOptions.parse({"observe_prompt": True}).observe_prompt is True


def test_a_torch_compile_wrapper_is_refused_with_the_in_place_advice():
    target, drafter = tiny_llama(300, 1, 0), tiny_llama(300, 1, 1)
    wrapper = torch.compile(drafter, backend="nanospec")
    with pytest.raises(TypeError, match=r"compile in place: drafter.compile\(backend='nanospec'\)"):
        nanospec_fx.speculative_pair(target, wrapper)
    with pytest.raises(TypeError, match="pass the module itself"):
        nanospec_fx.compile(wrapper)
    # a wrapper that generate() bypassed never ran: the lookup says why and what to do instead
    with pytest.raises(LookupError, match=r"bypasses the wrapper.*drafter.compile\(backend='nanospec'\)"):
        nanospec_fx.active_vocab(wrapper)


def test_active_vocab_before_the_first_call_points_at_attach():
    model = TinyDrafter(40, 8).eval()
    with pytest.raises(LookupError, match=r"nanospec_fx.attach"):
        nanospec_fx.active_vocab(model)


@pytest.mark.parametrize("options, said", [
    ({"capacity": -1}, "capacity must be a positive int, got -1"),
    ({"capacty": 8}, "unknown nanospec option(s) ['capacty']"),
    ({"policy": "hybrid"}, "the 'hybrid' policy needs token frequencies"),
    ({"head": "no_such_layer"}, "nanospec: options['head']='no_such_layer' matches no projection in this graph"),
])
def test_a_bad_option_reaches_torch_compile_callers_as_our_error(options, said):
    """torch.compile checks nothing: the backend's first call raises OptionError, a ValueError that Dynamo passes
    through unwrapped (no BackendCompilerFailed), whose text is ours alone (no 'report a bug to PyTorch'), and no
    warning beside it (the error is no skipped frame: no graph-break remedies)."""
    compiled = torch.compile(TinyDrafter(40, 8).eval(), backend="nanospec", options={**options, "inductor": False})
    with pytest.raises(nanospec_fx.OptionError) as caught, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", nanospec_fx.NanoSpecWarning)
        compiled(torch.tensor([[1, 2, 3]]))
    assert isinstance(caught.value, ValueError) and not isinstance(caught.value, torch._dynamo.exc.BackendCompilerFailed)
    assert str(caught.value).startswith(said)
    assert "PyTorch" not in str(caught.value) and "TORCHDYNAMO_VERBOSE" not in str(caught.value)


def test_nanospec_fx_compile_raises_the_same_error_before_any_call():
    with pytest.raises(nanospec_fx.OptionError, match="capacity must be a positive int, got -1"):
        nanospec_fx.compile(TinyDrafter(40, 8).eval(), {"capacity": -1})
