"""The coverage simulation on hand-made requests whose answers are known."""
import pytest
import torch

import nanospec_fx
from nanospec_fx.eval import coverage as C
from helpers import tiny_llama


def req(prompt, cont, predicted=None, category="t"):
    return C.Request(category, list(prompt), list(cont), predicted)


def test_context_counts_prompt_and_committed_tokens():
    # prompt 1 2 3; continuation 2 4 4 1 5: hits are 2 (prompt), 4 (second time), 1 (prompt)
    tr = C.simulate(req([1, 2, 3], [2, 4, 4, 1, 5]), C.context(capacity=None))
    assert tr.hits == 3
    assert tr.sizes == [3, 3, 4, 4, 4]  # |A| when each token is drafted


def test_full_and_static():
    r = req([1, 2], [1, 7, 9, 3])
    full = C.simulate(r, C.full(100))
    assert (full.hits, full.sizes) == (4, [100] * 4)
    st = C.simulate(r, C.static([9, 3, 5, 1], 2))  # the top-2 of the table: {9, 3}
    assert (st.hits, st.sizes) == (2, [2] * 4)


def test_target_topk_is_known_only_after_verification():
    # predicted[j] = the target's guesses for token j. The guess for the token being drafted
    # (here always right) must never count.
    prompt, cont = [10, 11], [20, 21, 22]
    predicted = [[], [11], [20], [21], [22]]
    tr = C.simulate(req(prompt, cont, predicted), C.context(capacity=None, topk=1))
    assert tr.hits == 0
    # A guess for an *earlier* token that names a later one does count, once that position is verified.
    predicted = [[], [11], [21], [22], [99]]  # at position 1 the target guessed 21 for token 2
    tr = C.simulate(req(prompt, cont, predicted), C.context(capacity=None, topk=1))
    # 20: not known (predicted[2]=[21] is for token 2 itself, unknown while drafting it) -> miss
    # 21: predicted[2]=[21] known after token 2 is verified -> hit; 22: predicted[3]=[22] -> hit
    assert tr.hits == 2


def test_replay_gives_the_set_each_token_is_drafted_from():
    # prompt 10 11; the target's top-1 for tokens 1..4: 11, 20, 30, 40; continuation 20 21 (capacity 3: FIFO)
    prompt, cont = [10, 11], [20, 21]
    predicted = [[], [11], [30], [40]]
    sets = [(t, sorted(active)) for t, active in C.replay(req(prompt, cont, predicted), C.context(3, topk=1))]
    # token 2 (20): the prompt and the guess at prompt position 1 (11); token 3 (21): + 20 committed, + 30 (the
    # guess for token 2, verified), which evicts the oldest (10)
    assert sets == [(2, [10, 11]), (3, [11, 20, 30])]
    with pytest.raises(ValueError, match="no context set"):
        next(C.replay(req(prompt, cont), C.static([1], 1)))


def test_prefill_adds_the_targets_guesses_at_prompt_positions():
    prompt, cont = [10, 11, 12], [30]
    predicted = [[], [30], [12], [40]]  # guess for prompt token 1 was 30
    tr = C.simulate(req(prompt, cont, predicted), C.context(capacity=None, topk=1))
    # A = prompt {10, 11, 12} + guesses {30, 12}; the guess for token 3 itself (40) is not known
    assert tr.hits == 1 and tr.sizes == [4]


def test_without_prompt_topk_prefill_adds_only_the_prompt():
    prompt, cont = [10, 11, 12], [30, 12]
    predicted = [[], [30], [12], [40], [41]]
    policy = C.context(capacity=None, topk=1, prompt_topk=False)
    tr = C.simulate(req(prompt, cont, predicted), policy)
    # A = the prompt {10, 11, 12}; the guess 30 at a prompt position is never observed; 12 is in the prompt
    assert tr.hits == 1 and tr.sizes[0] == 3
    assert policy.family == "context+top1-noprompt"


def test_rounds_delay_the_targets_guesses():
    # predicted[3] = [7]: the target's guess at position 2 (for token 3) names token 7 = token 4.
    prompt, cont = [1, 2], [3, 5, 7, 8]
    predicted = [[], [1], [2], [7], [0], [0]]
    per_token = C.simulate(req(prompt, cont, predicted), C.context(capacity=None, topk=1), verify_every=1)
    per_round = C.simulate(req(prompt, cont, predicted), C.context(capacity=None, topk=1), verify_every=4)
    # per token: drafting token 4 (=5) knows predicted[<=3] = {7}: 5 misses; 7 (token 5) is hit
    assert per_token.hits == 1
    # one round of 4 tokens: no top-k learned during the round, 7 is a miss
    assert per_round.hits == 0


