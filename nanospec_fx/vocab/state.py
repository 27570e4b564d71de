"""ActiveVocab: the device-resident active vocabulary of one LM head.

One ``ActiveVocab`` exists per head weight and lives as long as that weight: a registry weakly
keyed by the weight holds it, and the state holds its weight weakly, so nothing hangs on the
tensor (a drafter stays picklable, saveable and copyable) and nothing keeps a dropped model alive. The compiled
graph receives its tensors as extra inputs and the nanospec ops update them in place, so
their addresses never change (CUDA graphs keep working) and no step needs the host.
"""
from __future__ import annotations

import contextlib
import gc
import sys
import threading
import weakref
from dataclasses import fields, replace
from typing import Any, Iterator

import torch
from torch.utils.weak import WeakIdKeyDictionary

from nanospec_fx.kernels import ops
# The state tensors a compiled graph receives, in order (declared once, with the op schemas).
from nanospec_fx.kernels.schema import STATE as STATE_TENSORS
from nanospec_fx.kernels.schema import check_num_pinned
from nanospec_fx.kernels.state_lock import holding_state_lock, state_lock
from nanospec_fx.vocab.policies import resolve
from nanospec_fx.vocab.config import DEFAULT_CAPACITY, DEFAULT_POLICY, StateConfig, VocabConfig


class FollowsWeightWrites:
    """Re-copies cached head rows when the weight or bias was written in place since they were cached: a
    host-side check of their version counters, no device sync. Users define ``weight``, ``bias``,
    ``refresh()`` and set ``_seen_versions`` when they copy rows."""

    def refresh_if_stale(self) -> bool:
        """Refresh when the head weight or bias was written in place since the rows were cached
        (a host-side check of their version counters: no device sync). Returns whether it did."""
        versions = self._weight_versions()
        if versions is None or versions == self._seen_versions:
            return False
        self.refresh()
        return True

    def _weight_versions(self) -> tuple | None:
        """What changes when the weight or bias is written: their version counters (in-place writes,
        ``load_state_dict``, optimizer steps) and data pointers (``p.data = t``). None for inference
        tensors, which have no version counter."""
        try:
            return tuple((t._version, t.data_ptr()) if t is not None else None for t in (self.weight, self.bias))
        except RuntimeError:
            return None


