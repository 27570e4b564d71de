"""The plain-Python ring model (the oracle of the kernel tests and the coverage's set) on cases worked by hand."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from nanospec_fx.vocab import ring_model
from nanospec_fx.vocab.ring_model import RingModel


def test_slots_cursor_and_eviction_with_pinned_slots():
    m = RingModel(4, num_pinned=1, vocab_size=30)
    m.observe([5, 6, 5, 7, 99, -1])  # duplicates and out-of-range ids skipped
    assert m.ids == [5, 6, 7, -1] and m.cursor == 3 and m.slot_of == {5: 0, 6: 1, 7: 2}
    m.observe([8, 9])  # 8 fills slot 3; 9 wraps past the pinned slot 0 and evicts 6
    assert m.ids == [5, 9, 7, 8] and m.cursor == 5 and set(m) == {5, 7, 8, 9}
    assert m.oldest() == [7, 8, 9] and m.slot(5) == 2


def test_a_call_keeps_what_it_feeds_unless_renew_is_off():
    kept, plain = RingModel(3), RingModel(3, renew=False)
    for m in (kept, plain):
        m.observe([1, 2, 3])
        m.observe([1, 4])  # 1 is the oldest: renewed (inserted again as newest), 4 evicts 2
    assert set(kept) == {1, 3, 4} and kept.oldest() == [3, 1, 4]
    assert set(plain) == {2, 3, 4}
    kept.observe([3, 1, 4, 5])  # 1 new + 3 fed > ring of 3: no renewal, 5 evicts 3
    assert set(kept) == {1, 4, 5}


def test_unbounded_never_evicts():
    m = RingModel(None, num_pinned=2)
    m.observe(range(1000))
    assert len(m) == 1000 and m.oldest()[:2] == [2, 3] and m.ids[:2] == [0, 1]


def test_bad_pinned_counts_are_refused():
    with pytest.raises(ValueError, match="num_pinned"):
        RingModel(4, num_pinned=4)
    with pytest.raises(ValueError, match="num_pinned"):
        RingModel(None, num_pinned=-1)


def test_the_model_imports_nothing_but_the_standard_typing():
    """Torch-free (it runs anywhere, and shares no code with the kernels it judges)."""
    tree = ast.parse(Path(ring_model.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported == {"__future__", "typing"}
