"""CPU implementations of the nanospec ops whose cost follows the active count, not the capacity.

On a CPU there is no device to keep busy and no sync to avoid: reading ``cursor`` on the host is
free, so these ops compute only what is active instead of masking the whole capacity as the
reference does. Outputs keep the reference's static shapes and values exactly (slots past the
count are -inf, top-k pads with the smallest inactive ids); only the work inside changes:

* the head multiplies ``x`` by the first :func:`bucket` ``(count)`` cached rows, not all C (a few
  sizes per octave, so the matrix shapes repeat; ~25% at most computed past the count);
* scatter, top-k and argmax read the ``count`` active slots only;
* ``observe`` de-duplicates, renews and allocates in Python over the call's few ids and moves the
  data with a handful of tensor ops (the reference needs ~70 small ones to stay on the device).

:mod:`kernels.dispatch` picks these for plain CPU tensors, and the reference while a tensor is
traced (fake or under a dispatch mode): a traced body must not read data on the host.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .schema import check_num_pinned

_MIN_BUCKET = 16
_STEPS_PER_OCTAVE = 4


def bucket(count: int, capacity: int) -> int:
    """Rows the head computes for ``count`` active slots: ``count`` rounded up to one of
    ``_STEPS_PER_OCTAVE`` sizes per power of two (at least 16), at most the capacity; 0 for 0."""
    if count <= 0:
        return 0
    n = max(count, _MIN_BUCKET)
    step = 1 << max(n.bit_length() - 1 - (_STEPS_PER_OCTAVE.bit_length() - 1), 0)
    return min(capacity, -(-n // step) * step)


def active_count(cursor: torch.Tensor, capacity: int) -> int:
    """How many slots are active: ``min(cursor, C)``, read on the host."""
    return min(int(cursor.reshape(())), capacity)


# ----------------------------------------------------------------------------- observe
def _slot(k: int, capacity: int, num_pinned: int) -> int:
    """Slot of the k-th insertion (the rule of :func:`kernels.reference.slot_for_insertion`)."""
    return k if k < capacity else num_pinned + (k - num_pinned) % (capacity - num_pinned)


def renewed_slots(slots: list[int], start: int, capacity: int, num_pinned: int) -> set[int]:
    """Slots of the call's active ids that its new ids would claim, to be inserted again as newest.

    ``slots``: the slot of each distinct fed id (-1: new). Ring position ``q`` is the ``q``-th slot the
    next insertions claim; one holding a fed id is endangered when fewer than ``n_new`` positions
    before it are free (empty, or holding an id the call does not feed). Renewed only if the new ids
    and the endangered ones all fit in the ring (else the call keeps the rule: the last ones stay).
    """
    ring = capacity - num_pinned
    n_new = sum(1 for s in slots if s < 0)
    if n_new == 0:
        return set()
    head = _slot(start, capacity, num_pinned)
    held = sorted(((s - head) % ring, s) for s in slots if s >= num_pinned)  # active ring slots, in claim order
    endangered = [s for before, (q, s) in enumerate(held) if q - before < n_new]
    return set(endangered) if endangered and n_new + len(endangered) <= ring else set()


def plan_insertions(
    fed: list[int], slots: list[int], start: int, capacity: int, num_pinned: int
) -> tuple[list[int], list[int], int] | None:
    """Where the distinct fed ids ``fed`` (their current slots ``slots``, -1: inactive) go, for a set whose
    cursor is ``start``: ``(tokens, their slots, the new cursor)``, or None when nothing is inserted.

    Pure Python over the call's few ids (the rule of :func:`nanospec_fx.kernels.reference.observe`, fed-id renewal
    included): :func:`observe` applies one plan, the per-request host path applies every request's in one batch.
    """
    renew = renewed_slots(slots, start, capacity, num_pinned)
    new = [t for t, s in zip(fed, slots) if s < 0 or s in renew]  # order of first occurrence
    if not new:
        return None
    # The k-th insertion claims _slot(k); an overflowing call drops its earliest ring insertions.
    ring = capacity - num_pinned
    skip_from = max(num_pinned - start, 0)
    skip_to = skip_from + max(len(new) - skip_from - ring, 0)
    kept = [(t, _slot(start + r, capacity, num_pinned)) for r, t in enumerate(new) if not skip_from <= r < skip_to]
    return [t for t, _ in kept], [s for _, s in kept], start + len(new)


def observe(
    token_ids: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor,
    slot_of: torch.Tensor,
    cursor: torch.Tensor,
    cache_w: torch.Tensor,
    cache_b: torch.Tensor,
    num_pinned: int,
) -> None:
    """Same contract as :func:`nanospec_fx.kernels.reference.observe` (fed-id renewal included)."""
    capacity, vocab = ids.numel(), slot_of.numel()
    check_num_pinned(num_pinned, capacity)
    fed = [t for t in dict.fromkeys(token_ids.reshape(-1).to(torch.int64).tolist()) if 0 <= t < vocab]
    if not fed:
        return
    slots = slot_of.index_select(0, torch.tensor(fed, dtype=torch.int64, device=ids.device)).tolist()
    start = int(cursor.reshape(()))
    plan = plan_insertions(fed, slots, start, capacity, num_pinned)
    if plan is None:
        return
    tokens, dests, end = plan
    tok = torch.tensor(tokens, dtype=torch.int64, device=ids.device)
    dest = torch.tensor(dests, dtype=torch.int64, device=ids.device)
    victims = [t for t in ids.index_select(0, dest).tolist() if t >= 0]
    if victims:  # first: a renewed id may be its own victim, and is then written again below
        slot_of.index_fill_(0, torch.tensor(victims, dtype=torch.int64, device=ids.device), -1)
    ids.index_copy_(0, dest, tok)
    slot_of.index_copy_(0, tok, dest.to(slot_of.dtype))
    cache_w.index_copy_(0, dest, weight.index_select(0, tok).to(cache_w.dtype))
    if bias is not None:
        cache_b.index_copy_(0, dest, bias.index_select(0, tok).to(cache_b.dtype))
    cursor.fill_(end)


# ----------------------------------------------------------------------------- head and selection
def compact_logits(
    x: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, cursor: torch.Tensor
) -> torch.Tensor:
    """``x @ cache_w.T (+ cache_b)`` over the bucket of active rows -> [..., C]; -inf past the count."""
    capacity = cache_w.shape[0]
    n = active_count(cursor, capacity)
    rows = bucket(n, capacity)
    part = F.linear(x, cache_w[:rows], None if cache_b is None else cache_b[:rows])
    out = part.new_full((*part.shape[:-1], capacity), float("-inf"))
    out[..., :n] = part[..., :n]
    return out


def scatter_logits(compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Place the active compact logits at their token ids in a [..., V] tensor of -inf."""
    n = active_count(cursor, ids.numel())
    out = compact.new_full((*compact.shape[:-1], vocab_size), float("-inf"))
    src = compact[..., :n]
    return out.scatter_(-1, ids[:n].expand(src.shape), src)