class VocabState(FollowsWeightWrites):
    """What :class:`ActiveVocab` (one shared set) and :class:`~nanospec_fx.RequestVocabs` (one set per request row)
    share: the token -> head-row map, range checks, membership and listing of a set, refresh, count and seeds.

    Their state tensors are those of ``kernels/schema.py`` (a per-request state has a leading request axis on each).
    Names mean the same in both: ``rows`` is the number of head rows (the last dim of logits), ``vocab_size`` the
    token-id space (``rows`` without a token map). Subclasses check their arguments with :meth:`_check_arguments`,
    set ``capacity``, ``rows``, the state tensors, ``weight``/``bias`` and ``head_rows`` (the weight as [rows, H])."""

    #: how the constructor is called, for the errors of :meth:`_check_arguments`
    SIGNATURE = ""

    def _check_arguments(self, weight: Any, bias: Any, capacity: Any, num_pinned: Any, *, transposed: bool = False,
                         stacked: tuple = (), **counts: Any) -> tuple[int, int, int]:
        """The constructors' one argument check (every state kind, sharded ones included): ``(rows, hidden,
        capacity)`` with the capacity clamped to the head's rows. A clear ``TypeError`` for arguments in the wrong
        places before anything reads their attributes (``RequestVocabs(weight, 8, 3072)`` leaves out the bias: 8
        would be taken as the bias), then a ``ValueError`` for a wrong shape or size. ``counts``: the kind's other
        positive ints (``max_requests``)."""
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be the head's [V, H] weight tensor, got {type(weight).__name__}: "
                            f"{self.SIGNATURE}")
        if bias is not None and not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be the head's [V] bias tensor or None, got {type(bias).__name__} {bias!r}: "
                            f"the second argument is the bias ({self.SIGNATURE}); pass the others by name")
        for name, value in {**counts, "capacity": capacity}.items():
            if isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a positive int, got a tensor: {self.SIGNATURE}")
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if stacked:  # K heads stacked in one weight (axes ``stacked`` = V, K, H): one set, K rows per token
            if weight.dim() != 3 or sorted(stacked) != [0, 1, 2]:
                raise ValueError(f"a stacked head weight must be 3-D [K, V, H] (stacked: the positions of its V, K and "
                                 f"H axes), got shape {tuple(weight.shape)} and stacked={stacked!r}")
            if bias is not None:
                raise ValueError("a stacked head has no bias in its state: add a [K, V] bias after the head")
            rows, _, hidden = (weight.shape[d] for d in stacked)
            capacity = min(capacity, rows)
            check_num_pinned(num_pinned, capacity)
            return rows, hidden, capacity
        if weight.dim() != 2:
            raise ValueError(f"head weight must be 2-D [V, H] (or [H, V] transposed, or [K, V, H] stacked), got shape "
                             f"{tuple(weight.shape)}")
        local_rows = weight.shape[1] if transposed else weight.shape[0]  # rows this weight holds
        rows, hidden = (local_rows, weight.shape[0]) if transposed else (self._head_rows(weight), weight.shape[1])
        if bias is not None and tuple(bias.shape) != (local_rows,):
            raise ValueError(f"head bias must have shape ({local_rows},), got {tuple(bias.shape)}")
        capacity = min(capacity, rows)
        check_num_pinned(num_pinned, capacity)
        return rows, hidden, capacity

    def _head_rows(self, weight: torch.Tensor) -> int:
        """Rows of the whole head: the weight's own (a vocabulary-parallel state overrides it)."""
        return weight.shape[0]

    def _set_token_map(self, token_to_row: torch.Tensor | None, rows: int, device) -> int:
        """Validate and keep the token -> head-row map (and its inverse); returns the token-id space."""
        self.token_to_row = self.row_to_token = None
        if token_to_row is not None:
            self.token_to_row, self.row_to_token = _check_token_map(token_to_row, rows, device)
        return self.token_to_row.numel() if self.token_to_row is not None else rows

    def _check_seed(self, seed: torch.Tensor) -> None:
        if seed.numel() > self.capacity:
            raise ValueError(f"{seed.numel()} seed tokens do not fit in capacity {self.capacity}")
        self._check_range(seed)

    def tensors(self) -> list[torch.Tensor]:
        """The state tensors in the order the ops take them (:data:`STATE_TENSORS`)."""
        return [getattr(self, name) for name in STATE_TENSORS]

    @property
    def count(self) -> torch.Tensor:
        """Active tokens per set (``[1]`` for the shared set, ``[R]`` per request) on the device: no host sync."""
        return torch.clamp(self.cursor, max=self.capacity)

    def rows_of(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Head rows of token ids (identity without a token map); -1 where the head has no row."""
        return rows_of_tokens(token_ids, self.token_to_row)

    def _holds(self, slot_of: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Which ``token_ids`` the set with membership map ``slot_of`` [rows] holds (out-of-range ids: False)."""
        rows = self.rows_of(token_ids)
        ok = (rows >= 0) & (rows < self.rows)
        return ok & (slot_of[torch.where(ok, rows, torch.zeros_like(rows))] >= 0)

    def _tokens_of(self, head_rows: torch.Tensor) -> torch.Tensor:
        """The token ids of active head rows (a copy)."""
        return (self.row_to_token[head_rows] if self.row_to_token is not None else head_rows).clone()

    @holding_state_lock
    def refresh(self) -> None:
        """Re-copy the head rows of the active tokens from the head's current weight and bias.

        Observe and the head calls do it by themselves when the weight or bias was written since (see
        :meth:`refresh_if_stale`); call it after writes that bypass the version counter (through ``w.data``), or
        for a weight created under ``inference_mode``. No host sync: every slot is re-copied (free slots copy row 0
        and stay masked)."""
        with torch.no_grad(), torch.inference_mode(False):
            rows = torch.clamp(self.ids, min=0)
            self.cache_w.copy_(self.head_rows.detach()[rows])
            if self.bias is not None:
                self.cache_b.copy_(self.bias.detach()[rows])
        self._seen_versions = self._weight_versions()


def stacked_axes(weight: torch.Tensor) -> tuple:
    """The positions of the V, K and H axes of a stacked head weight whose graph was not seen yet: K first, V the
    wider of the other two (a few heads of a vocabulary wider than the hidden size), as the pass reads them."""
    return (1, 0, 2) if weight.shape[1] >= weight.shape[2] else (2, 0, 1)


def rows_of_tokens(token_ids: torch.Tensor, token_to_row: torch.Tensor | None) -> torch.Tensor:
    """Head rows of token ids (identity without a token map); -1 where the head has no row or out of range."""
    if token_to_row is None:
        return token_ids
    ok = (token_ids >= 0) & (token_ids < token_to_row.numel())
    rows = token_to_row[torch.where(ok, token_ids, torch.zeros_like(token_ids))]
    return torch.where(ok, rows, torch.full_like(rows, -1))


def in_range_or_nothing(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``token_ids`` if every one is in ``[0, vocab_size)``, else all -1 (observe skips them): the range check of a
    validated observe on a device, all-or-nothing like the graph's transactional observes, computed there with no
    host sync (a ``ValueError`` would need the ids on the host: a sync per call)."""
    ok = ((token_ids >= 0) & (token_ids < vocab_size)).all()
    return torch.where(ok, token_ids, torch.full_like(token_ids, -1))


def check_token_range(token_ids: torch.Tensor, vocab_size: int) -> None:
    """``ValueError`` naming the first bad id when a token id is outside ``[0, vocab_size)`` (reads them on the
    host)."""
    if token_ids.numel():
        lo, hi = int(token_ids.min()), int(token_ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")


class ActiveVocab(VocabState):
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
        transposed: the weight is stored [H, R] (a head ``h @ W``): its columns are the head rows. The state
            is keyed on that stored tensor, never on a ``W.t()`` view (a new object every call).
        stacked: the weight is K heads stacked in one 3-D tensor (Medusa heads applied by one einsum,
            ``passes/stacked_heads.py``), given as the positions of its R, K and H axes: ``(1, 0, 2)`` for [K, R, H],
            ``(2, 0, 1)`` for [K, H, R]. One set for the K heads, whose cache holds the K rows of each active token
            (``cache_w [C, K, H]``); ``head_rows`` is the ``[R, K, H]`` view. No bias (a [K, R] bias is a post-op).
            A 3-D weight given without it is read [K, R, H] or [K, H, R], R the wider axis (``stacked_axes``); a
            compiled graph that reads it otherwise rebuilds the state in place, keeping its tokens.
    """

    SIGNATURE = f"ActiveVocab(weight, bias=None, capacity={DEFAULT_CAPACITY}, num_pinned=0)"

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        capacity: int = DEFAULT_CAPACITY,
        num_pinned: int = 0,
        *,
        seed_ids: torch.Tensor | None = None,
        observes: bool = True,
        policy: str = DEFAULT_POLICY,
        token_to_row: torch.Tensor | None = None,
        transposed: bool = False,
        stacked: tuple = (),
    ):
        if not stacked and isinstance(weight, torch.Tensor) and weight.dim() == 3:
            stacked = stacked_axes(weight)  # ActiveVocab(W), attach(model, head="W") of a stacked weight
        self.transposed, self.stacked = bool(transposed), tuple(stacked)
        rows, hidden, capacity = self._check_arguments(weight, bias, capacity, num_pinned, transposed=self.transposed,
                                                       stacked=self.stacked)
        dev = weight.device
        # A state of the registry (state_for) holds its weight weakly: the registry maps the weight to the
        # state, so a strong reference back would keep both alive forever. A state built directly holds it.
        self._weight_ref, self._weight_strong = weakref.ref(weight), weight
        self.bias = bias
        self.rows, self.hidden_size, self.capacity, self.num_pinned = rows, hidden, capacity, num_pinned
        self.policy, self.observes = policy, observes
        self._users: weakref.WeakSet = weakref.WeakSet()  # compiled wrappers reading these tensors
        self.generation = 0  # bumped when rebuilt in place with new tensors (see state_for)
        self.vocab_size = self._set_token_map(token_to_row, rows, dev)
        # Normal tensors even when created under inference_mode, so that observe() and reset()
        # also work outside it.
        with torch.no_grad(), torch.inference_mode(False):
            self.ids = torch.full((capacity,), -1, dtype=torch.int64, device=dev)
            self.slot_of = torch.full((rows,), -1, dtype=torch.int32, device=dev)
            self.cursor = torch.zeros(1, dtype=torch.int64, device=dev)
            per_row = (weight.shape[self.stacked[1]], hidden) if self.stacked else (hidden,)  # K rows per token
            self.cache_w = torch.zeros(capacity, *per_row, dtype=weight.dtype, device=dev)
            self.cache_b = torch.zeros(capacity, dtype=bias.dtype if bias is not None else weight.dtype, device=dev)
        self.seed_ids = None
        if seed_ids is not None:
            seed_ids = torch.as_tensor(seed_ids, dtype=torch.int64).flatten().to(dev)
            self._check_seed(seed_ids)
            self.seed_ids = seed_ids
        self._seen_versions = self._weight_versions()
        self._seed()

    # ----------------------------------------------------------------- tensors
    @property
    def weight(self) -> torch.Tensor:
        """The head weight this state caches rows of (held weakly: the state does not keep it alive)."""
        weight = self._weight_strong if self._weight_strong is not None else self._weight_ref()
        if weight is None:
            raise RuntimeError(
                "nanospec: the head weight of this active vocabulary was freed (its model was deleted or its head "
                "replaced); get the current one with nanospec_fx.active_vocab(model)"
            )
        return weight

    def _fresh_factory(self) -> Any:
        """What builds a new state of this kind, ``factory(weight, bias, **config.keywords())`` (``state_for``'s
        ``factory``; a vocabulary-parallel state passes its shard along)."""
        return type(self)

    @property
    def head_rows(self) -> torch.Tensor:
        """The weight as [R, H] head rows: the weight itself, or a ``.t()`` view of a transposed one ([R, K, H]
        for a stacked one: ``permute(1, 0, 2)``)."""
        if self.stacked:
            return self.weight.permute(*self.stacked)
        return self.weight.t() if self.transposed else self.weight

    def is_weight(self, tensor: Any) -> bool:
        """Whether ``tensor`` is this state's head weight (False once that weight was freed)."""
        return tensor is not None and self._weight_ref() is tensor

    def bias_fits(self, bias: torch.Tensor | None) -> bool:
        """Whether ``bias`` can replace this state's bias in place: both absent, or same shape, dtype and device."""
        if bias is None or self.bias is None:
            return bias is None and self.bias is None
        return tuple(bias.shape) == (self.rows,) and bias.dtype == self.bias.dtype and bias.device == self.bias.device

    def set_bias(self, bias: torch.Tensor | None) -> None:
        """Follow a head bias replaced by another tensor (``head.bias = nn.Parameter(...)``,
        ``load_state_dict(assign=True)``): re-copy the active rows' bias from it, as for a weight written in
        place. A bias of another shape, dtype or device, or adding/removing one, changes what the compiled
        graph was made for: a ``ValueError`` that says what to do."""
        if bias is self.bias:
            return
        if not self.bias_fits(bias):
            def describe(b):
                return "no bias" if b is None else f"a bias {tuple(b.shape)} {b.dtype} on {b.device}"
            raise ValueError(
                f"nanospec: the head bias was replaced by {describe(bias)}, but this active vocabulary and the graphs "
                f"compiled for it have {describe(self.bias)}; replace the head's weight and bias together (a new head "
                "weight gets its own active vocabulary), or call torch._dynamo.reset() and compile again"
            )
        self.bias = bias
        self.refresh()
        self.generation += 1  # compiled graphs that pass the bias as an input (target observers) take the new one

    # ----------------------------------------------------------------- user API
    @holding_state_lock
    def observe(self, token_ids: Any, validate: bool = True) -> None:
        """Add token ids (any shape, duplicates allowed) to the active vocabulary.

        Accepted: a Python int, an integer tensor (any integer dtype, any device), a numpy integer
        array or scalar, or (nested) lists/tuples/ranges of those; anything else (floats, bools,
        strings, ...) raises ``TypeError``. With ``validate`` (default) ids outside
        ``[0, vocab_size)`` raise ``ValueError`` on a CPU state (read on the host: no device to wait
        for); on another device the check runs there, with no host sync: a call holding such an id
        observes nothing (:func:`in_range_or_nothing`). On either error the state is unchanged.
        ``validate=False`` skips out-of-range ids and observes the others. A frozen (``static``) set
        ignores the call.
        """
        token_ids = self._as_ids(token_ids)
        if validate and token_ids.device.type != "cpu" and not getattr(self, "observes_meet_the_ranks", False):
            token_ids = in_range_or_nothing(token_ids, self.vocab_size)
        elif validate:  # on the host; a sharded set's check also flags the other ranks (sharded_state)
            self._check_range(token_ids)
        if self.observes:
            self.refresh_if_stale()
            self._insert(token_ids)

    @holding_state_lock
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

    @holding_state_lock
    def token_ids(self) -> torch.Tensor:
        """The active token ids as a 1-D int64 tensor, in slot order (reads the count on the host)."""
        return self._tokens_of(self.ids[: len(self)])

    @holding_state_lock
    def contains(self, token_ids: Any) -> torch.Tensor:
        """Bool tensor of the ids' shape: which of ``token_ids`` are active (out-of-range ids are not).
        Accepts what :meth:`observe` accepts (nested lists come back flattened)."""
        return self._holds(self.slot_of, self._as_ids(token_ids))

    def __len__(self) -> int:
        return int(self.count)

    def __repr__(self) -> str:
        return (
            f"ActiveVocab(active={len(self)}, capacity={self.capacity}, vocab_size={self.vocab_size}, "
            f"hidden={self.hidden_size}, policy={self.policy!r}, num_pinned={self.num_pinned}, "
            f"device={self.ids.device})"
        )

    # ----------------------------------------------------------------- internals
    def _as_ids(self, token_ids: Any) -> torch.Tensor:
        """``token_ids`` as an int64 tensor on the state's device; TypeError for anything that is
        not clearly token ids (checked on the host, without reading tensor data)."""
        return as_token_ids(token_ids).to(self.ids.device)

    def _check_range(self, token_ids: torch.Tensor) -> None:
        check_token_range(token_ids, self.vocab_size)

    def _insert(self, token_ids: torch.Tensor) -> None:
        with torch.no_grad():
            ops.observe(token_ids=self.rows_of(token_ids), weight=self.head_rows, bias=self.bias,
                        **dict(zip(STATE_TENSORS, self.tensors())), num_pinned=self.num_pinned)

    def _seed(self) -> None:
        if self.seed_ids is not None:
            self._insert(self.seed_ids)

    def matches(self, weight: torch.Tensor, bias: torch.Tensor | None, config: StateConfig) -> bool:
        """Whether this state is what ``config`` would build for ``weight`` and ``bias``, so it can be reused."""
        return self.fits(weight) and bias is self.bias and not self.differences(config)

    def fits(self, weight: torch.Tensor) -> bool:
        """Whether the cache still has ``weight``'s shape, dtype and device."""
        shape = tuple(weight.shape)[::-1] if self.transposed else tuple(weight.shape)
        if self.stacked:
            shape = tuple(shape[d] for d in self.stacked)
        wanted = (self.rows, self.cache_w.shape[1], self.hidden_size) if self.stacked else (self.rows, self.hidden_size)
        return (shape == wanted and weight.dtype == self.cache_w.dtype
                and weight.device == self.cache_w.device)

    def differences(self, config: StateConfig) -> list[str]:
        """The vocabulary options in which ``config`` differs from this state's, as ``name: mine -> theirs``."""
        return self.config().differences(replace(config, capacity=min(config.capacity, self.rows)))

    def config(self) -> StateConfig:
        """The configuration this state was built with (``state_for`` rebuilds a state from it)."""
        return StateConfig(self.capacity, self.num_pinned, seed_ids=self.seed_ids, observes=self.observes,
                           policy=self.policy, token_to_row=self.token_to_row)

    def bind(self, user: object) -> None:
        """Record a compiled wrapper that reads this state's tensors (held weakly)."""
        self._users.add(user)

    def layout(self) -> list:
        """Shapes and dtypes of the tensors a compiled graph receives from this state."""
        tensors = self.tensors() + ([self.token_to_row] if self.token_to_row is not None else [])
        return [(tuple(t.shape), t.dtype, t.device) for t in tensors] + [self.bias is None]

    def _tokens_oldest_first(self) -> torch.Tensor:
        """The active tokens in the order re-observing them rebuilds this set: the pinned slots, then the ring from its
        oldest insertion (the slot the next insertion claims) to its newest. Slot order is that order only until the
        ring wraps; after it, re-observing in slot order would make the newest token the next one evicted."""
        cursor, ring = int(self.cursor), self.capacity - self.num_pinned
        if cursor <= self.capacity:
            slots = torch.arange(min(cursor, self.capacity))
        else:
            oldest = (cursor - self.num_pinned) % ring
            slots = torch.cat([torch.arange(self.num_pinned), self.num_pinned + (oldest + torch.arange(ring)) % ring])
        rows = self.ids[slots.to(self.ids.device)]
        return self._tokens_of(rows[rows >= 0])

    def _reconfigure(self, weight, bias, config: StateConfig, transposed: bool, stacked: tuple = ()) -> None:
        """Rebuild in place (same object, new tensors) keeping the active tokens, so that every
        handle the user holds stays valid. The new configuration is validated before anything changes."""
        fresh = self._fresh_factory()(weight, bias, **config.keywords(), **_layout(transposed, stacked))
        with state_lock(self.ids):  # no observe of the old tensors is lost between reading and replacing them
            kept = self._tokens_oldest_first() if self.observes else None
            keep = {"_users": self._users, "generation": self.generation + 1,
                    "_weight_strong": fresh._weight_strong if self._weight_strong is not None else None}
            self.__dict__.update(fresh.__dict__)
            self.__dict__.update(keep)
        if kept is not None and kept.numel():
            self.observe(kept, validate=False)  # ids the new head cannot produce are skipped


_INT_DTYPES = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64} | {
    getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)}
