"""ActiveVocab: the device-resident active vocabulary of one LM head.

One ``ActiveVocab`` exists per head weight and lives as long as that weight. The compiled
graph receives its tensors as extra inputs and the nanospec ops update them in place, so
their addresses never change (CUDA graphs keep working) and no step needs the host.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Iterable, Iterator

import torch
import torch.nn as nn

from nanospec_fx.kernels import ops
# The state tensors a compiled graph receives, in order (declared once, with the op schemas).
from nanospec_fx.kernels.schema import STATE as STATE_TENSORS

DEFAULT_CAPACITY = 3072


class ActiveVocab:
    """The set of token ids the drafter's head computes logits for.

    The set only grows until :meth:`reset`; when it is full, the oldest insertions are evicted
    first (a ring over the slots), except the first ``num_pinned`` slots, which are never evicted.
    All rows of a batch share one set.

    Args:
        weight, bias: the head's [R, H] weight and optional [R] bias (R head rows).
        capacity: maximum number of active tokens (slots); clamped to R.
        num_pinned: slots never evicted, filled by the first insertions.
        seed_ids: tokens inserted at creation and after every :meth:`reset` (a policy's static core).
        observes: ``False`` freezes the set after seeding (the ``static`` policy): observe() is a no-op.
        policy: the policy's name, for display.
        token_to_row: for heads over a draft vocabulary (EAGLE-3 ``d2t``): int64 [V] mapping each
            token id to its head row, -1 for tokens the head cannot produce. Token ids passed to
            :meth:`observe`/:meth:`contains` and returned by :meth:`token_ids` are then token ids,
            not head rows.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        capacity: int = DEFAULT_CAPACITY,
        num_pinned: int = 0,
        *,
        seed_ids: torch.Tensor | None = None,
        observes: bool = True,
        policy: str = "context",
        token_to_row: torch.Tensor | None = None,
    ):
        if weight.dim() != 2:
            raise ValueError(f"head weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
        rows, hidden = weight.shape
        if bias is not None and tuple(bias.shape) != (rows,):
            raise ValueError(f"head bias must have shape ({rows},), got {tuple(bias.shape)}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        capacity = min(capacity, rows)
        if not 0 <= num_pinned < capacity:
            raise ValueError(f"num_pinned must be in [0, capacity={capacity}), got {num_pinned}")
        dev = weight.device
        self.weight, self.bias = weight, bias
        self.rows, self.hidden_size, self.capacity, self.num_pinned = rows, hidden, capacity, num_pinned
        self.policy, self.observes = policy, observes
        self.rewrites: list = []  # what the pass did for this head (passes.RewriteReport), for explain()
        self.token_to_row = self.row_to_token = None
        if token_to_row is not None:
            self.token_to_row, self.row_to_token = _check_token_map(token_to_row, rows, dev)
        self.vocab_size = self.token_to_row.numel() if self.token_to_row is not None else rows
        with torch.no_grad():
            self.ids = torch.full((capacity,), -1, dtype=torch.int64, device=dev)
            self.slot_of = torch.full((rows,), -1, dtype=torch.int32, device=dev)
            self.cursor = torch.zeros(1, dtype=torch.int64, device=dev)
            self.cache_w = torch.zeros(capacity, hidden, dtype=weight.dtype, device=dev)
            self.cache_b = torch.zeros(capacity, dtype=bias.dtype if bias is not None else weight.dtype, device=dev)
        self.seed_ids = None
        if seed_ids is not None:
            seed_ids = torch.as_tensor(seed_ids, dtype=torch.int64).flatten()
            if seed_ids.numel() > capacity:
                raise ValueError(f"{seed_ids.numel()} seed tokens do not fit in capacity {capacity}")
            self._check_range(seed_ids.to(dev))
            self.seed_ids = seed_ids.to(dev)
        self._seed()

    # ----------------------------------------------------------------- tensors
    def tensors(self) -> list[torch.Tensor]:
        """The state tensors the compiled graph receives, in the order the ops take them (:data:`STATE_TENSORS`)."""
        return [getattr(self, name) for name in STATE_TENSORS]

    @property
    def count(self) -> torch.Tensor:
        """Number of active tokens as a device tensor of shape [1] (no host sync)."""
        return torch.clamp(self.cursor, max=self.capacity)

    def rows_of(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Head rows of token ids (identity without a token map); -1 where the head has no row."""
        if self.token_to_row is None:
            return token_ids
        ok = (token_ids >= 0) & (token_ids < self.vocab_size)
        rows = self.token_to_row[torch.where(ok, token_ids, torch.zeros_like(token_ids))]
        return torch.where(ok, rows, torch.full_like(rows, -1))

    # ----------------------------------------------------------------- user API
    def observe(self, token_ids: torch.Tensor | Iterable[int], validate: bool = True) -> None:
        """Add token ids (any shape, duplicates allowed) to the active vocabulary.

        With ``validate`` (default) ids outside ``[0, vocab_size)`` raise ``ValueError`` before the
        state is touched; this reads the ids on the host. ``validate=False`` makes the call
        sync-free and silently skips out-of-range ids. A frozen (``static``) set ignores the call.
        """
        token_ids = self._as_ids(token_ids)
        if validate:
            self._check_range(token_ids)
        if self.observes:
            self._insert(token_ids)

    def reset(self) -> None:
        """Empty the set in place (compiled graphs keep using the same tensors), then re-seed it."""
        with torch.no_grad():
            self.ids.fill_(-1)
            self.slot_of.fill_(-1)
            self.cursor.zero_()
        self._seed()

    @contextlib.contextmanager
    def request(self) -> Iterator["ActiveVocab"]:
        """``with state.request():`` one request: the set starts empty (seeded) and is reset after."""
        self.reset()
        try:
            yield self
        finally:
            self.reset()

    def refresh(self) -> None:
        """Re-copy the head rows of the active tokens, after the head weights changed in place."""
        with torch.no_grad():
            n = len(self)
            rows = self.ids[:n]
            self.cache_w[:n] = self.weight[rows].to(self.cache_w.dtype)
            if self.bias is not None:
                self.cache_b[:n] = self.bias[rows].to(self.cache_b.dtype)

    def token_ids(self) -> torch.Tensor:
        """The active token ids as a 1-D int64 tensor, in slot order (reads the count on the host)."""
        rows = self.ids[: len(self)]
        return (self.row_to_token[rows] if self.row_to_token is not None else rows).clone()

    def contains(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Bool tensor: which of ``token_ids`` are active (out-of-range ids are not)."""
        rows = self.rows_of(torch.as_tensor(token_ids, device=self.slot_of.device))
        ok = (rows >= 0) & (rows < self.rows)
        return ok & (self.slot_of[torch.where(ok, rows, torch.zeros_like(rows))] >= 0)

    def __len__(self) -> int:
        return int(self.count)

    def __repr__(self) -> str:
        return (
            f"ActiveVocab(active={len(self)}, capacity={self.capacity}, vocab_size={self.vocab_size}, "
            f"hidden={self.hidden_size}, policy={self.policy!r}, num_pinned={self.num_pinned}, device={self.ids.device})"
        )

    # ----------------------------------------------------------------- internals
    def _as_ids(self, token_ids) -> torch.Tensor:
        if not isinstance(token_ids, torch.Tensor):
            token_ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
        if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
            raise TypeError(f"token ids must be an integer tensor, got {token_ids.dtype}")
        return token_ids.to(self.ids.device)

    def _check_range(self, token_ids: torch.Tensor) -> None:
        if token_ids.numel():
            lo, hi = int(token_ids.min()), int(token_ids.max())
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def _insert(self, token_ids: torch.Tensor) -> None:
        with torch.no_grad():
            ops.observe(self.rows_of(token_ids), self.weight, self.bias, *self.tensors(), self.num_pinned)

    def _seed(self) -> None:
        if self.seed_ids is not None:
            self._insert(self.seed_ids)

    def matches(self, weight: torch.Tensor, bias: torch.Tensor | None, capacity: int, num_pinned: int = 0, *,
                seed_ids=None, observes: bool = True, policy: str = "context", token_to_row=None) -> bool:
        """Whether this state is what ``ActiveVocab(weight, bias, ...)`` would build, so it can be reused."""
        return (
            tuple(weight.shape) == (self.rows, self.hidden_size)
            and weight.dtype == self.cache_w.dtype and weight.device == self.cache_w.device
            and bias is self.bias
            and (min(capacity, self.rows), num_pinned, policy, observes) == (self.capacity, self.num_pinned, self.policy, self.observes)
            and _same(seed_ids, self.seed_ids) and _same(token_to_row, self.token_to_row)
        )


def _same(a, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a = torch.as_tensor(a, dtype=torch.int64).flatten().to(b.device)
    return a.shape == b.shape and torch.equal(a, b)


def _check_token_map(token_to_row: torch.Tensor, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate a token -> head-row map; return it and its inverse (row -> token)."""
    t2r = torch.as_tensor(token_to_row, dtype=torch.int64).flatten().to(device)
    valid = t2r >= 0
    if (t2r[valid] >= rows).any():
        raise ValueError(f"token_to_row maps to rows outside [0, {rows})")
    tokens = torch.nonzero(valid).flatten()
    r2t = torch.full((rows,), -1, dtype=torch.int64, device=device)
    r2t[t2r[tokens]] = tokens
    if int(valid.sum()) != int((r2t >= 0).sum()):
        raise ValueError("token_to_row maps two tokens to the same head row")
    return t2r, r2t


# --------------------------------------------------------------------- registry
# The ActiveVocab of a head weight hangs on the weight tensor itself: it lives exactly as long
# as the weight (the weight <-> state cycle is collected with it), and no global table leaks.
_ATTR = "_nanospec_active_vocab"
_LOCK = threading.Lock()


def state_for(weight: torch.Tensor, bias: torch.Tensor | None, capacity: int, num_pinned: int = 0, **config) -> ActiveVocab:
    """The ActiveVocab of ``weight`` for this configuration: the existing one if it matches,
    else a new one (with a warning when it replaces a different one)."""
    with _LOCK:
        state = registered_state(weight)
        if state is not None and state.matches(weight, bias, capacity, num_pinned, **config):
            return state
        new = ActiveVocab(weight, bias, capacity=capacity, num_pinned=num_pinned, **config)
        if state is not None:
            warnings.warn(
                f"nanospec: the head weight's dtype, device or bias, or the vocabulary configuration changed "
                f"({state!r} -> {new!r}); its active vocabulary starts again",
                stacklevel=3,
            )
        setattr(weight, _ATTR, new)
        return new


def registered_state(weight: torch.Tensor) -> ActiveVocab | None:
    return getattr(weight, _ATTR, None)


def registered_states(module: nn.Module) -> dict[str, ActiveVocab]:
    """The ActiveVocab of every parameter of ``module`` that has one, by parameter name."""
    found = {}
    for name, p in module.named_parameters(remove_duplicate=True):
        state = registered_state(p)
        if state is not None:
            found[name] = state
    return found


def active_vocab(module: nn.Module, head: str | None = None) -> ActiveVocab:
    """The ActiveVocab of ``module``'s head (``module`` may be the compiled or the original one).

    It exists after the first call of the compiled module. With several heads, pass ``head``:
    the name of the head's weight parameter (as in ``module.named_parameters()``).
    """
    wrapper = module if hasattr(module, "_orig_mod") else None
    module = getattr(module, "_orig_mod", module)
    if not isinstance(module, nn.Module):
        raise TypeError(f"active_vocab expects an nn.Module, got {type(module).__name__}")
    found = registered_states(module)
    if head is not None:
        if head not in found:
            raise KeyError(f"no active vocabulary for parameter {head!r}; heads with one: {sorted(found) or 'none'}")
        return found[head]
    if not found:
        if wrapper is not None:
            raise LookupError(
                f"{type(module).__name__} has no active vocabulary: its torch.compile wrapper was not called. "
                "transformers' generate(assistant_model=...) calls assistant_model.generate(), which bypasses the "
                "wrapper (the head then runs dense): compile in place: drafter.compile(backend='nanospec'). "
                "To create the set before the first call: nanospec_fx.attach(drafter)"
            )
        raise LookupError(
            f"{type(module).__name__} has no active vocabulary yet: compile it with backend='nanospec' and call "
            "it once, or create it now with nanospec_fx.attach(module, **options)"
        )
    if len(found) > 1:
        raise LookupError(f"several heads have an active vocabulary: {sorted(found)}; pass head=<name>")
    return next(iter(found.values()))
