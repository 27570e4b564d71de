"""Hypothesis strategies for property tests of a drafter: active sets and token ids as int64 tensors.

hypothesis is imported when a strategy is built, never at ``import nanospec_fx.testing``: a user's CI that only
calls :func:`nanospec_fx.testing.assert_equivalent` needs no hypothesis."""
from __future__ import annotations

import torch


def active_sets(vocab_size: int, max_size: int, min_size: int = 0):
    """Strategy: a 1-D int64 tensor of distinct token ids in ``[0, vocab_size)``."""
    from hypothesis import strategies as st

    ids = st.lists(st.integers(0, vocab_size - 1), min_size=min_size, max_size=min(max_size, vocab_size), unique=True)
    return ids.map(lambda xs: torch.tensor(xs, dtype=torch.int64))


def token_ids(vocab_size: int, shape):
    """Strategy: an int64 tensor of token ids in ``[0, vocab_size)``; ``shape`` is a tuple or a strategy of tuples."""
    from hypothesis import strategies as st

    def of_shape(dims: tuple[int, ...]):
        n = 1
        for d in dims:
            n *= d
        values = st.lists(st.integers(0, vocab_size - 1), min_size=n, max_size=n)
        return values.map(lambda xs: torch.tensor(xs, dtype=torch.int64).reshape(dims))

    if isinstance(shape, st.SearchStrategy):
        return shape.flatmap(lambda dims: of_shape(tuple(dims)))
    return of_shape(tuple(shape))
