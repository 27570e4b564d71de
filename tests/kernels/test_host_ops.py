"""The host path (CPU, count read on the host) against the reference, and its cost against |A|.

Outputs must equal the reference's (static [..., C] / [..., V] shapes, -inf past the count, the same
tie rule and padding, the same state after observe); the work must follow the active count.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from nanospec_fx.kernels import dispatch, host as H, reference as R
from nanospec_fx.kernels.schema import new_state

NEG = float("-inf")


def filled_state(vocab, hidden, capacity, n_tokens, seed=0, bias=True, pinned=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g)
    b = torch.randn(vocab, generator=g) if bias else None
    s = new_state(vocab, hidden, capacity, torch.float32, "cpu")
    R.observe(torch.randint(0, vocab, (n_tokens,), generator=g), w, b, *s, pinned)
    return w, b, s


def test_bucket_sizes():
    assert [H.bucket(n, 3072) for n in (0, 1, 16, 17, 100, 1000, 3000, 3072)] == [0, 16, 16, 20, 112, 1024, 3072, 3072]
    assert H.bucket(9, 8) == 8  # never past the capacity
    for n in range(1, 3073):
        b = H.bucket(n, 3072)
        assert n <= b <= max(16, 1.25 * n) and b >= H.bucket(n - 1, 3072)


@pytest.mark.parametrize("n_tokens", [0, 1, 5, 40, 200])  # empty, one, partial, full, wrapped ring
@pytest.mark.parametrize("bias", [False, True])
def test_head_and_scatter_equal_the_reference(n_tokens, bias):
    vocab, hidden, capacity = 64, 8, 24
    w, b, (ids, slot_of, cursor, cache_w, cache_b) = filled_state(vocab, hidden, capacity, n_tokens, bias=bias)
    cb = cache_b if bias else None
    x = torch.randn(2, 3, hidden)
    got, want = H.compact_logits(x, cache_w, cb, cursor), R.compact_logits(x, cache_w, cb, cursor)
    assert got.shape == want.shape == (2, 3, capacity)
    n = min(int(cursor), capacity)
    torch.testing.assert_close(got, want)
    assert (got[..., n:] == NEG).all()
    post = got.clone()
    post[..., n:] = 7.0  # a post-op made the padding finite: scatter must still ignore it
    assert torch.equal(H.scatter_logits(post, ids, cursor, vocab), R.scatter_logits(post, ids, cursor, vocab))
    torch.testing.assert_close(
        H.head_logits(x, cache_w, cb, ids, cursor, vocab), R.head_logits(x, cache_w, cb, ids, cursor, vocab)
    )


@settings(max_examples=40, deadline=None)
@given(
    capacity=st.integers(1, 20),
    n_tokens=st.integers(0, 40),
    rows=st.integers(1, 3),
    levels=st.integers(1, 4),
    k=st.integers(0, 30),
    largest=st.booleans(),
    specials=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_topk_and_argmax_equal_the_reference(capacity, n_tokens, rows, levels, k, largest, specials, seed):
    vocab = 30
    _, _, (ids, _, cursor, _, _) = filled_state(vocab, 1, capacity, n_tokens, seed=seed, bias=False)
    g = torch.Generator().manual_seed(seed)
    compact = torch.randint(0, levels, (rows, capacity), generator=g).float()  # many ties
    if specials:
        pick = torch.randint(0, 5, (rows, capacity), generator=g)
        for code, value in ((0, float("nan")), (1, NEG), (2, float("inf")), (3, -0.0)):
            compact = torch.where(pick == code, torch.tensor(value), compact)
    vals, toks = H.compact_topk(compact, ids, cursor, k, largest)
    ev, et = R.compact_topk(compact, ids, cursor, k, largest)
    assert vals.shape == ev.shape == (rows, k) and toks.dtype == torch.int64
    torch.testing.assert_close(vals, ev, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(toks, et)
    assert torch.equal(H.compact_argmax(compact, ids, cursor), R.compact_argmax(compact, ids, cursor))


@settings(max_examples=40, deadline=None)
@given(
    capacity=st.integers(2, 12),
    pinned=st.integers(0, 11),
    calls=st.lists(st.lists(st.integers(-3, 45), max_size=16), max_size=8),
    int32=st.booleans(),
    transposed=st.booleans(),
)
def test_observe_state_is_identical_to_the_reference(capacity, pinned, calls, int32, transposed):
    vocab, hidden = 40, 3
    pinned = min(pinned, capacity - 1)
    w = torch.randn(hidden, vocab).t() if transposed else torch.randn(vocab, hidden)  # a tied head's view
    b = torch.randn(vocab)
    got = new_state(vocab, hidden, capacity, torch.float32, "cpu")
    want = new_state(vocab, hidden, capacity, torch.float32, "cpu")
    for call in calls:
        t = torch.tensor(call, dtype=torch.int32 if int32 else torch.int64)
        H.observe(t, w, b, *got, pinned)
        R.observe(t, w, b, *want, pinned)
        for a, e in zip(got, want):
            assert torch.equal(a, e)


@pytest.mark.parametrize("n_active", [1, 100, 3000])
def test_head_flops_follow_the_active_count(n_active):
    """The host head multiplies bucket(count) rows, the reference all C (FLOPs counted by torch)."""
    vocab, hidden, capacity, rows = 4096, 16, 3072, 2
    w = torch.randn(vocab, hidden)
    s = new_state(vocab, hidden, capacity, torch.float32, "cpu")
    H.observe(torch.randperm(vocab)[:n_active], w, None, *s, 0)
    x = torch.randn(rows, hidden)
    flops = {}
    for name, impl in (("host", H), ("reference", R)):
        with FlopCounterMode(display=False) as counter:
            impl.compact_logits(x, s[3], None, s[2])
        flops[name] = counter.get_total_flops()
    assert flops == {
        "host": 2 * rows * hidden * H.bucket(n_active, capacity),
        "reference": 2 * rows * hidden * capacity,
    }


def test_dispatch_takes_the_host_path_for_real_cpu_tensors_only(use_kernels):
    use_kernels("auto")
    cpu = torch.zeros(2)
    assert dispatch.implementation_for("compact_logits", cpu) is H.compact_logits
    assert dispatch.path_for("cpu") == "host"
    with FlopCounterMode(display=False):  # any dispatch mode may be tracing: the reference
        assert dispatch.implementation_for("compact_logits", cpu) is R.compact_logits
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(cpu)
    assert dispatch.implementation_for("observe", fake) is R.observe
    use_kernels("reference")
    assert dispatch.implementation_for("compact_logits", cpu) is R.compact_logits
    assert dispatch.path_for("cpu") == "reference"
    use_kernels("host")
    assert dispatch.implementation_for("compact_topk", cpu) is H.compact_topk
    assert dispatch.path_for("meta") == "reference"


def test_compiled_op_calls_run_the_host_path(monkeypatch, use_kernels):
    """Inside a compiled graph the opaque ops run their body on real tensors: the host path."""
    use_kernels("auto")
    called = []
    real = H.compact_logits
    monkeypatch.setattr(H, "compact_logits", lambda *a: called.append(1) or real(*a))
    _, _, (ids, _, cursor, cache_w, _) = filled_state(50, 4, 8, 5, bias=False)
    fn = torch.compile(
        lambda x: torch.ops.nanospec.compact_logits(x, cache_w, None, cursor), backend="eager", fullgraph=True
    )
    x = torch.randn(1, 4)
    torch.testing.assert_close(fn(x), R.compact_logits(x, cache_w, None, cursor))
    assert called


def test_observe_under_inference_mode_bumps_the_state_versions():
    """A decode loop runs under ``torch.inference_mode``, where observe dispatches through its ADInplaceOrView kernel:
    the state ends as in grad mode, every mutated state tensor's version moves (a result saved for backward from the
    old cache is refused, not silently wrong)."""
    from nanospec_fx.kernels import ops  # noqa: F401 - registers the ops

    w = torch.randn(50, 6)
    ids = torch.tensor([3, 7, 7, 41, 12, 3])
    states = [new_state(50, 6, 8, torch.float32, "cpu") for _ in range(2)]
    x = torch.randn(2, 6, requires_grad=True)
    torch.ops.nanospec.observe(torch.tensor([1, 2]), w, None, *states[0], 0)
    torch.ops.nanospec.observe(torch.tensor([1, 2]), w, None, *states[1], 0)
    saved = torch.ops.nanospec.compact_logits(x, states[0][3], None, states[0][2])  # saves the cache for backward
    before = [t._version for t in states[0]]
    with torch.inference_mode():
        torch.ops.nanospec.observe(ids, w, None, *states[0], 0)
    torch.ops.nanospec.observe(ids, w, None, *states[1], 0)
    assert all(torch.equal(a, b) for a, b in zip(*states))
    assert all(t._version > v for t, v in zip(states[0], before))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()
