"""Speculative sampling rules (nanospec_fx/sampling.py) and the distribution tests of nanospec_fx.testing.

The rules are checked at the distribution level: thousands of seeded single-position rounds,
with a draft distribution that is zero outside a small active set, must produce the target's
distribution exactly (chi-square at alpha = 1e-3), while two classic mistakes must be caught:
verifying against the unpruned q, and a residual restricted to the active set.
"""
from __future__ import annotations

import pytest
import torch

from nanospec_fx.sampling import SpeculativeSampler
from nanospec_fx.testing import (
    ChiSquareResult, assert_same_distribution, chi2_sf, chi_square_test, sequence_cells, sequence_distribution,
    two_sample_chi_square_test,
)

V = 12
ACTIVE = torch.tensor([0, 3, 4, 7])  # the drafter's active vocabulary


def distributions():
    """Target p (top-10 of V: two tokens impossible) and the drafter's dense and pruned q."""
    g = torch.Generator().manual_seed(0)
    target_logits, drafter_logits = torch.randn(V, generator=g) * 1.5, torch.randn(V, generator=g) * 1.5
    drafter_logits[3] += 2.0  # the drafter is over-confident on an active token
    p = SpeculativeSampler(top_k=10).probs(target_logits)
    dense_q = SpeculativeSampler().probs(drafter_logits)
    pruned = torch.full((V,), float("-inf"))
    pruned[ACTIVE] = drafter_logits[ACTIVE]
    return p, dense_q, SpeculativeSampler().probs(pruned)


class UnprunedQ(SpeculativeSampler):
    """Broken: draws from the pruned q but verifies against the dense one."""

    dense_q = distributions()[1]

    def verify(self, p, q, candidates, generator=None):
        return super().verify(p, self.dense_q, candidates, generator)


class ActiveResidual(SpeculativeSampler):
    """Broken: the residual is renormalised over the active set only."""

    def residual(self, p, q):
        r = super().residual(p, q).clone()
        keep = torch.zeros_like(r, dtype=torch.bool)
        keep[ACTIVE] = True
        r = r.masked_fill(~keep, 0)
        return r / r.sum() if r.sum() > 0 else p


def one_position_samples(sampler, candidates: int, n: int, seed: int = 0) -> torch.Tensor:
    p, _, q = distributions()
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens, exists = sampler.draw(q, candidates, g)
        out.append(sampler.verify(p, q, tokens[exists], g)[1])
    return torch.tensor(out)


# ----------------------------------------------------------------------------- the rules
@pytest.mark.parametrize("candidates", [1, 3, 6], ids=["chain", "3-candidates", "all-active-and-more"])
def test_verification_with_a_pruned_draft_keeps_the_target_distribution(candidates):
    p = distributions()[0]
    samples = one_position_samples(SpeculativeSampler(), candidates, 2000)
    result = assert_same_distribution(samples, p)
    print(f"{candidates} candidate(s): {result}")
    assert result.num_samples == 2000 and result.dof >= 6
    outside = ~torch.isin(samples, ACTIVE)
    assert outside.float().mean() == pytest.approx(float(p[~torch.isin(torch.arange(V), ACTIVE)].sum()), abs=0.03), (
        "tokens outside the active set come only from the residual, at the target's rate"
    )


@pytest.mark.parametrize(
    "broken", [UnprunedQ, ActiveResidual], ids=["q-from-unpruned-logits", "residual-on-active-set"]
)
def test_the_chi_square_test_catches_broken_samplers(broken):
    p = distributions()[0]
    result = chi_square_test(one_position_samples(broken(), 1, 2000), p)
    assert result.rejected and result.p_value < 1e-6, str(result)
    print(f"{broken.__name__}: {result}")


def test_no_nan_when_q_equals_p_one_token_is_active_or_the_target_excludes_the_draft():
    s, g = SpeculativeSampler(), torch.Generator().manual_seed(1)
    p = distributions()[0]
    assert torch.equal(s.residual(p, p), p)  # no mass left: p itself, not 0/0
    one_hot = torch.zeros(V)
    one_hot[3] = 1.0
    for _ in range(50):
        index, token = s.verify(p, one_hot, torch.tensor([3]), g)
        assert 0 <= token < V and p[token] > 0
    impossible = int((p == 0).nonzero()[0])  # the target's top-k excludes it: always rejected
    q = torch.zeros(V)
    q[impossible] = 1.0
    assert all(s.verify(p, q, torch.tensor([impossible]), g)[0] == -1 for _ in range(50))
    assert torch.isfinite(s.residual(p, q)).all()
    assert s.verify(p, q, torch.tensor([], dtype=torch.long), g)[0] == -1  # nothing drafted: sample p


