"""Every Triton kernel against the torch reference.

Without a GPU the kernels run in the Triton interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1); with one, the ``cuda`` variants run the same checks on CUDA tensors, plus
no-host-sync, CUDA-graph and torch.compile checks. State and token ids must match exactly;
logits within a per-dtype tolerance of an fp32 oracle; selection exactly.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from nanospec_fx.kernels import ops, reference as R, triton_kernels as T  # noqa: E402
from nanospec_fx.kernels.triton_util import INTERPRET, direct_launch  # noqa: E402
from helpers import run_python  # noqa: E402

NEG = float("-inf")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Kernel (fp32 accumulation, one rounding) vs F.linear in fp32 rounded once: summation order
# and at most ~1 ulp of the output dtype apart.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-4),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the Triton interpreter")),
    pytest.param("cuda", marks=pytest.mark.cuda),
]
SETTINGS = dict(deadline=None, max_examples=25, derandomize=True)


def make_state(vocab, hidden, capacity, dtype, device):
    return [
        torch.full((capacity,), -1, dtype=torch.int64, device=device),
        torch.full((vocab,), -1, dtype=torch.int32, device=device),
        torch.zeros(1, dtype=torch.int64, device=device),
        torch.zeros(capacity, hidden, dtype=dtype, device=device),
        torch.zeros(capacity, dtype=dtype, device=device),
    ]


def run(fn, *args):
    with direct_launch():
        return fn(*args)


def assert_same_state(a, b):
    for name, x, y in zip(("ids", "slot_of", "cursor", "cache_w", "cache_b"), a, b):
        assert torch.equal(x, y), name


# --------------------------------------------------------------------------- observe
@pytest.mark.parametrize("device", DEVICES)
@settings(**SETTINGS)
@given(
    vocab=st.integers(3, 301),
    hidden=st.integers(1, 70),
    capacity=st.integers(1, 64),
    pinned=st.integers(0, 8),
    dtype=st.sampled_from(DTYPES),
    with_bias=st.booleans(),
    int32=st.booleans(),
    calls=st.lists(st.lists(st.integers(-3, 310), max_size=90), min_size=1, max_size=5),
)
def test_observe_matches_reference(device, vocab, hidden, capacity, pinned, dtype, with_bias, int32, calls):
    capacity = min(capacity, vocab)
    pinned = min(pinned, capacity - 1)
    w = torch.randn(vocab, hidden, device=device).to(dtype)
    b = torch.randn(vocab, device=device).to(dtype) if with_bias else None
    got, want = make_state(vocab, hidden, capacity, dtype, device), make_state(vocab, hidden, capacity, dtype, device)
    for tokens in calls:  # duplicates, out-of-range, empty calls, overflow of the ring
        t = torch.tensor(tokens, dtype=torch.int32 if int32 else torch.int64, device=device)
        run(T.observe, t, w, b, *got, pinned)
        R.observe(t, w, b, *want, pinned)
        assert_same_state(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_observe_many_duplicates_across_blocks(device):
    """More ids than one block: the first occurrence still wins across blocks."""
    vocab, hidden, capacity = 97, 5, 40
    w = torch.randn(vocab, hidden, device=device)
    t = torch.randint(0, vocab, (1100,), generator=torch.Generator().manual_seed(1)).to(device)
    got, want = (
        make_state(vocab, hidden, capacity, torch.float32, device),
        make_state(vocab, hidden, capacity, torch.float32, device),
    )
    run(T.observe, t, w, None, *got, 3)
    R.observe(t, w, None, *want, 3)
    assert_same_state(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_observe_transposed_weight(device):
    """A tied head [V, H] seen through ``embedding.weight.t().t()``-style strides."""
    vocab, hidden, capacity = 50, 9, 12
    w = torch.randn(hidden, vocab, device=device).t()  # non-unit stride along H
    t = torch.tensor([4, 9, 4, 49, 0], device=device)
    got, want = (
        make_state(vocab, hidden, capacity, torch.float32, device),
        make_state(vocab, hidden, capacity, torch.float32, device),
    )
    run(T.observe, t, w, None, *got, 0)
    R.observe(t, w, None, *want, 0)
    assert_same_state(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("axes", [(1, 0, 2), (2, 0, 1)])
def test_observe_stacked_weight(device, axes):
    """K heads stacked in one weight (``ActiveVocab(stacked=...)``): ``weight`` is its [V, K, H] view, the cache
    [C, K, H]; each token's K rows are copied (one launch per head), as the reference and the host path do."""
    vocab, heads, hidden, capacity = 50, 3, 9, 12
    stored = torch.randn(*[(vocab, heads, hidden)[axes.index(d)] for d in range(3)], device=device)
    w = stored.permute(*axes)  # [V, K, H], strided
    t = torch.tensor([4, 9, 4, 49, 0, 17], device=device)

    def state():
        s = make_state(vocab, hidden, capacity, torch.float32, device)
        s[3] = torch.zeros(capacity, heads, hidden, device=device)
        return s

    got, want, host = state(), state(), state()
    run(T.observe, t, w, None, *got, 1)
    R.observe(t, w, None, *want, 1)
    assert_same_state(got, want)
    assert torch.equal(want[3][want[1][9].long()], w[9])  # token 9's K rows, in its slot
    if device == "cpu":
        from nanospec_fx.kernels import host as HOST
        HOST.observe(t, w, None, *host, 1)
        assert_same_state(host, want)


