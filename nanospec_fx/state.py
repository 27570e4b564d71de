"""ActiveVocab: the device-resident active vocabulary of one LM head.

One ``ActiveVocab`` exists per head weight and lives as long as that weight. The compiled
graph receives its tensors as extra inputs and the nanospec ops update them in place, so
their addresses never change (CUDA graphs keep working) and no step needs the host.
"""
from __future__ import annotations

import threading
import warnings
from typing import Iterable

import torch
import torch.nn as nn

from nanospec_fx.kernels import ops

DEFAULT_CAPACITY = 3072


class ActiveVocab:
    """The set of token ids the drafter's head computes logits for.

    The set only grows until :meth:`reset`; when it is full, the oldest insertions are evicted
    first (a ring over the slots), except the first ``num_pinned`` slots, which are never evicted.
    All rows of a batch share one set.

    Attributes:
        capacity: maximum number of active tokens (slots).
        vocab_size: size V of the full vocabulary.
        num_pinned: slots that are never evicted (filled by the first insertions).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        capacity: int = DEFAULT_CAPACITY,
        num_pinned: int = 0,
    ):
        if weight.dim() != 2:
            raise ValueError(f"head weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
        vocab_size, hidden = weight.shape
        if bias is not None and bias.shape != (vocab_size,):
            raise ValueError(f"head bias must have shape ({vocab_size},), got {tuple(bias.shape)}")
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        capacity = min(capacity, vocab_size)
        if not 0 <= num_pinned < capacity:
            raise ValueError(f"num_pinned must be in [0, capacity={capacity}), got {num_pinned}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden
        self.capacity = capacity
        self.num_pinned = num_pinned
        self.rewrites: list = []  # what the pass did for this head (passes.RewriteReport), for explain()
        self.weight, self.bias = weight, bias
        dev = weight.device
        with torch.no_grad():
            self.ids = torch.full((capacity,), -1, dtype=torch.int64, device=dev)
            self.slot_of = torch.full((vocab_size,), -1, dtype=torch.int32, device=dev)
            self.cursor = torch.zeros(1, dtype=torch.int64, device=dev)
            self.cache_w = torch.zeros(capacity, hidden, dtype=weight.dtype, device=dev)
            bias_dtype = bias.dtype if bias is not None else weight.dtype
            self.cache_b = torch.zeros(capacity, dtype=bias_dtype, device=dev)

    # ----------------------------------------------------------------- tensors
    def tensors(self) -> list[torch.Tensor]:
        """The state tensors the compiled graph receives, in the order the ops take them."""
        return [self.ids, self.slot_of, self.cursor, self.cache_w, self.cache_b]

    @property
    def count(self) -> torch.Tensor:
        """Number of active tokens as a device tensor of shape [1] (no host sync)."""
        return torch.clamp(self.cursor, max=self.capacity)

    # ----------------------------------------------------------------- user API
    def observe(self, token_ids: torch.Tensor | Iterable[int], validate: bool = True) -> None:
        """Add token ids (any shape, duplicates allowed) to the active vocabulary.

        With ``validate`` (default) ids outside ``[0, vocab_size)`` raise ``ValueError`` before the
        state is touched; this reads the ids on the host. ``validate=False`` makes the call
        sync-free and silently skips out-of-range ids.
        """
        if not isinstance(token_ids, torch.Tensor):
            token_ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
        if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
            raise TypeError(f"token ids must be an integer tensor, got {token_ids.dtype}")
        token_ids = token_ids.to(self.ids.device)
        if validate and token_ids.numel():
            lo, hi = int(token_ids.min()), int(token_ids.max())
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        with torch.no_grad():
            ops.observe(token_ids, self.weight, self.bias, *self.tensors(), self.num_pinned)

    def reset(self) -> None:
        """Empty the set (in place: compiled graphs keep using the same tensors)."""
        with torch.no_grad():
            self.ids.fill_(-1)
            self.slot_of.fill_(-1)
            self.cursor.zero_()

    def refresh(self) -> None:
        """Re-copy the head rows of the active tokens, after the head weights changed in place."""
        with torch.no_grad():
            n = len(self)
            idx = self.ids[:n]
            self.cache_w[:n] = self.weight[idx].to(self.cache_w.dtype)
            if self.bias is not None:
                self.cache_b[:n] = self.bias[idx].to(self.cache_b.dtype)

    def token_ids(self) -> torch.Tensor:
        """The active token ids as a 1-D int64 tensor, in slot order (reads the count on the host)."""
        return self.ids[: len(self)].clone()

    def contains(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Bool tensor: which of ``token_ids`` are active (out-of-range ids are not)."""
        t = torch.as_tensor(token_ids, device=self.slot_of.device)
        ok = (t >= 0) & (t < self.vocab_size)
        return ok & (self.slot_of[torch.where(ok, t, torch.zeros_like(t))] >= 0)

    def __len__(self) -> int:
        return int(self.count)

    def __repr__(self) -> str:
        return (
            f"ActiveVocab(active={len(self)}, capacity={self.capacity}, vocab_size={self.vocab_size}, "
            f"hidden={self.hidden_size}, num_pinned={self.num_pinned}, device={self.ids.device})"
        )

    def matches(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether this state still fits ``weight``/``bias`` (same shape, dtype and device)."""
        return (
            tuple(weight.shape) == (self.vocab_size, self.hidden_size)
            and weight.dtype == self.cache_w.dtype
            and weight.device == self.cache_w.device
            and bias is self.bias
            and (bias is None or bias.dtype == self.cache_b.dtype)
        )


# --------------------------------------------------------------------- registry
# The ActiveVocab of a head weight hangs on the weight tensor itself: it lives exactly as long
# as the weight (the weight <-> state cycle is collected with it), and no global table leaks.
_ATTR = "_nanospec_active_vocab"
_LOCK = threading.Lock()


def state_for(weight: torch.Tensor, bias: torch.Tensor | None, capacity: int, num_pinned: int = 0) -> ActiveVocab:
    """The ActiveVocab of ``weight``, created (or rebuilt, if the weight changed) on demand."""
    with _LOCK:
        state = registered_state(weight)
        if state is not None:
            if state.matches(weight, bias) and state.capacity == min(capacity, weight.shape[0]) and state.num_pinned == num_pinned:
                return state
            warnings.warn(
                "nanospec: the head weight changed shape, dtype or device, or the capacity changed; "
                "its active vocabulary starts empty again",
                stacklevel=3,
            )
        state = ActiveVocab(weight, bias, capacity=capacity, num_pinned=num_pinned)
        setattr(weight, _ATTR, state)
        return state


def registered_state(weight: torch.Tensor) -> ActiveVocab | None:
    return getattr(weight, _ATTR, None)


def active_vocab(module: nn.Module, head: str | None = None) -> ActiveVocab:
    """The ActiveVocab of ``module``'s head (``module`` may be the compiled or the original one).

    It exists after the first call of the compiled module. With several heads, pass ``head``:
    the name of the head's weight parameter (as in ``module.named_parameters()``).
    """
    module = getattr(module, "_orig_mod", module)
    if not isinstance(module, nn.Module):
        raise TypeError(f"active_vocab expects an nn.Module, got {type(module).__name__}")
    found = {}
    for name, p in module.named_parameters(remove_duplicate=True):
        st = registered_state(p)
        if st is not None:
            found[name] = st
    if head is not None:
        if head not in found:
            raise KeyError(f"no active vocabulary for parameter {head!r}; heads with one: {sorted(found) or 'none'}")
        return found[head]
    if not found:
        raise LookupError(
            f"{type(module).__name__} has no active vocabulary yet: compile it with "
            "torch.compile(module, backend='nanospec') and call it once"
        )
    if len(found) > 1:
        raise LookupError(f"several heads have an active vocabulary: {sorted(found)}; pass head=<name>")
    return next(iter(found.values()))
