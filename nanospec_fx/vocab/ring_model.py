"""The active vocabulary's slot policy in plain Python, one insertion at a time: the specification the kernel tests
hold every ``observe`` implementation to, and the set the coverage evaluation replays requests through.

It lives apart from both on purpose. An oracle must not reuse the code it judges (``kernels/``), the kernel tests must
not depend on the evaluation (``nanospec_fx.eval``, an optional extra), and the coverage figures must come from the
policy the kernels run, not from a second copy of it. It is written from the rules stated in
``kernels.reference.observe`` and docs/kernels.md ("Eviction order"), imports nothing (no torch), and the runtime never
imports it.
"""
from __future__ import annotations

from typing import Iterable, Iterator


class RingModel:
    """An active set of ``capacity`` slots: the first ``num_pinned`` insertions keep slots ``[0, num_pinned)``
    forever; the other slots form a ring that the insertion cursor walks, evicting the token it finds (the oldest
    first insertion: re-observing an active token changes nothing).

    :meth:`observe` inserts a call's new ids in order of first occurrence, after *renewal*: a call never evicts a
    token it feeds while all its tokens fit in the ring; such a token is emptied from its slot first and inserted
    again, as the newest. Ids outside ``[0, vocab_size)`` are skipped, as the ops skip them (``vocab_size=None``: any
    id >= 0). ``capacity=None``: unbounded, nothing is ever evicted. ``renew=False``: the policy without renewal, to
    show that a test depends on it.

    The state mirrors the op state: ``ids`` (slot -> token, -1 for an empty slot), ``slot_of`` (token -> slot, the
    active tokens only) and ``cursor`` (insertions ever made).
    """

    def __init__(self, capacity: int | None, num_pinned: int = 0, vocab_size: int | None = None,
                 renew: bool = True):
        if capacity is not None and not 0 <= num_pinned < capacity:
            raise ValueError(f"num_pinned must be in [0, capacity), got {num_pinned} for capacity {capacity}")
        if num_pinned < 0:
            raise ValueError(f"num_pinned must be >= 0, got {num_pinned}")
        self.capacity, self.num_pinned, self.vocab_size, self.renews = capacity, num_pinned, vocab_size, renew
        self.ids: list[int] = [-1] * (capacity or 0)
        self.slot_of: dict[int, int] = {}
        self.cursor = 0

    def slot(self, k: int) -> int:
        """The slot the ``k``-th insertion (counting from 0) claims."""
        if self.capacity is None or k < self.capacity:
            return k
        ring = self.capacity - self.num_pinned
        return self.num_pinned + (k - self.num_pinned) % ring

    def observe(self, tokens: Iterable[int]) -> None:
        """Insert the ids of one call (duplicates and out-of-range ids allowed) as the observe op does."""
        call = [t for t in dict.fromkeys(tokens) if t >= 0 and (self.vocab_size is None or t < self.vocab_size)]
        if self.renews:
            self._renew(call)
        for t in [t for t in call if t not in self.slot_of]:  # new as of the call's start (after renewal)
            slot = self.slot(self.cursor)
            if self.capacity is None:
                self.ids.append(t)
            elif self.ids[slot] >= 0:
                del self.slot_of[self.ids[slot]]
            self.ids[slot] = t
            self.slot_of[t] = slot
            self.cursor += 1

    def _renew(self, call: list[int]) -> None:
        """Walking the ring slots in the order the next insertions claim them, a slot holding a fed token with fewer
        than ``n_new`` free slots (empty, or holding a token the call does not feed) before it is emptied, so that
        the token is inserted again as new - if the new tokens and the emptied ones fit in the ring."""
        n_new = sum(t not in self.slot_of for t in call)
        if self.capacity is None or n_new == 0:
            return
        fed, ring = set(call), self.capacity - self.num_pinned
        free, emptied = 0, []
        for k in range(self.cursor, self.cursor + ring):
            if free >= n_new:  # the insertions stop before any later slot
                break
            slot = self.slot(k)
            if self.ids[slot] in fed:
                emptied.append(slot)
            else:
                free += 1
        if emptied and n_new + len(emptied) <= ring:
            for slot in emptied:
                del self.slot_of[self.ids[slot]]
                self.ids[slot] = -1

    def oldest(self) -> list[int]:
        """The ring's tokens in the order the next insertions reach them (oldest first); pinned slots excluded."""
        if self.capacity is None:
            return self.ids[self.num_pinned:]
        ring = self.capacity - self.num_pinned
        walk = (self.ids[self.slot(k)] for k in range(max(self.cursor, self.num_pinned), self.cursor + ring))
        return [t for t in walk if t >= 0]

    def __contains__(self, token: int) -> bool:
        return token in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    def __iter__(self) -> Iterator[int]:
        return iter(self.slot_of)