def test_capacity_evicts_oldest_and_keeps_pinned():
    s = C.active_set(capacity=3, num_pinned=1)
    s.observe([5, 6, 7])
    s.observe([8])  # full: evicts 6 (oldest unpinned), 5 is pinned
    assert set(s) == {5, 7, 8} and len(s) == 3
    s.observe([7, 9])  # 7 already in but oldest: the call feeds it and both fit, so 7 is renewed and 9 evicts 8
    assert set(s) == {5, 7, 9}
    s.observe([10])  # 7 was renewed before 9: it is now the oldest of the ring
    assert set(s) == {5, 9, 10}


def test_fifo_ignores_reobservation_lru_refreshes():
    fifo, lru = C.active_set(3, eviction="fifo"), C.active_set(3, eviction="lru")
    for s in (fifo, lru):
        s.observe([1, 2, 3])
        s.observe([1])  # re-observed
        s.observe([4])  # evicts the oldest: 1 (first insertion) or 2 (least recently observed)
    assert set(fifo) == {2, 3, 4} and set(lru) == {1, 3, 4}
    with pytest.raises(ValueError, match="eviction"):
        C.active_set(3, eviction="random")


def test_lru_policy_is_a_separate_family_and_changes_coverage():
    r = req(prompt=[1, 2], cont=[1, 3, 1, 2], category="x")
    fifo, lru = C.context(2), C.context(2, eviction="lru")
    assert fifo.family == "context" and lru.family == "context-lru" and lru.name == "context-lru@2"
    # FIFO: 1 is evicted by 3 although it was just committed again; LRU keeps it.
    assert C.simulate(r, fifo).hits == 1 and C.simulate(r, lru).hits == 2


def test_the_fifo_set_is_the_ring_model_the_kernel_tests_use():
    """One model of the ring: the coverage replays requests through the same class the kernel tests judge by."""
    from nanospec_fx.vocab.ring_model import RingModel

    assert type(C.active_set(8, num_pinned=2)) is RingModel


def test_hybrid_core_is_pinned_and_counted():
    table = [100, 101, 102]
    pol = C.hybrid(table, core=2, capacity=4)
    tr = C.simulate(req([1, 2], [101, 3, 1, 102]), pol)
    # A = {100, 101} pinned + {1, 2}; 101 hit; 3 miss (joins, evicts 1); 1 miss; 102 miss
    assert tr.hits == 1
    assert tr.sizes == [4, 4, 4, 4]


def test_active_set_matches_the_real_active_vocab():
    # The simulation's eviction must be the backend's: replay the same insertions into both.
    torch.manual_seed(0)
    V, cap, pinned = 50, 8, 2
    weight = torch.randn(V, 4)
    av = nanospec_fx.ActiveVocab(weight, capacity=cap, num_pinned=pinned)
    sim = C.active_set(cap, num_pinned=pinned)
    for step in range(40):
        ids = torch.randint(0, V, (int(torch.randint(1, 3, ())),))
        av.observe(ids)
        sim.observe(ids.tolist())
        assert set(av.token_ids().tolist()) == set(sim), step


def test_percentile():
    assert C.percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 95) == 10
    assert C.percentile([4], 95) == 4


def test_evaluate_aggregates_per_category_and_all():
    reqs = [req([1], [1, 2], category="a"), req([5], [5, 5, 6], category="b")]
    res = {(r.category, r.policy): r for r in C.evaluate(reqs, [C.context(None), C.full(10)])}
    assert res[("a", "context@inf")].coverage == pytest.approx(1 / 2)
    assert res[("b", "context@inf")].coverage == pytest.approx(2 / 3)
    assert res[("all", "context@inf")].coverage == pytest.approx(3 / 5)
    assert res[("all", "context@inf")].tokens == 5 and res[("all", "context@inf")].requests == 2
    assert res[("all", "full")].coverage == 1 and res[("all", "full")].mean_size == 10


def test_target_predictions_matches_full_logits():
    model = tiny_llama(64, 1, 0, hidden=16, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, 64, (11,)).tolist()
    pred = C.target_predictions(model, ids, k=3, chunk=4)
    logits = model(torch.tensor([ids])).logits[0]
    assert pred[0] == [] and len(pred) == len(ids)
    for j in range(1, len(ids)):
        assert pred[j] == logits[j - 1].topk(3).indices.tolist()
