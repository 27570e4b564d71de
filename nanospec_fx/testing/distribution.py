"""Distribution tests for speculative *sampling*.

Lossless speculative sampling cannot be checked sample by sample: it is a claim about a distribution. These helpers
compare the tokens a sampler generates with the target's exact distribution (:func:`sequence_distribution`) or with
samples of the target alone (:func:`two_sample_chi_square_test`), by a chi-square test at a fixed significance
(docs/sampling.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class ChiSquareResult:
    """A chi-square test of generated token sequences.

    ``p_value`` is the probability, for a sampler that *is* distributed as the reference, of a
    statistic at least this large; the test rejects when it is below ``alpha``, so ``alpha`` is its
    false-alarm rate (with a fixed seed the outcome is deterministic). ``impossible`` counts samples
    in cells of reference probability 0 (a token the target can never produce there): any makes
    the test reject, whatever the statistic.
    """

    statistic: float
    dof: int
    p_value: float
    num_samples: int
    num_cells: int
    alpha: float
    impossible: int = 0

    @property
    def rejected(self) -> bool:
        return self.impossible > 0 or self.p_value < self.alpha

    def __str__(self) -> str:
        verdict = "differs from" if self.rejected else "is consistent with"
        extra = f", {self.impossible} samples of probability 0" if self.impossible else ""
        return (f"the sample {verdict} the reference: chi2 = {self.statistic:.2f}, dof = {self.dof}, "
                f"p = {self.p_value:.3g} (alpha = {self.alpha:g}), {self.num_samples} samples in "
                f"{self.num_cells} cells{extra}")


def chi2_sf(statistic: float, dof: int) -> float:
    """Survival function of the chi-square distribution: ``Q(dof / 2, statistic / 2)`` (no scipy needed)."""
    if dof <= 0:
        return 1.0
    x = torch.tensor(statistic / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), x))


def sequence_cells(samples: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Cell index of each sampled sequence: ``samples [N, L]`` (or ``[N]``) -> ``[N]`` in ``[0, V**L)``.
    Refuses a ``V**L`` past int64 (the index would wrap: sequences that differ would share a cell); the two-sample
    test numbers only the sequences it sees (:func:`sample_cells`)."""
    samples = torch.as_tensor(samples).long().cpu()
    if samples.dim() == 1:
        samples = samples[:, None]
    if samples.dim() != 2:
        raise ValueError(f"samples must be [N] or [N, L] token ids, got shape {tuple(samples.shape)}")
    if samples.numel() and (samples.min() < 0 or samples.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {int(samples.min())}..{int(samples.max())}")
    if vocab_size ** samples.shape[1] > 2 ** 63:
        raise ValueError(f"{vocab_size}**{samples.shape[1]} sequences do not fit int64 cell indices; compare two "
                         "samples with two_sample_chi_square_test, which numbers only the sequences it sees")
    weights = vocab_size ** torch.arange(samples.shape[1] - 1, -1, -1, dtype=torch.int64)
    return (samples * weights).sum(-1)


def sample_cells(*samples: torch.Tensor, vocab_size: int) -> list[torch.Tensor]:
    """One cell per distinct sequence seen in any of ``samples`` (each ``[N, L]`` or ``[N]``, ids checked in
    ``[0, V)``), numbered ``0 .. D-1``: the cells of each sample. Exact at any V and L, where a base-V index would
    wrap past int64."""
    rows = [torch.as_tensor(s).long().cpu() for s in samples]
    rows = [r[:, None] if r.dim() == 1 else r for r in rows]
    for r in rows:
        if r.dim() != 2:
            raise ValueError(f"samples must be [N] or [N, L] token ids, got shape {tuple(r.shape)}")
        if r.numel() and (r.min() < 0 or r.max() >= vocab_size):
            raise ValueError(f"token ids must be in [0, {vocab_size}), got {int(r.min())}..{int(r.max())}")
    if len({r.shape[1] for r in rows}) > 1:
        raise ValueError(f"the samples' sequences differ in length: {[r.shape[1] for r in rows]}")
    _, cells = torch.unique(torch.cat(rows), dim=0, return_inverse=True)
    return list(cells.split([r.shape[0] for r in rows]))


def _pool(observed: list[torch.Tensor], expected: list[torch.Tensor], min_expected: float):
    """Group cells so that each group is expected at least ``min_expected`` times.

    Cells are taken in increasing order of expected count and grouped greedily until a group is
    large enough (a leftover group joins the last one). The grouping depends on the expected counts
    only, never on the observed ones, so the test stays valid; cells of expected 0 join a group.
    """
    weight = torch.stack(expected).min(0).values
    order = weight.argsort()
    group = torch.empty_like(order)
    current, acc = 0, 0.0
    for cell, w in zip(order.tolist(), weight[order].tolist()):
        group[cell] = current
        acc += w
        if acc >= min_expected:
            current, acc = current + 1, 0.0
    leftover = bool((group == current).any())  # the last cells, expected fewer than min_expected times
    if leftover and current > 0:
        group[group == current] = current - 1
    groups = max(current, 1)
    pooled_o = [torch.zeros(groups, dtype=torch.float64).index_add_(0, group, o.double()) for o in observed]
    pooled_e = [torch.zeros(groups, dtype=torch.float64).index_add_(0, group, e.double()) for e in expected]
    return pooled_o, pooled_e


def chi_square_test(samples: torch.Tensor, probs: torch.Tensor, *, alpha: float = 1e-3,
                    min_expected: float = 5.0) -> ChiSquareResult:
    """Goodness of fit of sampled sequences to their exact distribution.

    Args:
        samples: ``[N, L]`` (or ``[N]``) generated token ids, one sequence per row.
        probs: the exact joint distribution, shape ``[V] * L`` (e.g. from :func:`sequence_distribution`).
        alpha: the significance, i.e. the false-alarm rate of a correct sampler.
        min_expected: cells expected fewer times are pooled (the chi-square approximation needs ~5).
    """
    probs = torch.as_tensor(probs, dtype=torch.float64).cpu()
    vocab_size = probs.shape[-1]
    cells = sequence_cells(samples, vocab_size)
    length = 1 if torch.as_tensor(samples).dim() == 1 else torch.as_tensor(samples).shape[1]
    if probs.dim() != length or any(s != vocab_size for s in probs.shape):
        raise ValueError(f"probs must have shape [V] * L = {[vocab_size] * length}, got {list(probs.shape)}")
    flat = probs.flatten() / probs.sum()
    n = cells.numel()
    observed = torch.bincount(cells, minlength=flat.numel()).double()
    impossible = int(observed[flat == 0].sum())
    (o,), (e,) = _pool([observed], [flat * n], min_expected)
    statistic = float(((o - e) ** 2 / e).sum())
    dof = o.numel() - 1
    return ChiSquareResult(statistic, dof, chi2_sf(statistic, dof), n, o.numel(), alpha, impossible)


def two_sample_chi_square_test(samples: torch.Tensor, reference_samples: torch.Tensor, vocab_size: int, *,
                               alpha: float = 1e-3, min_expected: float = 5.0) -> ChiSquareResult:
    """Chi-square test of homogeneity: were two sets of sampled sequences drawn from one distribution?

    For targets too large for :func:`sequence_distribution`: compare speculative samples with
    samples of the target alone (``reference_samples``), ``[N, L]`` and ``[M, L]`` token ids.
    """
    a, b = sample_cells(samples, reference_samples, vocab_size=vocab_size)
    cells = int(torch.cat([a, b]).max()) + 1 if a.numel() + b.numel() else 0
    count_a = torch.bincount(a, minlength=cells).double()
    count_b = torch.bincount(b, minlength=cells).double()
    n_a, n_b = a.numel(), b.numel()
    total = count_a + count_b
    expected_a, expected_b = total * n_a / (n_a + n_b), total * n_b / (n_a + n_b)
    (oa, ob), (ea, eb) = _pool([count_a, count_b], [expected_a, expected_b], min_expected)
    statistic = float(((oa - ea) ** 2 / ea).sum() + ((ob - eb) ** 2 / eb).sum())
    dof = oa.numel() - 1
    return ChiSquareResult(statistic, dof, chi2_sf(statistic, dof), n_a + n_b, oa.numel(), alpha)


@torch.inference_mode()
def sequence_distribution(next_token_probs: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor,
                          length: int, *, max_cells: int = 1 << 20) -> torch.Tensor:
    """The exact joint distribution ``[V] * length`` of the next ``length`` tokens after ``prompt``.

    ``next_token_probs(ids [B, T]) -> [B, V]`` is the target's sampling distribution at the last
    position (after temperature/top-k/top-p). Every prefix is enumerated (``V ** (length - 1)``
    rows at the last step), so it is for tiny vocabularies: ``V ** length <= max_cells``.
    """
    prompt = torch.as_tensor(prompt).long().view(1, -1)
    joint, prefixes = torch.ones(1, dtype=torch.float64), prompt
    vocab_size = None
    for step in range(length):
        probs = next_token_probs(prefixes).double().cpu()
        vocab_size = probs.shape[-1]
        if vocab_size ** length > max_cells:
            raise ValueError(f"V ** length = {vocab_size}**{length} cells exceed max_cells={max_cells}; "
                             "use two_sample_chi_square_test with samples of the target alone")
        joint = (joint[:, None] * probs).flatten()
        if step + 1 < length:
            tokens = torch.arange(vocab_size, device=prefixes.device)
            prefixes = torch.cat([prefixes.repeat_interleave(vocab_size, 0),
                                  tokens.repeat(prefixes.shape[0])[:, None]], 1)
    return joint.view([vocab_size] * length)


def assert_same_distribution(samples: torch.Tensor, probs: torch.Tensor | None = None, *,
                             reference_samples: torch.Tensor | None = None, vocab_size: int | None = None,
                             alpha: float = 1e-3, min_expected: float = 5.0) -> ChiSquareResult:
    """Assert that sampled sequences follow the target's distribution; return the test's result.

    Give either ``probs`` (the exact distribution, :func:`chi_square_test`) or ``reference_samples``
    and ``vocab_size`` (samples of the target alone, :func:`two_sample_chi_square_test`). Raises
    ``AssertionError`` with the statistic and p-value when the test rejects at ``alpha``.
    """
    if (probs is None) == (reference_samples is None):
        raise ValueError("give exactly one of probs= (exact distribution) or reference_samples= (target samples)")
    if probs is not None:
        result = chi_square_test(samples, probs, alpha=alpha, min_expected=min_expected)
    else:
        if vocab_size is None:
            raise ValueError("reference_samples= needs vocab_size=")
        result = two_sample_chi_square_test(samples, reference_samples, vocab_size, alpha=alpha,
                                            min_expected=min_expected)
    if result.rejected:
        raise AssertionError(str(result))
    return result
