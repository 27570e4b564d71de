"""VocabConfig: the vocabulary options of one LM head, typed once, with their defaults named once.

The backend's options (``options={"capacity": 1024}``) and the keywords of ``attach`` and
``speculative_pair`` spell these options by the names of :class:`VocabConfig`'s fields.
``nanospec_fx.vocab.policies.resolve`` applies the policy and gives the :class:`StateConfig` that one
``ActiveVocab`` is built from and compared by (seed tokens, pinned slots, token -> row map).
Importing this module imports no torch: the CLI shows these defaults in its ``--help``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_CAPACITY = 3072
"""Slots of the active vocabulary (the NanoSpec paper's 3072)."""
DEFAULT_STATIC_SIZE = 32768
"""Tokens of the ``static`` policy (FR-Spec's 32k)."""
DEFAULT_PINNED_SIZE = 1024
"""Pinned frequent tokens of the ``hybrid`` policy."""
POLICIES = ("context", "static", "hybrid")
DEFAULT_POLICY = "context"


def require(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok``: how every option check reports."""
    if not ok:
        raise ValueError(message)


def is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True, eq=False)
class VocabConfig:
    """The vocabulary options as the user gives them; checked when built (a bad value raises ``ValueError``)."""

    capacity: int = DEFAULT_CAPACITY
    """Slots of the active vocabulary; clamped to the head's rows."""
    num_pinned: int = 0
    """Slots at the start of the set that are never evicted (filled by the first observed tokens)."""
    policy: str = DEFAULT_POLICY
    """``context`` (NanoSpec), ``static`` (FR-Spec top-N) or ``hybrid`` (pinned frequent core + context)."""
    frequencies: Any = None
    """Token frequencies for ``static``/``hybrid``: a FrequencyTable, a path to one, or counts [V]."""
    static_size: int = DEFAULT_STATIC_SIZE
    """Tokens of the ``static`` policy."""
    pinned_size: int = DEFAULT_PINNED_SIZE
    """Pinned frequent tokens of the ``hybrid`` policy."""
    draft_to_target: Any = None
    """For heads over a draft vocabulary (EAGLE-3): target token id of each head row, int [R]
    (EAGLE-3's offsets ``d2t`` give ``arange(R) + d2t``). Token ids observed are target ids."""
    target_vocab_size: int | None = None
    """Size of the target vocabulary with ``draft_to_target`` (default: its largest id + 1)."""

    def __post_init__(self) -> None:
        require(is_positive_int(self.capacity), f"capacity must be a positive int, got {self.capacity!r}")
        require(isinstance(self.num_pinned, int) and not isinstance(self.num_pinned, bool)
                and 0 <= self.num_pinned < self.capacity,
                f"num_pinned must be an int in [0, capacity), got {self.num_pinned!r}")
        require(self.policy in POLICIES, f"policy must be one of {POLICIES}, got {self.policy!r}")
        require(is_positive_int(self.static_size), f"static_size must be a positive int, got {self.static_size!r}")
        require(is_positive_int(self.pinned_size), f"pinned_size must be a positive int, got {self.pinned_size!r}")
        require(self.target_vocab_size is None or is_positive_int(self.target_vocab_size),
                f"target_vocab_size must be a positive int, got {self.target_vocab_size!r}")

    @classmethod
    def names(cls) -> frozenset[str]:
        """The option names that belong to the vocabulary configuration."""
        return frozenset(f.name for f in fields(cls))


@dataclass(frozen=True, eq=False)
class StateConfig:
    """What one ActiveVocab is built from once its policy is applied; two states of one head compare by it."""

    capacity: int = DEFAULT_CAPACITY
    num_pinned: int = 0
    seed_ids: torch.Tensor | None = None
    """Tokens inserted at creation and after every reset (a policy's static core)."""
    observes: bool = True
    """``False`` freezes the set after seeding (the ``static`` policy)."""
    policy: str = DEFAULT_POLICY
    token_to_row: torch.Tensor | None = None
    """int64 [V]: each token id's head row, -1 where the head has none (heads over a draft vocabulary)."""

    def keywords(self) -> dict[str, Any]:
        """The fields as keyword arguments of ``ActiveVocab`` (tensors kept, not copied)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def differences(self, other: StateConfig) -> list[str]:
        """What ``other`` changes, as ``name: mine -> theirs`` (tensors named by the options they come from)."""
        scalars = ("capacity", "num_pinned", "policy", "observes")
        out = [f"{n}: {getattr(self, n)!r} -> {getattr(other, n)!r}"
               for n in scalars if getattr(self, n) != getattr(other, n)]
        if not _same(self.seed_ids, other.seed_ids):
            out.append("the policy's seed tokens (frequencies/static_size/pinned_size)")
        if not _same(self.token_to_row, other.token_to_row):
            out.append("draft_to_target/target_vocab_size")
        return out


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    import torch

    if a is None or b is None:
        return a is None and b is None
    a = torch.as_tensor(a, dtype=torch.int64).flatten().to(b.device)
    return a.shape == b.shape and torch.equal(a, b)


__all__ = ["DEFAULT_CAPACITY", "DEFAULT_PINNED_SIZE", "DEFAULT_POLICY", "DEFAULT_STATIC_SIZE", "POLICIES",
           "StateConfig", "VocabConfig"]
