"""The CPU host path's head and selection against plain Python/torch over the whole vocabulary.

The oracle shares nothing with the code it judges: the active tokens' values are read into Python and sorted by
the contract's rule (descending with NaN first if ``largest``, else ascending with NaN last; equal values - 0.0 and
-0.0 included - by smaller token id; then the smallest inactive ids as padding, at -inf or +inf), and the head's
logits are a plain ``F.linear`` over the dense head, read at each active token. Shapes are odd (hidden 1-37,
leading dims, capacities past the count) and the values are drawn to tie (few levels, NaN, infinities, signed
zeros) and not to tie (random floats: the partial-selection path).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from nanospec_fx.kernels import host as H
from nanospec_fx.kernels.launch_count import counting

# Selection moves values, it never computes them: exact. The head: one GEMM over the bucket of active rows against
# F.linear over the whole head, so summation order and one rounding of the output dtype apart.
EXACT = dict(rtol=0, atol=0, equal_nan=True)
HEAD_TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5),
            torch.float16: dict(rtol=2e-3, atol=2e-3), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
DTYPES = list(HEAD_TOL)
SETTINGS = dict(deadline=None, max_examples=60, derandomize=True)


def active_state(vocab: int, capacity: int, n: int, seed: int):
    """``ids, cursor`` of a set holding ``n`` distinct random tokens in random slots order (no kernel involved)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((capacity,), -1, dtype=torch.int64)
    ids[:n] = torch.randperm(vocab, generator=g)[:n]
    return ids, torch.tensor([n])


def oracle_topk(compact: torch.Tensor, ids: torch.Tensor, n: int, vocab: int, k: int, largest: bool):
    """Per row of ``compact [..., C]``: the contract's top-k as Python lists (values, token ids)."""
    active = ids[:n].tolist()
    rows = compact.reshape(-1, compact.shape[-1])[:, :n].tolist()
    pad_value = -math.inf if largest else math.inf
    padding = [t for t in range(vocab) if t not in set(active)]
    values, tokens = [], []
    for row in rows:
        def rule(pair):
            v, t = pair
            nan = math.isnan(v)
            if largest:
                return (0 if nan else 1, 0.0 if nan else -v, t)
            return (1 if nan else 0, 0.0 if nan else v, t)
        picked = sorted(zip(row, active), key=rule)[:k]
        picked += [(pad_value, t) for t in padding[: k - len(picked)]]
        values.append([v for v, _ in picked])
        tokens.append([t for _, t in picked])
    shape = (*compact.shape[:-1], k)
    return (torch.tensor(values, dtype=torch.float64).reshape(shape), torch.tensor(tokens, dtype=torch.int64).reshape(shape))


def draw_values(shape, dtype, ties: bool, specials: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if ties:
        out = torch.randint(-2, 3, shape, generator=g).double()
    else:
        out = torch.randn(shape, generator=g, dtype=torch.float64)
    if specials:
        pick = torch.randint(0, 8, shape, generator=g)
        for code, value in ((0, math.nan), (1, -math.inf), (2, math.inf), (3, -0.0), (4, 0.0)):
            out = torch.where(pick == code, torch.tensor(value, dtype=torch.float64), out)
    return out.to(dtype)


@settings(**SETTINGS)
@given(
    dtype=st.sampled_from(DTYPES),
    lead=st.sampled_from([(1,), (3,), (2, 3), (1, 1, 2)]),
    capacity=st.integers(1, 300),
    fill=st.floats(0, 1),
    k=st.integers(0, 12),
    largest=st.booleans(),
    ties=st.booleans(),
    specials=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_topk_and_argmax_equal_the_rule_over_the_vocabulary(dtype, lead, capacity, fill, k, largest, ties, specials,
                                                             seed):
    vocab = capacity + 12  # k <= V (the contract)
    n = round(fill * capacity)
    ids, cursor = active_state(vocab, capacity, n, seed)
    compact = draw_values((*lead, capacity), dtype, ties, specials, seed)
    compact[..., n:] = 5.0  # slots past the count hold anything (post-ops): ignored
    vals, toks = H.compact_topk(compact, ids, cursor, k, largest)
    want_vals, want_toks = oracle_topk(compact, ids, n, vocab, k, largest)
    assert vals.dtype == dtype and toks.dtype == torch.int64 and vals.shape == toks.shape == (*lead, k)
    assert torch.equal(toks, want_toks)
    torch.testing.assert_close(vals.double(), want_vals, **EXACT)
    # argmax: the rule's first pick (0, the smallest inactive id, when nothing is active)
    assert torch.equal(H.compact_argmax(compact, ids, cursor), oracle_topk(compact, ids, n, vocab, 1, True)[1][..., 0])


@settings(**SETTINGS)
@given(
    dtype=st.sampled_from(DTYPES),
    lead=st.sampled_from([(1,), (4,), (2, 3)]),
    hidden=st.integers(1, 37),
    capacity=st.integers(1, 200),
    fill=st.floats(0, 1),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_compact_head_equals_the_dense_head_at_active_tokens(dtype, lead, hidden, capacity, fill, bias, seed):
    vocab = capacity + 5
    n = round(fill * capacity)
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(vocab, generator=g, dtype=torch.float64).to(dtype) if bias else None
    ids, cursor = active_state(vocab, capacity, n, seed)
    cache_w = torch.randn(capacity, hidden, generator=g, dtype=torch.float64).to(dtype)  # garbage past the count
    cache_b = torch.randn(capacity, generator=g, dtype=torch.float64).to(dtype) if bias else None
    cache_w[:n] = weight[ids[:n]]
    if bias:
        cache_b[:n] = b[ids[:n]]
    x = torch.randn(*lead, hidden, generator=g, dtype=torch.float64).to(dtype)
    out = H.compact_logits(x, cache_w, cache_b, cursor)
    dense = F.linear(x, weight, b)
    assert out.shape == (*lead, capacity) and out.dtype == dtype
    torch.testing.assert_close(out[..., :n], dense[..., ids[:n]], **HEAD_TOL[dtype])
    assert bool(torch.isneginf(out[..., n:]).all())


def test_an_untied_topk_selects_without_sorting():
    """A draft loop's top-k (k < count, no tie): one partial selection, no sort and no key building; with ties, the
    keyed selection (still no sort). Counted, not timed."""
    ids, cursor = active_state(5000, 3072, 3000, seed=1)
    compact = torch.randn(10, 3072, generator=torch.Generator().manual_seed(1))
    with counting() as untied:
        H.compact_topk(compact, ids, cursor, 10)
    ops = untied.torch_ops
    assert not any("sort" in op for op in ops) and sum("topk" in op for op in ops) == 1, ops
    # the count read, the selection, its check (compare, all, read), the values made contiguous, the ids mapped
    assert len(ops) <= 7, ops
    compact[:, :3000] = torch.randint(0, 3, (10, 3000)).float()  # every row ties
    with counting() as tied:
        H.compact_topk(compact, ids, cursor, 10)
    assert not any("sort" in op for op in tied.torch_ops), tied.torch_ops