_ACCEPTED = ("token ids must be a Python int, an integer tensor, a numpy integer array or scalar, "
             "or (nested) lists/tuples/ranges of those")


def as_token_ids(token_ids: Any) -> torch.Tensor:
    """Whatever clearly is token ids, as an int64 tensor (nested lists come back flattened).

    Floats, bools, strings and other objects raise ``TypeError`` saying what is accepted: a
    float id is a bug upstream, not something to truncate, and a bool list is a mask, not ids.
    """
    if isinstance(token_ids, torch.Tensor):
        if token_ids.numel() == 0 and not token_ids.is_complex():
            return torch.zeros(0, dtype=torch.int64)  # torch.tensor([]) is float32: no id in it, nothing to refuse
        if token_ids.dtype not in _INT_DTYPES:
            raise TypeError(f"{_ACCEPTED}; got a tensor of dtype {token_ids.dtype}")
        return token_ids.to(torch.int64)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(token_ids, (np.ndarray, np.generic)):
        if token_ids.size == 0 and token_ids.dtype.kind in "iufb":
            return torch.zeros(0, dtype=torch.int64)
        if token_ids.dtype.kind not in "iu":
            raise TypeError(f"{_ACCEPTED}; got a numpy {type(token_ids).__name__} of dtype {token_ids.dtype}")
        return torch.from_numpy(np.asarray(token_ids, dtype=np.int64).copy())
    if isinstance(token_ids, int) and not isinstance(token_ids, bool):
        return _int64_tensor([token_ids])
    if isinstance(token_ids, (list, tuple, range)):
        flat: list = []
        _flatten(token_ids, flat)
        if all(isinstance(t, int) for t in flat):
            return _int64_tensor(flat)
        return torch.cat([as_token_ids(t).reshape(-1) for t in flat]) if flat else torch.zeros(0, dtype=torch.int64)
    raise TypeError(f"{_ACCEPTED}; got {type(token_ids).__name__}")


