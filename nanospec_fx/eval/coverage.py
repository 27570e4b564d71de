"""How often is the next token already in the drafter's vocabulary? An honest simulation.

A drafter can only propose tokens its head computes; a token outside the set is a certain
rejection. This module replays real requests (prompt + continuation, as token ids) and counts,
for every continuation token, whether it was in the active set *when it had to be drafted*:

* ``full``: the whole vocabulary (always covered, the baseline cost);
* ``static``: FR-Spec's fixed top-N tokens by frequency, counted on a separate corpus;
* ``context``: NanoSpec's set: the prompt and every token committed so far (the drafter observes
  its inputs), optionally plus the target's top-k at every position it has *verified*;
* ``hybrid``: a pinned static core plus the context set.

Honest timing: the target scores position j-1 (predicting token j) only when it verifies a round
that contains token j. So its top-k for a token is never known while that token is drafted: with
``verify_every=b``, a round commits b tokens and the top-k for them joins the set when the round
ends. The target's predictions at rejected draft positions (which the real system also adds) are
not simulated, so the context sets here are a lower bound. Drafted tokens add nothing: the drafter
can only propose tokens that are already active.

The set's capacity and eviction are :class:`nanospec_fx.ActiveVocab`'s (first ``num_pinned`` insertions stay; the
rest is a ring that evicts the oldest), replayed by :class:`nanospec_fx.vocab.ring_model.RingModel`, the plain-Python model
the kernel tests also hold the ops to.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch

from nanospec_fx.vocab.ring_model import RingModel
from nanospec_fx.vocab.config import DEFAULT_CAPACITY


@dataclass
class Request:
    """One request as token ids. ``predicted[j]``: the target's top-k ids for token j (scored at j-1)."""

    category: str
    prompt: list[int]
    continuation: list[int]
    predicted: list[list[int]] | None = None

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.continuation


EVICTIONS = ("fifo", "lru")


class LruSet:
    """The alternative no kernel runs, kept only to measure it (docs/kernels.md "Eviction order"): like
    :class:`~nanospec_fx.vocab.ring_model.RingModel`, but observing an active token again makes it the newest."""

    def __init__(self, capacity: int | None = None, num_pinned: int = 0):
        if capacity is not None and not 0 <= num_pinned < capacity:
            raise ValueError(f"num_pinned must be in [0, capacity), got {num_pinned} for capacity {capacity}")
        self.capacity, self.num_pinned = capacity, num_pinned
        self.pinned: set[int] = set()
        self.ring: OrderedDict[int, None] = OrderedDict()

    def observe(self, ids: Iterable[int]) -> None:
        for t in ids:
            if t in self.pinned:
                continue
            if t in self.ring:
                self.ring.move_to_end(t)
            elif len(self.pinned) < self.num_pinned:
                self.pinned.add(t)
            else:
                self.ring[t] = None
                if self.capacity is not None and len(self.pinned) + len(self.ring) > self.capacity:
                    self.ring.popitem(last=False)  # evict the least recently observed

    def __contains__(self, t: int) -> bool:
        return t in self.pinned or t in self.ring

    def __len__(self) -> int:
        return len(self.pinned) + len(self.ring)

    def __iter__(self):
        yield from self.pinned
        yield from self.ring


def active_set(capacity: int | None = None, num_pinned: int = 0, eviction: str = "fifo") -> RingModel | LruSet:
    """The simulated active set: ActiveVocab's own policy (``"fifo"``, :class:`~nanospec_fx.vocab.ring_model.RingModel`,
    the model the kernel tests hold the ops to) or the measured alternative (``"lru"``, :class:`LruSet`);
    ``capacity=None``: unbounded."""
    if eviction not in EVICTIONS:
        raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
    return RingModel(capacity, num_pinned) if eviction == "fifo" else LruSet(capacity, num_pinned)


@dataclass(frozen=True)
class Policy:
    """Which tokens the drafter's head computes.

    ``family`` names the curve it belongs to (for plots) and ``param`` its knob (N, capacity or core).
    """

    name: str
    family: str
    static: tuple[int, ...] = ()
    context: bool = False
    topk: int = 0
    capacity: int | None = None
    vocab_size: int | None = None
    param: int | None = None
    eviction: str = "fifo"
    prompt_topk: bool = True  # False: the target's top-k at prompt positions is not observed (vLLM: docs/vllm.md)


def full(vocab_size: int) -> Policy:
    return Policy("full", "full", vocab_size=vocab_size, param=vocab_size)


def static(ids: Sequence[int], n: int) -> Policy:
    """FR-Spec: the ``n`` most frequent tokens (``ids`` sorted by frequency)."""
    return Policy(f"static-{n}", "static", static=tuple(ids[:n]), param=n)


def context(capacity: int | None = DEFAULT_CAPACITY, topk: int = 0, eviction: str = "fifo",
            prompt_topk: bool = True) -> Policy:
    """NanoSpec: prompt + committed tokens (+ the target's top-k at verified positions).

    ``eviction="lru"`` (a measured alternative, not what ActiveVocab does) gets its own family, and so does
    ``prompt_topk=False``: the top-k at prompt positions is not observed (what the vLLM plugin sees).
    """
    family = (f"context+top{topk}" if topk else "context") + ("-lru" if eviction == "lru" else "")
    family += "-noprompt" if topk and not prompt_topk else ""
    cap = capacity if capacity else "inf"
    return Policy(f"{family}@{cap}", family, context=True, topk=topk, capacity=capacity or None, param=capacity or None,
                  eviction=eviction, prompt_topk=prompt_topk)


