"""VocabConfig: the one spelling of the vocabulary options, as the backend, attach and state_for read them."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nanospec_fx
from nanospec_fx.compiler.options import NanoSpecOptions, split_keywords
from nanospec_fx.vocab.policies import FrequencyTable, resolve
from nanospec_fx.vocab.state import state_for
from nanospec_fx.vocab.config import StateConfig, VocabConfig


def test_defaults_are_the_named_constants_and_the_backend_options_default_to_them():
    config = NanoSpecOptions.parse({}).vocab_config
    assert (config.capacity, config.static_size, config.pinned_size, config.policy) == (3072, 32768, 1024, "context")
    assert nanospec_fx.DEFAULT_CAPACITY == 3072 and VocabConfig().num_pinned == 0


def test_every_vocabulary_option_is_a_backend_option_and_a_keyword():
    given = {"capacity": 64, "num_pinned": 3, "policy": "hybrid", "frequencies": [1, 2, 3], "static_size": 7,
             "pinned_size": 5, "draft_to_target": [0, 2], "target_vocab_size": 9}
    assert set(given) == VocabConfig.names()  # the test names every field: a new one must be added here
    config = NanoSpecOptions.parse(dict(given)).vocab_config
    assert {name: getattr(config, name) for name in given} == given
    options, rest = split_keywords(None, {**given, "dynamic": False})
    assert options == given and rest == {"dynamic": False}


@pytest.mark.parametrize("options, message", [
    ({"capacity": 0}, "capacity must be a positive int"),
    ({"capacity": True}, "capacity must be a positive int"),
    ({"capacity": 4, "num_pinned": 4}, "num_pinned must be an int in [0, capacity)"),
    ({"num_pinned": True}, "num_pinned must be an int in [0, capacity)"),
    ({"policy": "lru"}, "policy must be one of"),
    ({"static_size": -1}, "static_size must be a positive int"),
    ({"target_vocab_size": 0}, "target_vocab_size must be a positive int"),
    ({"vocab_config": VocabConfig()}, "unknown nanospec option"),
])
def test_bad_values_raise_when_parsed(options, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        NanoSpecOptions.parse(options)


def test_resolve_applies_each_policy():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])  # most frequent first, ties by smaller id: 2, 3, 5, 0, 4, 1
    assert resolve(VocabConfig(capacity=4, num_pinned=1)).keywords() == {
        "capacity": 4, "num_pinned": 1, "seed_ids": None, "observes": True, "policy": "context", "token_to_row": None}
    static = resolve(VocabConfig(policy="static", frequencies=counts, static_size=3))
    assert (static.capacity, static.num_pinned, static.observes) == (3, 0, False)
    assert static.seed_ids.tolist() == [2, 3, 5]
    hybrid = resolve(VocabConfig(capacity=5, policy="hybrid", frequencies=FrequencyTable(counts), pinned_size=2))
    assert (hybrid.capacity, hybrid.num_pinned, hybrid.observes, hybrid.seed_ids.tolist()) == (5, 2, True, [2, 3])
    with pytest.raises(ValueError, match="pinned_size must be in"):
        resolve(VocabConfig(capacity=2, policy="hybrid", frequencies=counts, pinned_size=2))
    with pytest.raises(ValueError, match="needs token frequencies"):
        resolve(VocabConfig(policy="static"))


def test_resolve_maps_target_tokens_to_head_rows():
    t2r = resolve(VocabConfig(draft_to_target=[4, 1, 6], target_vocab_size=8)).token_to_row
    assert t2r.tolist() == [-1, 1, -1, -1, 0, -1, 2, -1]
    assert resolve(VocabConfig(draft_to_target=[4, 1])).token_to_row.numel() == 5  # largest id + 1
    with pytest.raises(ValueError, match="target_vocab_size=3"):
        resolve(VocabConfig(draft_to_target=[4], target_vocab_size=3))


def test_differences_name_what_changed():
    base = StateConfig(8, 1, seed_ids=torch.tensor([1, 2]))
    assert base.differences(StateConfig(8, 1, seed_ids=torch.tensor([1, 2]))) == []
    assert base.differences(StateConfig(9, 1, seed_ids=torch.tensor([1, 3]), policy="hybrid")) == [
        "capacity: 8 -> 9", "policy: 'context' -> 'hybrid'",
        "the policy's seed tokens (frequencies/static_size/pinned_size)"]


def test_state_for_takes_either_config_and_reuses_the_state_for_an_equal_one():
    w = torch.randn(10, 4)
    state = state_for(w, None, VocabConfig(capacity=4, policy="static", frequencies=torch.arange(10), static_size=4))
    assert (state.capacity, state.observes, sorted(state.token_ids().tolist())) == (4, False, [6, 7, 8, 9])
    again = state_for(w, None, StateConfig(4, seed_ids=torch.tensor([9, 8, 7, 6]), observes=False, policy="static"))
    assert again is state and again.generation == 0  # equal configuration: not rebuilt
    assert state.config().differences(resolve(VocabConfig(capacity=4, policy="static", frequencies=torch.arange(10),
                                                          static_size=4))) == []


def test_attach_and_the_on_demand_state_use_the_same_config():
    model = nn.Sequential(nn.Linear(4, 16, bias=False))
    created = nanospec_fx.active_vocab(model, head="0.weight")  # on demand: the defaults, clamped to 16 rows
    assert (created.capacity, created.policy, created.num_pinned) == (16, "context", 0)
    attached = nanospec_fx.attach(model, head="0", capacity=8, num_pinned=2)
    assert attached is created and (attached.capacity, attached.num_pinned) == (8, 2)