def test_draw_is_without_replacement_and_marks_missing_candidates():
    _, _, q = distributions()
    tokens, exists = SpeculativeSampler().draw(q.expand(200, V), 6, torch.Generator().manual_seed(0))
    assert exists[:, :4].all() and not exists[:, 4:].any()  # 4 active tokens
    assert all(set(row) == set(ACTIVE.tolist()) for row in tokens[:, :4].tolist())
    first = torch.bincount(tokens[:, 0], minlength=V).float() / 200
    assert first[3] == pytest.approx(float(q[3]), abs=0.1)  # the first draw follows q


def test_warp_matches_transformers_logits_warpers():
    pytest.importorskip("transformers")
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    for temperature, top_k, top_p in [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.6), (1.0, 50, 0.9)]:
        logits = torch.randn(8, 40, generator=g) * 2
        logits[:, :10] = float("-inf")  # inactive tokens
        warpers = [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else []) + (
            [TopPLogitsWarper(top_p)] if top_p < 1 else [])
        expected = LogitsProcessorList(warpers)(None, logits.clone())
        assert torch.equal(SpeculativeSampler(temperature, top_k, top_p).warp(logits), expected)


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=0), dict(top_k=-1), dict(top_k=2.5), dict(top_p=0), dict(top_p=1.5)]
)
def test_bad_sampling_settings_raise(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SpeculativeSampler(**kwargs)


# ----------------------------------------------------------------------------- the statistical test
def test_chi2_survival_function_matches_tables():
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, abs=1e-6)
    assert chi2_sf(18.307038, 10) == pytest.approx(0.05, abs=1e-6)
    assert chi2_sf(0.0, 4) == 1.0 and chi2_sf(5.0, 0) == 1.0