def hybrid(ids: Sequence[int], core: int, capacity: int | None = DEFAULT_CAPACITY, topk: int = 0) -> Policy:
    """A pinned static core of the ``core`` most frequent tokens + the context set."""
    family = f"hybrid+top{topk}" if topk else "hybrid"
    cap = capacity if capacity else "inf"
    return Policy(f"{family}-{core}@{cap}", family, static=tuple(ids[:core]), context=True, topk=topk,
                  capacity=capacity or None, param=core)


@dataclass
class Trace:
    """What one policy did on one request."""

    hits: int
    sizes: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return len(self.sizes)


def simulate(req: Request, policy: Policy, verify_every: int = 1) -> Trace:
    """Replay ``req``: for each continuation token, was it active when it had to be drafted?"""
    if verify_every < 1:
        raise ValueError("verify_every must be >= 1")
    cont = req.continuation
    if policy.family == "full":
        return Trace(len(cont), [policy.vocab_size] * len(cont))
    if not policy.context:
        s = set(policy.static)
        return Trace(sum(t in s for t in cont), [len(s)] * len(cont))
    trace = Trace(0)
    for t, active in replay(req, policy, verify_every):
        trace.hits += req.ids[t] in active
        trace.sizes.append(len(active))
    return trace


def replay(req: Request, policy: Policy, verify_every: int = 1) -> Iterator[tuple[int, RingModel | LruSet]]:
    """The context set of ``policy`` along ``req``: ``(t, active)`` for each continuation position t of ``req.ids``,
    ``active`` as it is when token t has to be drafted (the same object, changed after the next step: read it
    before advancing). Token t is committed (observed) once the consumer asks for the next one."""
    if not policy.context:
        raise ValueError(f"policy {policy.name} has no context set to replay")
    if policy.topk and req.predicted is None:
        raise ValueError(f"policy {policy.name} needs the target's predictions; the request has none")
    pred = req.predicted
    k = policy.topk
    active = active_set(policy.capacity, num_pinned=len(policy.static), eviction=policy.eviction)
    active.observe(policy.static)
    ids, n_prompt = req.ids, len(req.prompt)
    for j in range(n_prompt):  # prefill: the prompt, and the target's top-k at every prompt position
        if k and j and policy.prompt_topk:
            active.observe(pred[j][:k])
        active.observe((ids[j],))
    known = n_prompt - 1  # predictions known for tokens <= known
    for t in range(n_prompt, len(ids)):
        if k and (t - n_prompt) % verify_every == 0:  # a round was verified: its top-k are known now
            for j in range(known + 1, t):
                active.observe(pred[j][:k])
            known = t - 1
        yield t, active
        active.observe((ids[t],))  # committed (and fed to the drafter as an input)


@dataclass
class Result:
    category: str
    policy: str
    family: str
    param: int | None
    coverage: float
    mean_size: float
    p95_size: float
    tokens: int
    requests: int


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sequence."""
    s = sorted(values)
    return float(s[max(0, math.ceil(q / 100 * len(s)) - 1)])


def summarize(category: str, policy: Policy, traces: list[Trace]) -> Result:
    sizes = [s for tr in traces for s in tr.sizes]
    hits, n = sum(tr.hits for tr in traces), len(sizes)
    return Result(category, policy.name, policy.family, policy.param, hits / n if n else float("nan"),
                  sum(sizes) / n if n else float("nan"), percentile(sizes, 95) if n else float("nan"), n, len(traces))


def evaluate(requests: list[Request], policies: list[Policy], verify_every: int = 1, progress=None) -> list[Result]:
    """One :class:`Result` per (category, policy), plus an ``all`` category pooling every token."""
    by_cat: dict[str, list[Request]] = {}
    for r in requests:
        by_cat.setdefault(r.category, []).append(r)
    results = []
    for pol in policies:
        traces = {cat: [simulate(r, pol, verify_every) for r in reqs] for cat, reqs in by_cat.items()}
        results += [summarize(cat, pol, tr) for cat, tr in traces.items()]
        results.append(summarize("all", pol, [t for tr in traces.values() for t in tr]))
        if progress:
            progress(pol)
    return results


@torch.no_grad()
def target_predictions(model: torch.nn.Module, ids: list[int], k: int, chunk: int = 256) -> list[list[int]]:
    """Teacher-forced top-k of a causal LM: ``out[j]`` are its k best guesses for token j (``out[0] == []``).

    The head runs on ``chunk`` positions at a time so a 262k vocabulary never needs [L, V] at once.
    Only the ranking matters, so monotonic post-processing of the logits (soft-capping) is skipped.
    """
    return teacher_forced(model, ids, k, chunk)[0]


@torch.no_grad()
def teacher_forced(model: torch.nn.Module, ids: list[int], k: int, chunk: int = 256
                   ) -> tuple[list[list[int]], torch.Tensor]:
    """:func:`target_predictions` and the final (normed) hidden states ``[len(ids), H]`` the head read."""
    base = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    hidden = base(input_ids=torch.tensor([ids])).last_hidden_state[0]
    out: list[list[int]] = [[]]
    for i in range(0, len(ids) - 1, chunk):
        logits = head(hidden[i: min(i + chunk, len(ids) - 1)])
        out += logits.topk(k, dim=-1).indices.tolist()
    return out, hidden