def _flatten(items, out: list) -> None:
    np = sys.modules.get("numpy")
    for t in items:
        if isinstance(t, (list, tuple, range)):
            _flatten(t, out)
        elif isinstance(t, bool) or not (isinstance(t, (int, torch.Tensor))
                                         or (np is not None and isinstance(t, (np.ndarray, np.generic)))):
            raise TypeError(f"{_ACCEPTED}; got an element of type {type(t).__name__} ({t!r})")
        else:
            out.append(t)


def _int64_tensor(values: list) -> torch.Tensor:
    try:
        return torch.tensor(values, dtype=torch.int64)
    except (RuntimeError, OverflowError, ValueError):
        raise ValueError("a token id does not fit in int64, so it is outside the vocabulary") from None


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
# The ActiveVocab of each head weight, weakly keyed by the weight's identity: an entry lives exactly
# as long as its weight (the state holds the weight weakly, so the entry never keeps its own key
# alive), and nothing is stored on the tensor, so pickling, torch.save and deepcopy of a drafter,
# its state_dict(keep_vars=True) or the weight alone never meet it. A copy gets its own state.
def _layout(transposed: bool | None, stacked: tuple | None = ()) -> dict:
    """The layout keyword of a state's constructor (only [V, H] states of other kinds take none)."""
    return {"stacked": tuple(stacked)} if stacked else {"transposed": True} if transposed else {}


