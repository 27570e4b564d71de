"""What the pass did for each head (its ``RewriteReport``s): compiler output, kept beside the runtime state, not on it.

The backend records a report when a graph with a rewritten head compiles; ``explain``, ``diagnose`` and the head
naming read them. Keyed weakly by the head's state (an ``ActiveVocab``): a dropped state takes its reports with it.
"""
from __future__ import annotations

from torch.utils.weak import WeakIdKeyDictionary

_REPORTS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a head's state -> its RewriteReports, in compile order


def record(state, report) -> None:
    """A graph that rewrites ``state``'s head compiled; ``report`` (``passes.RewriteReport``) says how."""
    _REPORTS.setdefault(state, []).append(report)


def reports(state) -> list:
    """The reports of every compiled graph that rewrote ``state``'s head (empty: none did)."""
    return list(_REPORTS.get(state, ()))


def carry(old, new) -> None:
    """``new`` replaces ``old`` for the same head (a new weight tensor): it keeps ``old``'s reports if it has none."""
    if old in _REPORTS and not _REPORTS.get(new):
        _REPORTS[new] = list(_REPORTS[old])
