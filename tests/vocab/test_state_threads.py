"""One state, many threads: concurrent calls of one compiled drafter, or of one state's ``observe``, are serialised
where the state is written. After every round of threads the state is checked against the Python ring model
(nanospec_fx/vocab/ring_model.py): no id lost, calls never interleaved, ``contains`` agreeing with ``token_ids``.

How a round is judged without knowing the order the threads ran in: every call feeds ids never fed before, so no
call renews and the ring's survivors, read from the cursor backwards, give the order of the last insertions. The
only orders the serialised state can come from put each thread's ids in its own order and each call's ids together;
the model replays that order and must end in the state's exact slots, cursor and membership.
"""
from __future__ import annotations

import sys
import threading

import pytest
import torch
import torch.nn as nn

import nanospec_fx
from nanospec_fx.vocab.request_vocab import RequestVocabs
from nanospec_fx.vocab.ring_model import RingModel
from helpers import compile_nanospec

V, H = 640, 8
THREADS, ROUNDS, CALLS, IDS_PER_CALL = 6, 3, 8, 3  # 144 calls, 432 ids per state


class Drafter(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        return self.lm_head(h + torch.tanh(self.body(h)))


@pytest.fixture(autouse=True)
def frequent_thread_switches():
    """Python switches threads every 5 ms by default; every few microseconds here, so that calls overlap in every
    round (a race the locks did not close shows in each run, not one run in many)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def fresh_ids(thread: int, round_: int, call: int) -> list[int]:
    """Ids no other call feeds (distinct across threads, rounds and calls), spread over the vocabulary."""
    base = ((round_ * CALLS + call) * THREADS + thread) * IDS_PER_CALL
    return [(base + i) * 7 % V for i in range(IDS_PER_CALL)]  # 7 is coprime to V: distinct while base < V


def run_threads(work, threads: int = THREADS) -> list[BaseException]:
    """Run ``work(t)`` on ``threads`` threads started together; the exceptions they raised."""
    start, errors = threading.Barrier(threads), []

    def body(t):
        try:
            start.wait()
            work(t)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
    pool = [threading.Thread(target=body, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return errors


def check_against_ring(state, fed: list[list[list[int]]]) -> None:
    """``state`` (an ActiveVocab) is what the ring model makes of some serial order of the calls ``fed[thread]``
    (each thread's calls in its order): that order is read from the state's ring and checked to be one."""
    capacity, pinned = state.capacity, state.num_pinned
    ids, cursor = state.ids.tolist(), int(state.cursor)
    every = [t for calls in fed for call in calls for t in call]
    assert cursor == len(every), f"{len(every) - cursor} of {len(every)} insertions lost"
    model = RingModel(capacity, pinned, vocab_size=V)
    ring = capacity - pinned
    kept_ring = [ids[model.slot(k)] for k in range(max(pinned, cursor - ring), cursor)]  # insertion order
    kept = [t for t in ids[:pinned] if t >= 0] + kept_ring
    assert len(set(kept)) == len(kept) and set(kept) <= set(every), "a slot holds an id twice or one never fed"
    thread_of = {t: (i, c) for i, calls in enumerate(fed) for c, call in enumerate(calls) for t in call}
    pinned_ids, survivors = set(ids[:pinned]), set(kept_ring)
    for i, calls in enumerate(fed):  # each thread: its oldest ids pinned, its newest surviving, in its own order
        own = [t for call in calls for t in call]
        head = [t for t in own if t in pinned_ids]
        tail = [t for t in own if t in survivors]
        assert own[:len(head)] == head and (not tail or own[-len(tail):] == tail), f"thread {i} out of order"
        assert [t for t in kept_ring if thread_of[t][0] == i] == tail, f"thread {i}'s calls reordered"
    runs = [thread_of[t] for t in kept_ring]  # a call's surviving ids sit together: calls never interleaved
    assert len({r for r, _ in _groups(runs)}) == len(_groups(runs)), f"calls interleaved: {runs}"
    evicted = [t for calls in fed for call in calls for t in call if t not in pinned_ids and t not in survivors]
    order = [t for t in ids[:pinned] if t >= 0] + evicted + kept_ring
    for t in order:
        model.observe([t])
    assert ids == model.ids and cursor == model.cursor
    listed = state.token_ids().tolist()
    assert sorted(listed) == sorted(model), "token_ids() disagrees with the ring"
    holds = state.contains(torch.arange(V))
    assert holds.nonzero().flatten().tolist() == sorted(model), "contains() disagrees with token_ids()"
    slot_of = state.slot_of.tolist()
    assert all(slot_of[t] == model.slot_of.get(t, -1) for t in range(V)), "slot map and ring disagree"


def _groups(runs: list) -> list:
    """``runs`` with consecutive repeats merged."""
    out = []
    for r in runs:
        if not out or out[-1][0] != r:
            out.append((r, 0))
    return out


@pytest.mark.parametrize("capacity,num_pinned", [(V, 0), (40, 0), (29, 5)], ids=["no-eviction", "ring", "pinned"])
def test_one_compiled_drafter_called_from_threads(capacity, num_pinned):
    model = Drafter().eval()
    compiled = compile_nanospec(model, capacity=capacity, num_pinned=num_pinned)
    with torch.no_grad():
        compiled(torch.tensor([[fresh_ids(0, ROUNDS, 0)[0]]]))  # compiled before the threads start
    state = nanospec_fx.active_vocab(model)
    state.reset()
    fed = [[] for _ in range(THREADS)]
    for round_ in range(ROUNDS):
        def work(t):
            for c in range(CALLS):
                call = fresh_ids(t, round_, c)
                with torch.no_grad():
                    out = compiled(torch.tensor([call]))
                fed[t].append(call)
                if capacity >= V:  # nothing is evicted: a thread's own ids are active in its own output
                    assert torch.isfinite(out[0, :, call]).all(), f"thread {t}: its own ids inactive"
        assert run_threads(work) == []
        check_against_ring(state, fed)


@pytest.mark.parametrize("capacity", [V, 37])
def test_one_state_observed_from_threads(capacity):
    state = nanospec_fx.ActiveVocab(torch.randn(V, H), capacity=capacity)
    fed = [[] for _ in range(THREADS)]
    for round_ in range(ROUNDS):
        def work(t):
            for c in range(CALLS):
                call = fresh_ids(t, round_, c)
                state.observe(call)
                fed[t].append(call)
                assert state.contains(call).all() or capacity < V, f"thread {t}: its own ids inactive"
        assert run_threads(work) == []
        check_against_ring(state, fed)
    weight_rows = state.weight[state.ids.clamp(min=0)]
    assert torch.equal(state.cache_w[: len(state)], weight_rows[: len(state)]), "a slot caches another id's row"


def test_request_vocabs_rows_taken_and_fed_from_threads():
    """Each thread its own request: assign, observe and release race on one set of tensors; each request's set is
    exactly its own ring model's."""
    vocabs = RequestVocabs(torch.randn(V, H), max_requests=THREADS, capacity=16)
    for round_ in range(ROUNDS):
        models = [RingModel(vocabs.capacity, vocab_size=V) for _ in range(THREADS)]

        def work(t):
            vocabs.assign(("request", t))
            for c in range(CALLS):
                call = fresh_ids(t, round_, c)
                vocabs.observe(("request", t), call)
                models[t].observe(call)
        assert run_threads(work) == []
        assert sorted(vocabs._row_of.values()) == list(range(THREADS)), "two requests got one row"
        for t, model in enumerate(models):
            rid = ("request", t)
            assert vocabs.ids[vocabs.row_of(rid)].tolist() == model.ids
            assert sorted(vocabs.token_ids(rid).tolist()) == sorted(model)
            assert vocabs.contains(rid, torch.arange(V)).nonzero().flatten().tolist() == sorted(model)
        assert run_threads(lambda t: vocabs.release(("request", t))) == []
        assert vocabs.free_rows == THREADS