_REGISTRY: WeakIdKeyDictionary = WeakIdKeyDictionary()
_LOCK = threading.RLock()
VOCAB_OPTIONS = ", ".join(f.name for f in fields(VocabConfig))


def state_for(weight: torch.Tensor, bias: torch.Tensor | None, config: StateConfig | VocabConfig, *,
              name: str | None = None, factory: Any = ActiveVocab, transposed: bool | None = None,
              stacked: tuple | None = None) -> ActiveVocab:
    """The ActiveVocab of ``weight`` for ``config`` (a VocabConfig is resolved first). One state per head weight:

    * the existing one when it matches;
    * the existing one rebuilt in place (the same object, so handles stay valid, with its active
      tokens kept) when its options or the weight's dtype/device changed and no compiled wrapper
      that can still run reads it;
    * otherwise a ``ValueError``: two compiled wrappers of one head asked for different
      vocabulary options, and one of them would be left on a state ``observe()`` no longer reaches.

    ``factory(weight, bias, **keywords)`` builds a new state (a vocabulary-parallel head's builds a
    :class:`nanospec_fx.parallel.sharded_state.ShardedActiveVocab`).
    ``transposed``: the weight is stored [H, V] (``h @ W``); None keeps the existing state's layout (else [V, H]).
    ``stacked``: the weight is K heads in one 3-D tensor, the positions of its V, K and H axes (one set for the K
    heads; ``ActiveVocab``); a 3-D weight is read stacked by every graph, a 2-D one never.
    """
    if isinstance(config, VocabConfig):
        config = resolve(config)
    with _LOCK:
        state = registered_state(weight)
        if state is None:
            state = factory(weight, bias, **config.keywords(), **_layout(transposed, stacked))
            state._weight_strong = None  # the registry keys it by the weight: hold the weight weakly
            _REGISTRY[weight] = state
            return state
        layout = state.transposed if transposed is None else bool(transposed)
        stack = tuple(stacked) if stacked else getattr(state, "stacked", ())
        if stack != getattr(state, "stacked", ()):  # [K, V, H] read as [K, H, V]: a square stack, another layout
            diffs_layout = [f"the stacked weight's axes (V, K, H at {stack}, not {getattr(state, 'stacked', ())})"]
        else:
            diffs_layout = []
        if bias is not state.bias and state.fits(weight) and state.bias_fits(bias) and layout == state.transposed:
            state.set_bias(bias)  # the head's bias was replaced by a tensor of the same shape: follow it
        if layout == state.transposed and not diffs_layout and state.matches(weight, bias, config):
            return state
        diffs = state.differences(config) + diffs_layout
        if layout != state.transposed:
            diffs.append(f"the weight's layout ({'[H, V]' if layout else '[V, H]'}: the weight is read "
                         f"{'transposed' if layout else 'as stored'} by this graph)")
        if bias is not state.bias:
            diffs.append("the head's bias tensor")
        if diffs and _running_users(state, weight):
            what = f"the head {name}" if name else f"the head weight {tuple(weight.shape)}"
            raise ValueError(
                f"nanospec: {what} already has an active vocabulary read by another compiled wrapper, with other "
                f"vocabulary options ({'; '.join(diffs)}). One ActiveVocab exists per head weight: compile every "
                f"wrapper (and target observer) of this head with the same vocabulary options ({VOCAB_OPTIONS}), "
                "or drop the other wrapper first (torch._dynamo.reset())."
            )
        state._reconfigure(weight, bias, config, layout, stack)
        return state


def _running_users(state: ActiveVocab, weight: torch.Tensor) -> bool:
    """Whether a live compiled wrapper reads ``state`` and can still run (its compiled graph was
    made for the current layout; a wrapper for another dtype is guarded out by Dynamo)."""
    if not state.fits(weight):
        return False
    if not state._users:
        return False
    gc.collect()  # wrappers dropped by torch._dynamo.reset() sit in reference cycles
    return len(state._users) > 0


def registered_state(weight: torch.Tensor) -> ActiveVocab | None:
    """The ActiveVocab of ``weight``, or None when it has none."""
    return _REGISTRY.get(weight)
