"""The alpha-beta model of a vocabulary-parallel draft step (nanospec_fx.diagnostics.cost_model.CollectiveCost), checked
against numbers computed by hand."""
from __future__ import annotations

import pytest

from nanospec_fx.diagnostics.cost_model import CollectiveCost

# V=1000, H=10, C=100, 2-byte elements; tp=4, rows=3, fed=5; HBM 1e9 B/s, link 1e6 B/s, alpha 1 ms.
AT = dict(tp=4, rows=3, fed=5, hbm=1e9, link=1e6, alpha=1e-3)


@pytest.mark.parametrize("term, seconds", [
    ("shard_read", 250 * 10 * 2 / 1e9),  # V/tp rows of H elements
    ("all_gather", 3 * 1e-3 + 3 / 4 * 3 * 1000 * 2 / 1e6),  # tp-1 ring steps; (tp-1)/tp of [rows, V]
    ("cache_read", 100 * 10 * 2 / 1e9),  # C rows
    ("all_reduce", 6 * 1e-3 + 2 * 3 / 4 * 5 * 10 * 2 / 1e6),  # 2 (tp-1) steps; 2 (tp-1)/tp of [fed, H]
    ("dense", 5e-6 + 7.5e-3),
    ("nanospec", 2e-6 + 6.15e-3),
    ("nanospec_outside", 2e-6),
])
def test_terms_equal_hand_computed_seconds(term, seconds):
    cost = CollectiveCost(1000, 10, 100, bytes_per_element=2)
    assert cost.at(getattr(cost, term), **AT) == pytest.approx(seconds, rel=1e-12)


def test_llama3_8b_head_at_tp2_on_h100():
    """The published-figures row of docs/tensor-parallel.md: 156.8 + 7.9 us dense, 7.5 + 10.2 us nanospec."""
    cost = CollectiveCost(128256, 4096, 3072)
    at = dict(tp=2, rows=10, fed=10, hbm=3.35e12, link=450e9, alpha=5e-6)
    assert cost.at(cost.shard_read, **at) * 1e6 == pytest.approx(64128 * 4096 * 2 / 3.35e12 * 1e6)
    assert round(cost.at(cost.dense, **at) * 1e6, 1) == 164.7
    assert round(cost.at(cost.nanospec, **at) * 1e6, 1) == 17.7
    assert cost.table(10, 10)[2].startswith("| H100 SXM (3.35 TB/s) | 2 | 156.8 + 7.9 = 164.7 us | 7.5 + 10.2")