def test_false_alarm_rate_is_alpha():
    """Exact samples of a distribution over 2-token sequences: the test rejects about alpha of the time."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(8 * 8, generator=g) * 1.5, 0).view(8, 8)
    rejections = 0
    for _ in range(200):
        cells = torch.multinomial(probs.flatten(), 500, replacement=True, generator=g)
        rejections += chi_square_test(torch.stack([cells // 8, cells % 8], 1), probs, alpha=0.05).rejected
    assert 0.015 <= rejections / 200 <= 0.095, rejections


def test_impossible_samples_reject_and_rare_cells_are_pooled():
    probs = torch.tensor([0.5, 0.3, 0.19, 0.01, 0.0])
    g = torch.Generator().manual_seed(0)
    samples = torch.multinomial(probs, 200, replacement=True, generator=g)
    result = chi_square_test(samples, probs)
    assert not result.rejected and result.num_cells == 3  # 0.19 * 200 + 0.01 * 200 and the 0 cell pooled
    bad = chi_square_test(torch.cat([samples, torch.tensor([4])]), probs)
    assert bad.rejected and bad.impossible == 1 and "probability 0" in str(bad)
    with pytest.raises(AssertionError, match="differs from"):
        assert_same_distribution(torch.cat([samples, torch.tensor([4])]), probs)


def test_two_sample_test_compares_with_samples_of_the_target_alone():
    g = torch.Generator().manual_seed(0)
    probs, other = torch.softmax(torch.randn(10, generator=g), 0), torch.softmax(torch.randn(10, generator=g), 0)
    a, b = (torch.multinomial(probs, 3000, True, generator=g) for _ in range(2))
    c = torch.multinomial(other, 3000, True, generator=g)
    assert isinstance(assert_same_distribution(a, reference_samples=b, vocab_size=10), ChiSquareResult)
    assert two_sample_chi_square_test(c, b, 10).rejected


def test_two_sample_test_sees_every_token_of_long_sequences_over_a_large_vocabulary():
    """Sequences are numbered by what was seen, not by a base-V index: at V = 128256 and L = 9 that index wraps past
    int64 (V**8 is a multiple of 2**64) and two samples whose first tokens always differ would pass."""
    g = torch.Generator().manual_seed(0)
    vocab, rest = 128256, torch.randint(0, 3, (2000, 8), generator=g)
    a = torch.cat([torch.zeros(2000, 1, dtype=torch.long), rest], 1)
    b = torch.cat([torch.full((2000, 1), 5), rest[torch.randperm(2000, generator=g)]], 1)
    assert two_sample_chi_square_test(a, b, vocab).rejected
    assert not two_sample_chi_square_test(a, a[torch.randperm(2000, generator=g)], vocab).rejected
    with pytest.raises(ValueError, match="do not fit int64"):
        sequence_cells(a, vocab)


def test_sequence_distribution_enumerates_prefixes():
    table = torch.softmax(torch.randn(5, 5, generator=torch.Generator().manual_seed(0)), -1)  # a bigram model
    joint = sequence_distribution(lambda ids: table[ids[:, -1]], torch.tensor([2]), 3)
    assert joint.shape == (5, 5, 5) and joint.sum().item() == pytest.approx(1.0)
    assert joint[1, 4, 0].item() == pytest.approx((table[2, 1] * table[1, 4] * table[4, 0]).item())
    with pytest.raises(ValueError, match="max_cells"):
        sequence_distribution(lambda ids: table[ids[:, -1]], torch.tensor([2]), 3, max_cells=100)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        chi_square_test(torch.tensor([0, 5]), torch.full((4,), 0.25))
    with pytest.raises(ValueError, match="shape"):
        chi_square_test(torch.tensor([[0, 1]]), torch.full((4,), 0.25))
    with pytest.raises(ValueError, match="exactly one"):
        assert_same_distribution(torch.tensor([0]))


# ----------------------------------------------------------------------------- a two-level tree
def test_tree_walk_with_recursive_rejection_keeps_the_two_token_distribution():
    """verify_sampled on hand-built two-level trees (2 children per node, drawn without replacement
    from pruned q's): the first two tokens follow p(x1) p(x2 | x1). A round that commits one token
    is completed by the target's own draw, as the next round would."""
    from nanospec_fx.eagle import SampledDraft, verify_sampled

    s, g, k = SpeculativeSampler(), torch.Generator().manual_seed(0), 2
    table = torch.Generator().manual_seed(1)
    p1 = torch.softmax(torch.randn(V, generator=table), 0)
    p2 = torch.softmax(torch.randn(V, V, generator=table) * 1.5, -1)  # p(x2 | x1)
    p3 = torch.full((V,), 1.0 / V)

    def pruned(logits):
        z = torch.full((V,), float("-inf"))
        z[ACTIVE] = logits[ACTIVE]
        return s.probs(z)

    q1 = pruned(torch.randn(V, generator=table))
    q2 = torch.stack([pruned(torch.randn(V, generator=table)) for _ in range(V)])
    samples = []
    for _ in range(2000):
        first, exists = s.draw(q1, k, g)
        second, _ = s.draw(q2[first], k, g)  # [k, k]: children of each first-level node
        tokens = torch.cat([first, second.flatten()])
        parents = torch.tensor([-1] * k + [i for i in range(k) for _ in range(k)])
        draft = SampledDraft(tokens, parents, torch.zeros(k + k * k), torch.cat([q1[None], q2[first]]),
                             torch.tensor([0] * k + [1 + i for i in range(k) for _ in range(k)]))
        assert exists.all()

        def target_probs(nodes):  # p after the path ending at nodes[-1]
            if not nodes:
                return p1
            return p2[int(tokens[nodes[0]])] if len(nodes) == 1 else p3

        _, committed = verify_sampled(draft, target_probs, s, g)
        if len(committed) == 1:
            committed.append(int(s.sample(p2[committed[0]], g)))
        samples.append(committed[:2])
    print(f"two-level tree: {assert_same_distribution(torch.tensor(samples), p1[:, None] * p2)}")


def test_dropping_drawn_candidates_by_score_is_caught():
    """Why the sampling tree has no EAGLE-2 reranking: draw 2 children, verify only the likelier one."""
    s, g = SpeculativeSampler(), torch.Generator().manual_seed(0)
    p, _, q = distributions()
    out = []
    for _ in range(2000):
        tokens, _ = s.draw(q, 2, g)
        out.append(s.verify(p, q, tokens[q[tokens].argmax()].view(1), g)[1])
    result = chi_square_test(torch.tensor(out), p)
    assert result.rejected, str(result)
    print(f"reranked: {result}")
