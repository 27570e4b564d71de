"""Several heads over the token vocabulary in one graph (Medusa heads, MTP depths with their own heads).

Every projection onto the vocabulary (tied to the token embedding, or as wide as it) is rewritten, each with its
own ActiveVocab (the state is per head weight); each observes the call's fed ids before it reads its set. Depths
that share one head weight share one state. The oracle is the eager drafter with each head's logits masked by the
set its state holds when it reads them, built here from the fed ids (never from the pass).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanospec_fx
from helpers import compile_nanospec
from nanospec_fx.vocab import reports as pass_reports
V, H = 40, 8
NEG = float("-inf")


def _masked(z: torch.Tensor, active: torch.Tensor | None) -> torch.Tensor:
    return z if active is None else z.masked_fill(~active, NEG)


def _active(*ids: torch.Tensor) -> torch.Tensor:
    """The tokens a fresh set holds after observing ``ids`` (capacity above their count)."""
    return torch.isin(torch.arange(V), torch.cat([i.flatten() for i in ids]))


class Medusa(nn.Module):
    """Three heads of their own on one hidden state, stacked (a fourth projection, narrower, is not a head)."""

    def __init__(self, tied: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.heads = nn.ModuleList(nn.Linear(H, V, bias=i == 1) for i in range(3))
        self.router = nn.Linear(H, 4)
        self.tied = tied

    def forward(self, ids, _active=None):
        h = torch.tanh(self.body(self.embed(ids)))
        zs = [_masked(head(h) / (i + 1), _active) for i, head in enumerate(self.heads)]
        if self.tied:  # the embedding's own head besides them (an MTP model's main head)
            zs.append(_masked(F.linear(h, self.embed.weight), _active))
        return torch.stack(zs, dim=0), self.router(h)


class MTP(nn.Module):
    """Two depths: depth 1 scores, embeds its argmax, depth 2 scores again; ``shared`` depths use one head."""

    def __init__(self, shared: bool = False):
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(nn.Linear(2 * H, H) for _ in range(2))
        self.heads = nn.ModuleList(nn.Linear(H, V, bias=False) for _ in range(1 if shared else 2))

    def forward(self, ids, hidden, _active=None):
        outs, h = [], hidden
        for depth in range(2):
            h = torch.tanh(self.blocks[depth](torch.cat([h, self.embed(ids)], -1)))
            z = self.heads[depth % len(self.heads)](h)
            if _active is not None:
                z = _masked(z, _active[depth])
            outs.append(z)
            ids, h = z[:, -1:].argmax(-1), h[:, -1:]
        return tuple(outs)


def _call(compiled, *args):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", nanospec_fx.NanoSpecWarning)  # rewritten: nothing to warn about
        return compiled(*args)


@pytest.mark.parametrize("tied", [False, True])
def test_medusa_heads_are_each_rewritten_with_their_own_state(tied):
    model = Medusa(tied=tied).eval()
    compiled = compile_nanospec(model, capacity=16)
    ids = torch.tensor([[1, 2, 3, 7, 9]])
    out, routed = _call(compiled, ids)
    with torch.no_grad():
        expected, expected_routed = model(ids, _active=_active(ids))
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(routed, expected_routed)
    names = ["heads.0.weight", "heads.1.weight", "heads.2.weight"] + (["embed.weight"] if tied else [])
    states = [nanospec_fx.active_vocab(model, head=n) for n in names]
    assert len({id(s) for s in states}) == len(names)  # one state per head weight
    for state in states:
        assert sorted(state.token_ids().tolist()) == [1, 2, 3, 7, 9]
        assert pass_reports.reports(state)[-1].observers == 1
    # a second call with new ids: every state sees them before its head reads
    ids2 = torch.tensor([[11, 12, 1]])
    out2, _ = _call(compiled, ids2)
    with torch.no_grad():
        expected2, _ = model(ids2, _active=_active(ids, ids2))
    torch.testing.assert_close(out2, expected2)


def test_several_heads_active_vocab_asks_which_and_explain_lists_every_one():
    model = Medusa().eval()
    compiled = compile_nanospec(model, capacity=16)
    _call(compiled, torch.tensor([[1, 2]]))
    with pytest.raises(LookupError, match=r"several heads.*heads\.0\.weight.*heads\.1\.weight.*heads\.2\.weight"
                                          r".*head="):
        nanospec_fx.active_vocab(model)
    text = str(nanospec_fx.explain(model))
    assert text.startswith("nanospec: 3 head(s) rewritten")
    assert all(f"head heads.{i}.weight" in text for i in range(3))


def test_the_head_option_still_rewrites_only_the_head_it_names():
    model = Medusa().eval()
    compiled = compile_nanospec(model, capacity=16, head="heads.2")
    ids = torch.tensor([[1, 2, 3]])
    out, _ = _call(compiled, ids)
    with torch.no_grad():
        dense, _ = model(ids)
    torch.testing.assert_close(out[:2], dense[:2])
    torch.testing.assert_close(out[2], _masked(dense[2], _active(ids)))
    with pytest.raises(LookupError):
        nanospec_fx.active_vocab(model, head="heads.0")


@pytest.mark.parametrize("shared", [False, True])
def test_mtp_depths_see_the_ids_fed_before_their_head_reads(shared):
    model = MTP(shared=shared).eval()
    compiled = compile_nanospec(model, capacity=32)
    ids, hidden = torch.tensor([[4, 5, 6]]), torch.randn(1, 3, H, generator=torch.Generator().manual_seed(0))
    z1, z2 = _call(compiled, ids, hidden)
    first = _active(ids)
    drafted = z1[:, -1:].argmax(-1)  # the token depth 1 feeds depth 2 (an active one: compact argmax)
    with torch.no_grad():
        e1, e2 = model(ids, hidden, _active=[first, first | _active(drafted)])
    torch.testing.assert_close(z1, e1)
    torch.testing.assert_close(z2, e2)
    names = ["heads.0.weight"] + ([] if shared else ["heads.1.weight"])
    states = {id(nanospec_fx.active_vocab(model, head=n)): nanospec_fx.active_vocab(model, head=n) for n in names}
    assert len(states) == len(names)
    for state in states.values():  # every fed id, the drafted one too, in each state
        assert set(state.token_ids().tolist()) == set(ids.flatten().tolist()) | set(drafted.flatten().tolist())


def test_several_heads_fed_hidden_states_only_stay_dense_naming_the_head_option():
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(H, V, bias=False), nn.Linear(H, V, bias=False)

        def forward(self, h):
            return self.a(h), self.b(h)

    model = Heads().eval()
    compiled = compile_nanospec(model)
    h = torch.randn(2, H)
    with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning, match=r"several projections.*'head'"):
        a, b = compiled(h)
    torch.testing.assert_close(a, model.a(h))
    torch.testing.assert_close(b, model.b(h))


def test_a_square_weight_read_in_both_layouts_keeps_one_state_and_runs_its_transposed_reader_dense():
    class Square(nn.Module):  # one [12, 12] weight, read as F.linear(h, W) and as h @ W: two heads, one weight
        def __init__(self):
            super().__init__()
            torch.manual_seed(2)
            self.embed, self.W = nn.Embedding(12, 12), nn.Parameter(torch.randn(12, 12))

        def forward(self, ids):
            h = self.embed(ids)
            return F.linear(h, self.W), h @ self.W

    model = Square().eval()
    compiled = compile_nanospec(model, capacity=8, observe_inputs=False)
    ids = torch.tensor([[1, 2]])
    with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning, match="also read as stored"):
        a, b = compiled(ids)
    nanospec_fx.active_vocab(model).observe(ids)
    with torch.no_grad():
        a, b = compiled(ids)
        h = model.embed(ids)
    torch.testing.assert_close(a, _masked(F.linear(h, model.W), torch.isin(torch.arange(12), ids)))
    torch.testing.assert_close(b, h @ model.W)  # dense


class PrefillMedusa(Medusa):
    """A prefill call embeds the prompt and scores no head; a decode call scores every head."""

    def forward(self, ids, prefill: bool = False):
        h = torch.tanh(self.body(self.embed(ids)))
        if prefill:
            return h
        return torch.stack([head(h[:, -1]) for head in self.heads])


def test_the_prompt_of_a_prefill_call_joins_every_heads_set():
    model = PrefillMedusa().eval()
    compiled = compile_nanospec(model, capacity=32)
    prompt, step = torch.tensor([[3, 17, 22, 5, 8]]), torch.tensor([[31]])
    with torch.inference_mode():
        compiled(prompt, prefill=True)
        out = _call(compiled, step)
        h = torch.tanh(model.body(model.embed(step)))[:, -1]
        expected = torch.stack([_masked(head(h), _active(prompt, step)) for head in model.heads])
    for i in range(3):
        assert set(nanospec_fx.active_vocab(model, head=f"heads.{i}").token_ids().tolist()) == {3, 17, 22, 5, 8, 31}
    torch.testing.assert_close(out, expected)


def test_a_projection_as_wide_as_a_small_id_table_is_not_a_second_head():
    class TypedDrafter(nn.Module):  # token-type ids (2 rows) besides the tokens; a 2-way classifier on the output
        def __init__(self):
            super().__init__()
            torch.manual_seed(4)
            self.embed, self.types = nn.Embedding(V, H), nn.Embedding(2, H)
            self.lm_head, self.classify = nn.Linear(H, V, bias=False), nn.Linear(H, 2)

        def forward(self, ids, types):
            h = torch.tanh(self.embed(ids) + self.types(types))
            return self.lm_head(h), self.classify(h)

    model = TypedDrafter().eval()
    ids, types = torch.tensor([[2, 3, 4]]), torch.tensor([[0, 0, 0]])  # no id 1 fed anywhere
    z, c = _call(compile_nanospec(model, capacity=16), ids, types)
    with torch.no_grad():
        h = torch.tanh(model.embed(ids) + model.types(types))
    torch.testing.assert_close(c, model.classify(h))  # class 1 (never fed) keeps its logit
    torch.testing.assert_close(z, _masked(model.lm_head(h), _active(ids)))


def test_assert_equivalent_checks_every_head_each_against_its_own_set():
    from nanospec_fx.testing import assert_equivalent

    model = Medusa().eval()
    ids = torch.tensor([[1, 2, 3]])
    states = assert_equivalent(model, (ids,), options={"capacity": 16}, reset_dynamo=True)
    assert sorted(states) == ["heads.0.weight", "heads.1.weight", "heads.2.weight"]
    sets = [frozenset(s.token_ids().tolist()) for s in states.values()]
    assert len(set(sets)) == 3 and all({1, 2, 3} <= s for s in sets), "three sets told apart, each holds the fed ids"
    mtp, hidden = MTP().eval(), torch.randn(1, 3, H, generator=torch.Generator().manual_seed(0))
    # depth 2 embeds depth 1's argmax, taken among active tokens: the reference masks each depth with its head's set
    states = assert_equivalent(mtp, (ids, hidden), options={"capacity": 16}, reset_dynamo=True,
                               reference=lambda masks: mtp(ids, hidden, [masks["heads.0.weight"],
                                                                         masks["heads.1.weight"]]))
    assert sorted(states) == ["heads.0.weight", "heads.1.weight"]

    import nanospec_fx.testing as testing

    real = testing._check_close
    with pytest.raises(AssertionError, match=r"finite logits outside the set of every head"):
        testing._check_rows_of_several_heads(
            "out", torch.zeros(2, V), torch.zeros(2, V),
            {"a": torch.arange(V) < 3, "b": (torch.arange(V) >= 3) & (torch.arange(V) < 6)}, None, None)
    assert testing._check_close is real

    def reference(mask):  # only heads.1 rewritten: its logits masked, the others dense
        stacked, routed = model(ids)
        return torch.stack([stacked[0], _masked(stacked[1], mask), stacked[2]]), routed

    state = assert_equivalent(model, (ids,), options={"head": "heads.1", "capacity": 16}, reset_dynamo=True,
                              reference=reference)
    assert sorted(state.token_ids().tolist()) == [1, 2, 3]