def head_logits(
    x: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, ids: torch.Tensor, cursor: torch.Tensor,
    vocab_size: int,
) -> torch.Tensor:
    """``scatter_logits(compact_logits(...))``: the head with no post-ops, [..., V]."""
    return scatter_logits(compact_logits(x, cache_w, cache_b, cursor), ids, cursor, vocab_size)


def compact_topk(
    compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, k: int, largest: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over the active slots, with the reference's tie rule and padding
    (:func:`nanospec_fx.kernels.reference.compact_topk`): a stable sort of the active values laid out in
    token-id order, then the smallest inactive ids (value -inf, or +inf if not ``largest``)."""
    if k < 0:
        raise ValueError(f"k={k} must be >= 0")
    n = active_count(cursor, ids.numel())
    tokens, by_id = torch.sort(ids[:n])  # active ids are distinct
    vals, order = torch.sort(compact[..., :n].index_select(-1, by_id), dim=-1, descending=largest, stable=True)
    found = min(k, n)
    vals, tokens = vals[..., :found].contiguous(), tokens[order[..., :found]]  # the fake promises contiguous
    if k > found:  # padding: the k - found smallest inactive ids, all in [0, k)
        taken = torch.zeros(k, dtype=torch.bool, device=ids.device)
        taken[tokens.new_tensor([t for t in ids[:n].tolist() if t < k])] = True
        pad = torch.nonzero(~taken).reshape(-1)[: k - found]
        shape = (*compact.shape[:-1], k - found)
        vals = torch.cat([vals, vals.new_full(shape, float("-inf") if largest else float("inf"))], -1)
        tokens = torch.cat([tokens, pad.expand(shape)], -1)
    return vals, tokens


def compact_argmax(compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor) -> torch.Tensor:
    """Token id of the largest active compact logit (ties: smaller id; NaN largest; 0 if none)."""
    return compact_topk(compact, ids, cursor, 1, largest=True)[1].squeeze(-1)
