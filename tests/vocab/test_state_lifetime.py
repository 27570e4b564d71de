"""The ActiveVocab's lifetime: it lives outside the head weight (a registry weakly keyed by it),
so a drafter stays picklable, saveable and copyable after a compiled call, a copy gets its own state,
and the registry keeps neither the weight nor the state alive."""
from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch

import nanospec_fx
from mlp_drafter import V, Drafter  # beside this file

IDS = torch.tensor([[1, 2, 3]])


def compiled_once(**kw):
    model = Drafter("linear", **kw).eval()
    compiled = torch.compile(model, backend="nanospec", options={"inductor": False, "capacity": 16})
    with torch.no_grad():
        compiled(IDS)
    return model, compiled


def masked_eager(model, ids):
    with torch.no_grad():
        return model(ids, _mask=nanospec_fx.active_vocab(model).contains(torch.arange(V)))


@pytest.mark.parametrize("what", ["model", "state_dict_keep_vars", "weight"])
def test_torch_save_and_load_after_a_compiled_call(what):
    model, _ = compiled_once(bias=True)
    obj = {"model": model, "state_dict_keep_vars": model.state_dict(keep_vars=True),
           "weight": model.lm_head.weight}[what]
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    weight = {"model": lambda o: o.lm_head.weight, "state_dict_keep_vars": lambda o: o["lm_head.weight"],
              "weight": lambda o: o}[what](loaded)
    assert torch.equal(weight, model.lm_head.weight)
    assert nanospec_fx.vocab.state.registered_state(weight) is None, "a loaded copy must not share the original's state"


def test_pickle_and_deepcopy_give_a_drafter_that_compiles_with_its_own_state():
    model, compiled = compiled_once()
    original = nanospec_fx.active_vocab(model)
    for twin in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert nanospec_fx.vocab.state.registered_state(twin.lm_head.weight) is None
        twin_compiled = torch.compile(twin, backend="nanospec", options={"inductor": False, "capacity": 16})
        with torch.no_grad():
            out = twin_compiled(torch.tensor([[7, 8, 9]]))
        mine = nanospec_fx.active_vocab(twin)
        assert mine is not original and sorted(mine.token_ids().tolist()) == [7, 8, 9]
        torch.testing.assert_close(out, masked_eager(twin, torch.tensor([[7, 8, 9]])))
    # The original keeps working on its own state, which the copies did not touch.
    with torch.no_grad():
        out = compiled(torch.tensor([[4, 5, 6]]))
    assert nanospec_fx.active_vocab(model) is original
    assert sorted(original.token_ids().tolist()) == [1, 2, 3, 4, 5, 6]
    torch.testing.assert_close(out, masked_eager(model, torch.tensor([[4, 5, 6]])))


def test_the_registry_keeps_neither_the_weight_nor_the_state_alive():
    model = Drafter("linear").eval()
    state = nanospec_fx.attach(model, head="lm_head")
    weight_ref, state_ref = weakref.ref(model.lm_head.weight), weakref.ref(state)
    del state
    gc.collect()
    assert state_ref() is not None, "the state lives as long as its weight"
    del model
    gc.collect()
    assert weight_ref() is None, "the registry (or the state) kept the head weight alive"
    assert state_ref() is None, "the state outlived its weight"


def test_a_state_whose_weight_was_freed_says_so():
    model = Drafter("linear").eval()
    state = nanospec_fx.attach(model, head="lm_head")
    del model
    gc.collect()
    with pytest.raises(RuntimeError, match="head weight of this active vocabulary was freed"):
        state.observe([1])


def test_a_drafter_only_passed_to_attach_reaches_its_state():
    model = Drafter("linear").eval()
    state = nanospec_fx.attach(model, head="lm_head", capacity=8)
    assert nanospec_fx.active_vocab(model) is state
    assert nanospec_fx.active_vocab(model, head="lm_head") is state
    assert nanospec_fx.active_vocab(model.lm_head.weight) is state