# --------------------------------------------------------------------------- head
def filled_state(vocab, hidden, capacity, n_tokens, dtype, device, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(vocab, generator=g).to(device=device, dtype=dtype) if with_bias else None
    s = make_state(vocab, hidden, capacity, dtype, device)
    R.observe(torch.randint(0, vocab, (n_tokens,), generator=g).to(device), w, b, *s, 0)
    return w, b, s


@pytest.mark.parametrize("device", DEVICES)
@settings(**SETTINGS)
@given(
    vocab=st.integers(2, 300),
    hidden=st.integers(1, 64),
    capacity=st.integers(1, 64),
    n_tokens=st.integers(0, 200),  # empty, partly full, full, overflowing
    rows=st.sampled_from([(), (1,), (3,), (2, 5), (17,)]),
    dtype=st.sampled_from(DTYPES),
    with_bias=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_head_kernels_match_reference(device, vocab, hidden, capacity, n_tokens, rows, dtype, with_bias, seed):
    capacity = min(capacity, vocab)
    w, b, (ids, slot_of, cursor, cache_w, cache_b) = filled_state(
        vocab, hidden, capacity, n_tokens, dtype, device, with_bias, seed
    )
    cb = cache_b if with_bias else None
    x = torch.randn(*rows, hidden, generator=torch.Generator().manual_seed(seed + 1)).to(device=device, dtype=dtype)

    compact = run(T.compact_logits, x, cache_w, cb, cursor)
    want = R.compact_logits(x, cache_w, cb, cursor)
    assert compact.shape == want.shape and compact.dtype == dtype
    assert torch.equal(torch.isneginf(compact), torch.isneginf(want))
    oracle = F.linear(x.float(), cache_w.float(), cb.float() if cb is not None else None).to(dtype)
    live = ~torch.isneginf(want)
    torch.testing.assert_close(compact[live], oracle[live], **TOL[dtype])

    full = run(T.scatter_logits, compact, ids, cursor, vocab)
    assert torch.equal(full, R.scatter_logits(compact, ids, cursor, vocab))  # data movement: exact
    head = run(T.head_logits, x, cache_w, cb, ids, cursor, vocab)
    assert torch.equal(head, full)  # same arithmetic as compact_logits, scattered in place


def test_head_kernel_skips_tiles_past_the_count():
    """Cache rows past the count are never read: garbage there (NaN) cannot leak."""
    if not INTERPRET:
        pytest.skip("CPU variant")
    w, b, (ids, slot_of, cursor, cache_w, cache_b) = filled_state(200, 16, 64, 10, torch.float32, "cpu", True, 0)
    n = int(cursor)
    cache_w[n:] = float("nan")
    cache_b[n:] = float("nan")
    compact = run(T.compact_logits, torch.randn(2, 16), cache_w, cache_b, cursor)
    assert not compact.isnan().any()
    assert (compact[:, n:] == NEG).all()


# --------------------------------------------------------------------------- selection
@pytest.mark.parametrize("device", DEVICES)
@settings(**SETTINGS)
@given(
    vocab=st.integers(2, 300),
    capacity=st.integers(1, 64),
    n_tokens=st.integers(0, 100),
    rows=st.sampled_from([(), (1,), (3,), (2, 3)]),
    k=st.integers(0, 12),
    largest=st.booleans(),
    levels=st.integers(1, 5),
    specials=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 1000),
)
def test_topk_and_argmax_match_reference(
    device, vocab, capacity, n_tokens, rows, k, largest, levels, specials, dtype, seed
):
    capacity = min(capacity, vocab)
    _, _, (ids, _, cursor, _, _) = filled_state(vocab, 1, capacity, n_tokens, torch.float32, device, False, seed)
    g = torch.Generator().manual_seed(seed)
    compact = torch.randint(0, levels, (*rows, capacity), generator=g).float()  # many ties
    if specials:
        pick = torch.randint(0, 6, compact.shape, generator=g)
        for code, value in ((0, float("nan")), (1, NEG), (2, float("inf")), (3, -0.0)):
            compact = torch.where(pick == code, torch.tensor(value), compact)
    compact = compact.to(device=device, dtype=dtype)
    k = min(k, vocab)  # past the capacity: padding
    vals, toks = run(T.compact_topk, compact, ids, cursor, k, largest)
    want_vals, want_toks = R.compact_topk(compact, ids, cursor, k, largest)
    assert vals.dtype == dtype and toks.dtype == torch.int64
    assert torch.equal(toks, want_toks)
    torch.testing.assert_close(vals, want_vals, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(run(T.compact_argmax, compact, ids, cursor), R.compact_argmax(compact, ids, cursor))


# --------------------------------------------------------------------------- the switch
@pytest.mark.parametrize("device", DEVICES)
def test_custom_ops_route_to_triton_when_asked(device, monkeypatch, use_kernels):
    use_kernels("triton")
    called = []
    for name in ("observe", "compact_logits", "scatter_logits", "head_logits", "compact_topk", "compact_argmax"):
        real = getattr(T, name)
        monkeypatch.setattr(T, name, lambda *a, _real=real, _name=name: called.append(_name) or _real(*a))
    vocab, hidden, capacity = 40, 8, 16
    w = torch.randn(vocab, hidden, device=device)
    s = make_state(vocab, hidden, capacity, torch.float32, device)
    r = make_state(vocab, hidden, capacity, torch.float32, device)
    t = torch.tensor([3, 7, 3, 39, 12], device=device)
    torch.ops.nanospec.observe(t, w, None, *s, 0)
    R.observe(t, w, None, *r, 0)
    assert_same_state(s, r)
    x = torch.randn(3, hidden, device=device)
    c = torch.ops.nanospec.compact_logits(x, s[3], None, s[2])
    torch.testing.assert_close(c, R.compact_logits(x, r[3], None, r[2]), **TOL[torch.float32])
    full = torch.ops.nanospec.scatter_logits(c, s[0], s[2], vocab)
    assert torch.equal(full, torch.ops.nanospec.head_logits(x, s[3], None, s[0], s[2], vocab))
    v, i = torch.ops.nanospec.compact_topk(c, s[0], s[2], 2)
    assert torch.equal(i[:, 0], torch.ops.nanospec.compact_argmax(c, s[0], s[2]))
    assert called == ["observe", "compact_logits", "scatter_logits", "head_logits", "compact_topk", "compact_argmax"]


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch, use_kernels):
    use_kernels("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from nanospec_fx.kernels.dispatch import implementation_for

    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        implementation_for("compact_logits", torch.zeros(1))


_UNSET = ("TRITON_INTERPRET", "NANOSPEC_KERNELS")  # the fresh process picks its kernels itself


def test_kernels_compile_for_sm90():
    """A real GPU compile (ptxas included in the triton wheel) of every kernel variant."""
    proc = run_python(None, "-m", "nanospec_fx.kernels.compile_check", "--arch", "90", unset=_UNSET, timeout=300,
                      env={"TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}, check=False)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("no ptxas in this triton install")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled" in proc.stdout


_TRITON_OP_SCRIPT = r"""
import torch
from nanospec_fx.kernels import ops, reference as R
assert ops.USES_TRITON_OP
V, H, C = 50, 8, 12
w, b = torch.randn(V, H), torch.randn(V)
def state():
    return [torch.full((C,), -1, dtype=torch.int64), torch.full((V,), -1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int64), torch.zeros(C, H), torch.zeros(C)]
def step(tok, x, s):
    torch.ops.nanospec.observe(tok, w, b, *s, 2)
    c = torch.ops.nanospec.compact_logits(x, s[3], s[4], s[2])
    full = torch.ops.nanospec.scatter_logits(torch.tanh(c), s[0], s[2], V)
    head = torch.ops.nanospec.head_logits(x, s[3], s[4], s[0], s[2], V)
    v, t = torch.ops.nanospec.compact_topk(c, s[0], s[2], 3)
    return full, head, v, t, torch.ops.nanospec.compact_argmax(c, s[0], s[2])
compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
a, r = state(), state()
for i in range(3):
    tok, x = torch.randint(0, V, (7,)), torch.randn(4, H)
    got, want = compiled(tok, x, a), step(tok, x, r)
    assert all(torch.equal(p, q) for p, q in zip(a, r))
    for p, q in zip(got, want):
        torch.testing.assert_close(p, q)
print("ok")
"""


@pytest.mark.slow
def test_triton_op_registration_traces():
    """The CUDA-machine registration (triton_op), forced on CPU: schemas, fake impls and the
    functional decomposition under torch.compile work (CPU tensors take the reference branch)."""
    proc = run_python(_TRITON_OP_SCRIPT, env={"NANOSPEC_TRITON_OP": "force", "TRITON_INTERPRET": "0"}, unset=_UNSET,
                      timeout=300)
    assert "ok" in proc.stdout, proc.stderr[-3000:]


# --------------------------------------------------------------------------- CUDA only
def _cuda_case(vocab=1000, hidden=64, capacity=256, rows=3):
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
    s = make_state(vocab, hidden, capacity, torch.bfloat16, "cuda")
    return w, s, torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)


def _step(tok, x, w, s, vocab):
    torch.ops.nanospec.observe(tok, w, None, *s, 0)
    c = torch.ops.nanospec.compact_logits(x, s[3], None, s[2])
    v, t = torch.ops.nanospec.compact_topk(c, s[0], s[2], 4)
    return torch.ops.nanospec.scatter_logits(c, s[0], s[2], vocab), v, t


@pytest.mark.cuda
def test_cuda_step_has_no_host_sync(use_kernels):
    use_kernels("triton")
    w, s, x = _cuda_case()
    tok = torch.randint(0, 1000, (64,), device="cuda")
    _step(tok, x, w, s, 1000)  # compile the kernels first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _step(tok + 1, x, w, s, 1000)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
def test_cuda_graph_replay_matches_eager(use_kernels):
    use_kernels("triton")
    w, s, x = _cuda_case()
    r = [t.clone() for t in s]
    tok = torch.zeros(32, dtype=torch.int64, device="cuda")
    _step(tok, x, w, s, 1000)
    R.observe(tok, w, None, *r, 0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(tok, x, w, s, 1000)
    gen = torch.Generator().manual_seed(0)
    capacity = s[0].numel()
    for i in range(40):  # 40 x 32 random ids of 1000: the 256-slot ring fills and wraps several times
        tok.copy_(torch.randint(0, 1000, (32,), generator=gen))
        graph.replay()
        R.observe(tok, w, None, *r, 0)
        assert_same_state(s, r)
        full = R.scatter_logits(R.compact_logits(x, r[3], None, r[2]), r[0], r[2], 1000)
        assert torch.equal(torch.isneginf(out[0]), torch.isneginf(full))
        torch.testing.assert_close(out[0][~torch.isneginf(full)], full[~torch.isneginf(full)], **TOL[torch.bfloat16])
    assert int(s[2]) > 2 * capacity, "the ring never wrapped"


@pytest.mark.cuda
def test_cuda_inductor_sees_the_kernels(use_kernels):
    use_kernels("triton")
    from torch._inductor.utils import run_and_get_code

    w, s, x = _cuda_case()
    r = [t.clone() for t in s]
    tok = torch.randint(0, 1000, (40,), device="cuda")
    compiled = torch.compile(lambda tok, x: _step(tok, x, w, s, 1000), fullgraph=True)
    got, codes = run_and_get_code(compiled, tok, x)
    want = _step(tok, x, w, r, 1000)
    assert_same_state(s, r)
    assert torch.equal(got[2], want[2])
    if ops.USES_TRITON_OP:
        assert any("_head_kernel" in c for c in codes), "inductor did not inline the Triton head kernel"
