"""Which tokens the drafter's head may propose: the active-vocabulary policies.

* ``context`` (NanoSpec, the default): the tokens the context makes likely - every token fed
  to the drafter and, with a target observer, the target's top-k at every scored position.
* ``static`` (FR-Spec): a fixed set of the ``static_size`` most frequent tokens of a corpus;
  nothing is observed.
* ``hybrid``: a pinned core of the ``pinned_size`` most frequent tokens (never evicted) plus
  the context set in the remaining slots.

Frequencies come from a :class:`FrequencyTable`, counted once on a corpus with a tokenizer
and saved as a plain text file (``token_id count`` per line). :func:`resolve` turns the vocabulary
options (a ``VocabConfig``) into what an ActiveVocab is built from (a ``StateConfig``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable

import torch

from nanospec_fx.vocab.config import StateConfig, VocabConfig, require

_HEADER = "# nanospec-fx frequency table"


@dataclass
class FrequencyTable:
    """Token counts over a vocabulary; ``top(n)`` gives FR-Spec's static set."""

    counts: torch.Tensor  # int64 [V]

    def __post_init__(self):
        counts = torch.as_tensor(self.counts).flatten().cpu()
        if counts.dtype == torch.bool or counts.is_complex():
            raise TypeError(f"frequency counts must be numbers of occurrences, one per token id, not {counts.dtype}")
        if counts.is_floating_point() and not (torch.isfinite(counts).all() and (counts == counts.round()).all()):
            # probabilities cast to int64 would all be 0: the set would be the first ids, not the frequent ones
            raise ValueError("frequency counts must be whole numbers of occurrences; got fractional values (scale "
                             "probabilities first, e.g. (p * 1e6).round())")
        self.counts = counts.to(torch.int64)
        if (self.counts < 0).any():
            raise ValueError("frequency counts must be non-negative")

    @property
    def vocab_size(self) -> int:
        return self.counts.numel()

    @classmethod
    def from_token_ids(cls, sequences: Iterable, vocab_size: int) -> "FrequencyTable":
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for seq in sequences:
            ids = torch.as_tensor(seq, dtype=torch.int64).flatten()
            if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"token ids must be in [0, {vocab_size})")
            counts += torch.bincount(ids, minlength=vocab_size)
        return cls(counts)

    @classmethod
    def from_texts(cls, texts: Iterable[str], tokenizer, vocab_size: int | None = None) -> "FrequencyTable":
        """Count tokens of ``texts`` with a tokenizer (anything with ``encode(str) -> list[int]``)."""
        size = vocab_size or len(tokenizer)
        return cls.from_token_ids((tokenizer.encode(t) for t in texts), size)

    def top(self, n: int, among: torch.Tensor | None = None) -> torch.Tensor:
        """The ``n`` most frequent token ids, most frequent first (ties: smaller id first); with ``among`` (a bool
        mask over the table's ids), the most frequent of those ids only (fewer when fewer are there)."""
        order = torch.argsort(-self.counts, stable=True)
        if among is not None:
            order = order[among[order]]
        return order[:n].clone()

    def save(self, path: str | Path) -> None:
        nonzero = torch.nonzero(self.counts).flatten().tolist()
        lines = [f"{_HEADER} vocab_size={self.vocab_size}"] + [f"{i} {int(self.counts[i])}" for i in nonzero]
        Path(path).write_text("\n".join(lines) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "FrequencyTable":
        lines = Path(path).read_text().splitlines()
        if not lines or not lines[0].startswith(_HEADER) or "vocab_size=" not in lines[0]:
            raise ValueError(f"{path} is not a nanospec-fx frequency table "
                             f"(first line must be '{_HEADER} vocab_size=V')")
        counts = torch.zeros(int(lines[0].split("vocab_size=")[1]), dtype=torch.int64)
        seen = set()
        for n, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            try:
                token, count = (int(v) for v in line.split())
            except ValueError:
                raise ValueError(f"{path}:{n}: expected 'token_id count', got {line!r}") from None
            if not 0 <= token < counts.numel() or count < 0 or token in seen:
                why = ("a token id outside [0, vocab_size)" if not 0 <= token < counts.numel()
                       else "a negative count" if count < 0 else "a token id listed twice")
                raise ValueError(f"{path}:{n}: {why} (vocab_size={counts.numel()}): {line!r}")
            seen.add(token)
            counts[token] = count
        return cls(counts)


def as_frequency_table(frequencies, policy: str) -> FrequencyTable:
    """The ``frequencies`` option as a FrequencyTable; a clear error when the policy needs one and has none."""
    if frequencies is None:
        raise ValueError(
            f"the {policy!r} policy needs token frequencies: "
            "options={'frequencies': FrequencyTable | path | counts}; "
            "count them with nanospec_fx.FrequencyTable.from_texts(texts, tokenizer)"
        )
    if isinstance(frequencies, FrequencyTable):
        return frequencies
    if isinstance(frequencies, (str, Path)):
        return FrequencyTable.load(frequencies)
    return FrequencyTable(torch.as_tensor(frequencies))


def resolve(config: VocabConfig) -> StateConfig:
    """What ``config`` asks of an ActiveVocab once its policy is applied (reads the frequencies; clear errors)."""
    rows = token_to_row(config.draft_to_target, config.target_vocab_size)
    if config.policy == "context":
        state = StateConfig(config.capacity, config.num_pinned, policy=config.policy)
    else:
        table = as_frequency_table(config.frequencies, config.policy)
        # a head over a draft vocabulary can hold only the tokens it has a row for: the seeds are the most frequent
        # of those (a seed without a row would leave its slot to the context, and a static set larger than the head)
        has_row = None if rows is None else _has_row(rows, table.vocab_size)
        if config.policy == "static":
            seeds = table.top(config.static_size, has_row)
            require(seeds.numel() > 0, "static policy with draft_to_target: no token of the frequency table has a "
                                       "head row (is the table counted over the target's vocabulary?)")
            state = StateConfig(config.static_size, 0, seed_ids=seeds, observes=False, policy=config.policy)
        else:
            require(0 < config.pinned_size < config.capacity,
                    f"hybrid policy: pinned_size must be in (0, capacity={config.capacity}), got {config.pinned_size}")
            seeds = table.top(config.pinned_size, has_row)
            state = StateConfig(config.capacity, seeds.numel(), seed_ids=seeds, policy=config.policy)
    return replace(state, token_to_row=rows)


def _has_row(rows: torch.Tensor, table_size: int) -> torch.Tensor:
    """Which ids of a frequency table of ``table_size`` ids have a row in a draft-vocabulary head (``rows``, the
    token -> row map)."""
    known = torch.zeros(table_size, dtype=torch.bool)
    n = min(table_size, rows.numel())
    known[:n] = rows[:n] >= 0
    return known


def token_to_row(draft_to_target, target_vocab_size: int | None = None) -> torch.Tensor | None:
    """The token -> head-row map of a head over a draft vocabulary (None without ``draft_to_target``)."""
    if draft_to_target is None:
        return None
    d2t = torch.as_tensor(draft_to_target, dtype=torch.int64).flatten().cpu()
    if d2t.numel() == 0 or int(d2t.min()) < 0:
        raise ValueError("draft_to_target must hold non-negative target token ids, one per head row")
    size = target_vocab_size or int(d2t.max()) + 1
    if int(d2t.max()) >= size:
        raise ValueError(f"draft_to_target has ids >= target_vocab_size={size}")
    unique, counts = torch.unique(d2t, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"draft_to_target maps several head rows to one target token id "
                         f"({unique[counts > 1][:8].tolist()}): one row per token, or a row could never be active")
    t2r = torch.full((size,), -1, dtype=torch.int64)
    t2r[d2t] = torch.arange(d2t.numel())
    return t2r
