"""Active-vocabulary policies (context, static, hybrid), frequency tables and draft vocabularies."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nanospec_fx
from nanospec_fx import FrequencyTable
from drafters import TinyDrafter
from helpers import active_mask, compile_nanospec
from nanospec_fx.vocab import reports as pass_reports
def test_frequency_table_counts_ranks_and_round_trips(tmp_path):
    table = FrequencyTable.from_token_ids([[3, 3, 1], torch.tensor([[1, 3], [5, 0]])], vocab_size=8)
    assert table.counts.tolist() == [1, 2, 0, 3, 0, 1, 0, 0]
    assert table.top(3).tolist() == [3, 1, 0]  # ties (0 and 5, one each): smaller id first
    path = tmp_path / "freq.txt"
    table.save(path)
    assert torch.equal(FrequencyTable.load(path).counts, table.counts)
    path.write_text("not a table\n")
    with pytest.raises(ValueError, match="not a nanospec-fx frequency table"):
        FrequencyTable.load(path)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        FrequencyTable.from_token_ids([[9]], vocab_size=8)


def test_frequency_table_from_texts_uses_the_tokenizer():
    class CharTokenizer:
        def encode(self, text):
            return [ord(c) - ord("a") for c in text]

        def __len__(self):
            return 26

    table = FrequencyTable.from_texts(["abba", "b"], CharTokenizer())
    assert table.top(2).tolist() == [1, 0]


def test_static_policy_is_a_fixed_frequent_set():
    torch.manual_seed(0)
    model = TinyDrafter(100, 8).eval()
    counts = torch.zeros(100, dtype=torch.long)
    counts[[7, 8, 9, 10]] = torch.tensor([5, 4, 3, 2])
    compiled = compile_nanospec(model, policy="static", frequencies=counts, static_size=3)
    ids = torch.tensor([[50, 60]])
    with torch.no_grad():
        out = compiled(ids)
    state = nanospec_fx.active_vocab(model)
    assert state.token_ids().tolist() == [7, 8, 9]  # inputs are not observed
    assert pass_reports.reports(state)[-1].observers == 0
    torch.testing.assert_close(out, model(ids, _mask=active_mask(model)))
    state.observe([1, 2])  # a frozen set ignores observe
    state.reset()  # and reset re-seeds it
    assert state.token_ids().tolist() == [7, 8, 9]


def test_hybrid_policy_pins_a_frequent_core_and_adds_context():
    torch.manual_seed(0)
    model = TinyDrafter(100, 8).eval()
    counts = torch.arange(100)  # 99 is the most frequent
    compiled = compile_nanospec(model, policy="hybrid", frequencies=counts, pinned_size=2, capacity=6)
    with torch.no_grad():
        compiled(torch.tensor([[1, 2, 3]]))
        state = nanospec_fx.active_vocab(model)
        assert state.token_ids().tolist() == [99, 98, 1, 2, 3]
        compiled(torch.tensor([[4, 5, 6, 7]]))  # the ring of 4 context slots evicts 1,2,3; the core stays
    assert state.token_ids().tolist()[:2] == [99, 98]
    assert sorted(state.token_ids().tolist()[2:]) == [4, 5, 6, 7]
    state.reset()
    assert state.token_ids().tolist() == [99, 98]


@pytest.mark.parametrize("options, message", [
    ({"policy": "static"}, "needs token frequencies"),
    ({"policy": "sometimes"}, "policy must be one of"),
    ({"policy": "hybrid", "frequencies": torch.ones(100), "pinned_size": 8, "capacity": 8}, "pinned_size"),
])
def test_policy_errors_are_clear(options, message):
    model = TinyDrafter(100, 8).eval()
    with pytest.raises(Exception, match=message), torch.no_grad():
        compile_nanospec(model, **options)(torch.tensor([[1]]))


class Eagle3StyleDrafter(nn.Module):
    """Embeds *target* ids (V_t rows) but its head covers a draft vocabulary of R < V_t tokens."""

    def __init__(self, target_vocab: int, draft_vocab: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(target_vocab, hidden)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)

    def forward(self, ids):
        return self.lm_head(self.embed(ids))


def test_draft_vocabulary_lives_in_target_id_space():
    torch.manual_seed(0)
    target_vocab, draft_vocab = 200, 50
    d2t = torch.randperm(target_vocab)[:draft_vocab]  # head row r predicts target token d2t[r]
    model = Eagle3StyleDrafter(target_vocab, draft_vocab, 8).eval()
    compiled = compile_nanospec(model, draft_to_target=d2t, target_vocab_size=target_vocab, capacity=16)
    inside, outside = d2t[:3], torch.tensor([t for t in range(target_vocab) if t not in set(d2t.tolist())][:2])
    ids = torch.cat([inside, outside]).unsqueeze(0)
    with torch.no_grad():
        logits = compiled(ids)
    state = nanospec_fx.active_vocab(model)
    assert state.vocab_size == target_vocab
    assert sorted(state.token_ids().tolist()) == sorted(inside.tolist()), "only draft-vocabulary tokens can be active"
    assert state.contains(inside).all() and not state.contains(outside).any()
    rows_active = torch.isin(d2t, inside)
    assert torch.isneginf(logits[..., ~rows_active]).all()
    torch.testing.assert_close(logits[..., rows_active], model(ids)[..., rows_active])
    state.observe(d2t[10:12])  # observe takes target ids
    assert state.contains(d2t[10:12]).all()


def test_frequencies_that_are_not_counts_are_refused(tmp_path):
    """Probabilities cast to int64 would all be 0 (the set would be the first ids), a mask is no count, and a table
    file's bad line is named by its line number instead of being read as another token's count."""
    with pytest.raises(ValueError, match="whole numbers"):
        FrequencyTable(torch.tensor([0.0, 0.5, 0.3, 0.2]))
    with pytest.raises(TypeError, match="numbers of occurrences"):
        FrequencyTable(torch.tensor([True, False]))
    assert FrequencyTable(torch.tensor([0.0, 3.0, 1.0])).top(1).tolist() == [1]  # whole floats are counts
    for line, why in [("-1 100", "outside"), ("8 1", "outside"), ("2 -3", "negative count"), ("1 4", "twice")]:
        path = tmp_path / "freq.txt"
        path.write_text(f"# nanospec-fx frequency table vocab_size=8\n1 2\n{line}\n")
        with pytest.raises(ValueError, match=rf"freq.txt:3: .*{why}"):
            FrequencyTable.load(path)


def test_a_draft_vocabulary_with_a_repeated_target_id_is_refused():
    with pytest.raises(ValueError, match=r"several head rows to one target token id \(\[2\]\)"):
        nanospec_fx.vocab.policies.token_to_row([0, 2, 2, 5], 8)


def test_static_and_hybrid_sets_over_a_draft_vocabulary_seed_tokens_the_head_has():
    """Seeds are target ids; only those with a head row can be active. The static set is the most frequent of those
    (the default static_size, larger than the head, fits); the hybrid core pins as many of them as it seeds, so no
    context token takes a pinned slot (the plain-Python ring with that core is the oracle)."""
    from nanospec_fx.vocab.config import VocabConfig
    from nanospec_fx.vocab.ring_model import RingModel
    from nanospec_fx.vocab.state import state_for

    target_vocab, d2t = 20, torch.arange(0, 16, 2)  # head row r predicts target token 2r: the odd ids have no row
    counts = torch.zeros(target_vocab, dtype=torch.int64)
    counts[[1, 0, 3, 4, 6]] = torch.tensor([9, 8, 7, 6, 5])
    common = dict(frequencies=counts, draft_to_target=d2t, target_vocab_size=target_vocab)
    weights = torch.randn(8, 4), torch.randn(8, 4)  # held: a state holds its head weight weakly
    static = state_for(weights[0], None, VocabConfig(policy="static", **common))
    assert static.token_ids().tolist() == [0, 4, 6, 2, 8, 10, 12, 14]  # by count, then by id; every row fits
    hybrid = state_for(weights[1], None, VocabConfig(policy="hybrid", pinned_size=2, capacity=4, **common))
    assert hybrid.token_ids().tolist() == [0, 4]
    ring = RingModel(4, num_pinned=2)
    ring.observe([0, 4])
    for token in (10, 12, 14, 6, 8):
        hybrid.observe([token])
        ring.observe([token])
        assert sorted(hybrid.token_ids().tolist()) == sorted(ring.slot_of), token


def test_assert_equivalent_checks_a_draft_vocabulary_head_over_its_rows():
    """A draft-vocabulary head's logits are over its R rows: the checker masks them per row (the row's target token
    active or not) and expects only the fed ids the head has a row for to be active; a reference gets the row mask.
    A reference that does not mask inactive rows still fails."""
    from nanospec_fx.testing import assert_equivalent

    torch.manual_seed(0)
    target_vocab, draft_vocab = 200, 50
    d2t = torch.randperm(target_vocab)[:draft_vocab]
    model = Eagle3StyleDrafter(target_vocab, draft_vocab, 8).eval()
    outside = torch.tensor([t for t in range(target_vocab) if t not in set(d2t.tolist())][:2])
    ids = torch.cat([d2t[:3], outside]).unsqueeze(0)
    options = {"draft_to_target": d2t, "target_vocab_size": target_vocab, "capacity": 16}
    state = assert_equivalent(model, (ids,), options=options)
    assert sorted(state.token_ids().tolist()) == sorted(d2t[:3].tolist())
    seen = []

    def reference(mask):
        seen.append(mask)
        return model(ids).masked_fill(~mask, float("-inf"))

    assert_equivalent(model, (ids,), options=options, reference=reference)
    assert seen[0].shape == (draft_vocab,) and seen[0].sum() == 3
    with pytest.raises(AssertionError, match=r"differ from reference\(mask\)"):
        assert_equivalent(model, (ids,), options=options, reference=lambda mask: model(ids))
