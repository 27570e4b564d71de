"""Defects that only a GPU would expose, caught on a CPU.

int64 offsets (TTIR of every launched variant), the device guard, the observe launch grid, the
num_pinned check, the one-time contiguous copy of a transposed head, the head configurations,
inductor's mutation analysis of the read-only kernels, the schema every implementation follows,
and a rehearsal of benchmarks/gpu_check.sh that must pass - and fail when a step is broken.
"""
from __future__ import annotations

import inspect
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from nanospec_fx.kernels import host as H, ops, reference as R, schema, triton_kernels as T  # noqa: E402
from nanospec_fx.kernels import triton_head, triton_observe, triton_select, triton_util  # noqa: E402
from nanospec_fx.kernels.triton_util import INTERPRET, direct_launch  # noqa: E402
from helpers import ROOT, run_command, run_python  # noqa: E402

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the Triton interpreter")


# A fresh process that compiles Triton kernels for real (not the interpreter) and picks its kernels itself.
_UNSET = ("TRITON_INTERPRET", "NANOSPEC_KERNELS")
_COMPILED_TRITON = {"TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}


# --------------------------------------------------------------------------- 1. int64 offsets
_BAD_KERNEL = r"""
import triton, triton.language as tl
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from nanospec_fx.kernels.compile_check import int32_argument_products

@triton.jit
def copy_rows(src, out, stride, WIDE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    if WIDE:
        row = row.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    tl.store(out + row * stride + offs, tl.load(src + row * stride + offs))

for wide in (False, True):
    signature = {"src": "*fp32", "out": "*fp32", "stride": "i32", "WIDE": "constexpr", "BLOCK": "constexpr"}
    src = ASTSource(copy_rows, signature, {"WIDE": wide, "BLOCK": 16})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    print(wide, len(int32_argument_products(c.asm["ttir"])))
"""


def test_int32_product_check_flags_a_row_times_stride_in_int32(tmp_path):
    """The TTIR check compile_check applies to every kernel variant can fail: an int32
    ``row * stride`` is flagged, the same product after ``.to(tl.int64)`` is not."""
    script = tmp_path / "bad_kernel.py"  # @triton.jit needs a source file
    script.write_text(_BAD_KERNEL)
    proc = run_python(None, script, env=_COMPILED_TRITON, unset=_UNSET, timeout=300)
    assert proc.stdout.split() == ["False", "1", "True", "0"]


# --------------------------------------------------------------------------- 2. device guard
class _Dev:
    def __init__(self, device):
        self.device = torch.device(device)


def test_device_guard_selects_the_tensors_cuda_device():
    guard = triton_util.device_guard(_Dev("cuda:1"))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert not isinstance(triton_util.device_guard(_Dev("cpu")), torch.cuda.device)


@needs_interpreter
def test_every_wrapper_launches_under_the_device_guard(monkeypatch):
    seen = []

    def guard(t):
        seen.append(t.device)
        return triton_util.device_guard(t)

    for mod in (triton_head, triton_observe, triton_select):
        monkeypatch.setattr(mod, "device_guard", guard)
    launched = []
    vocab, hidden, capacity = 40, 8, 16
    w = torch.randn(vocab, hidden)
    s = schema.new_state(vocab, hidden, capacity, torch.float32, "cpu")
    q = schema.new_request_state(3, vocab, hidden, capacity, torch.float32, "cpu")  # with rows: a per-request state
    rows = torch.tensor([1, 0])
    with direct_launch():
        for name, call in [
            ("observe", lambda: T.observe(torch.tensor([3, 7, 3]), w, None, *s, 0)),
            ("compact_logits", lambda: T.compact_logits(torch.randn(2, hidden), s[3], None, s[2])),
            ("head_logits", lambda: T.head_logits(torch.randn(2, hidden), s[3], None, s[0], s[2], vocab)),
            ("scatter_logits", lambda: T.scatter_logits(torch.randn(2, capacity), s[0], s[2], vocab)),
            ("compact_topk", lambda: T.compact_topk(torch.randn(2, capacity), s[0], s[2], 3)),
            ("rows-observe", lambda: T.observe(torch.tensor([[3, 4], [5, -1]]), w, None, *q, 0, rows)),
            ("rows-compact_logits", lambda: T.compact_logits(torch.randn(2, hidden), q[3], None, q[2], rows)),
            ("rows-head_logits", lambda: T.head_logits(torch.randn(2, hidden), q[3], None, q[0], q[2], vocab, rows)),
            ("rows-scatter_logits", lambda: T.scatter_logits(torch.randn(2, capacity), q[0], q[2], vocab, rows)),
            ("rows-compact_topk", lambda: T.compact_topk(torch.randn(2, capacity), q[0], q[2], 3, True, rows)),
        ]:
            before = len(seen)
            call()
            launched.append((name, len(seen) - before))
    assert all(n >= 1 for _, n in launched), launched
    assert set(seen) == {torch.device("cpu")}


# --------------------------------------------------------------------------- 6. observe grid
@needs_interpreter
def test_observe_grid_depends_on_a_bucket_of_the_length_and_is_2d(monkeypatch):
    grids = []
    real_wrap = triton_observe.wrap_triton

    def recording_wrap(kernel):
        launcher = real_wrap(kernel)

        class _Grid:
            def __getitem__(self, grid):
                grids.append((kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), tuple(grid)))
                return launcher[grid]
        return _Grid()

    monkeypatch.setattr(triton_observe, "wrap_triton", recording_wrap)
    vocab, hidden, capacity = 300, 600, 64
    w = torch.randn(vocab, hidden)
    got, want = (
        schema.new_state(vocab, hidden, capacity, torch.float32, "cpu"),
        schema.new_state(vocab, hidden, capacity, torch.float32, "cpu"),
    )
    with direct_launch():
        for n in (1, 3, 11, 16):
            t = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n))
            T.observe(t, w, None, *got, 2)
            R.observe(t, w, None, *want, 2)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    copies = {g for name, g in grids if "copy" in name}
    assert copies == {(16, -(-hidden // 256))}, grids  # one grid for 1..16 ids; H split over programs
    assert triton_observe.padded_length(17) == 32 and triton_observe.padded_length(0) == 16


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_ids_padded_with_minus_one_to_a_fixed_length_change_nothing(impl):
    """A caller replaying one CUDA graph pads its ids to a fixed length with -1: same state."""
    if impl == "triton" and not INTERPRET:
        pytest.skip("CPU variant")
    fn = R.observe if impl == "reference" else T.observe
    vocab, hidden, capacity = 60, 5, 12
    w = torch.randn(vocab, hidden)
    padded, plain = (schema.new_state(vocab, hidden, capacity, torch.float32, "cpu") for _ in range(2))
    g = torch.Generator().manual_seed(7)
    buf = torch.full((16,), -1, dtype=torch.int64)
    with direct_launch():
        for n in (3, 9, 1, 16, 5):
            t = torch.randint(0, vocab, (n,), generator=g)
            buf.fill_(-1)
            buf[:n] = t
            fn(buf, w, None, *padded, 1)
            fn(t, w, None, *plain, 1)
            for x, y in zip(padded, plain):
                assert torch.equal(x, y)


def test_observe_kernels_do_not_specialise_on_the_length():
    for kernel in (triton_observe._observe_alloc_kernel, triton_observe._observe_copy_kernel):
        names = getattr(kernel, "arg_names", None) or list(inspect.signature(kernel.fn).parameters)
        dns = getattr(kernel, "do_not_specialize", None)
        if dns is None:
            pytest.skip("this triton's interpreter does not keep do_not_specialize")
        assert names.index("n") in dns or "n" in dns


# --------------------------------------------------------------------------- 7. smaller ones
@pytest.mark.parametrize("impl", ["op", "reference", "triton"])
def test_observe_rejects_a_pinned_count_without_a_ring(impl):
    if impl == "triton" and not INTERPRET:
        pytest.skip("CPU variant")
    vocab, hidden, capacity = 20, 4, 8
    w = torch.randn(vocab, hidden)
    s = schema.new_state(vocab, hidden, capacity, torch.float32, "cpu")
    fn = {"op": torch.ops.nanospec.observe, "reference": R.observe, "triton": T.observe}[impl]
    for bad in (capacity, capacity + 1, -1):
        with pytest.raises((ValueError, RuntimeError), match="num_pinned"), direct_launch():
            fn(torch.tensor([1, 2]), w, None, *s, bad)
    assert int(s[2]) == 0  # nothing happened


def test_transposed_head_is_made_contiguous_once():
    storage = torch.randn(6, 50)  # [H, V]: a head stored transposed (or a tied weight seen as .t())
    first = triton_util.contiguous_rows(storage.t())
    assert first.is_contiguous() and torch.equal(first, storage.t())
    assert triton_util.contiguous_rows(storage.t()) is first  # a fresh view of the same storage: no copy
    storage[0, 0] = 123.0  # modified in place: the copy is refreshed
    again = triton_util.contiguous_rows(storage.t())
    assert again is not first and again[0, 0] == 123.0
    w = torch.randn(50, 6)
    assert triton_util.contiguous_rows(w) is w  # already row-major: used as is


@needs_interpreter
@pytest.mark.parametrize("rows", [1, 2, 4, 5])
def test_fp32_head_with_few_rows_skips_the_padded_dot(rows):
    use_dot, block_m, _ = triton_head._tiles(torch.float32, rows, triton_head.head_config())
    assert use_dot == (rows > 4) and (block_m == 16 if use_dot else block_m >= rows)
    g = torch.Generator().manual_seed(rows)
    cache_w, cursor = torch.randn(40, 24, generator=g), torch.tensor([33])
    x = torch.randn(rows, 24, generator=g)
    with direct_launch():
        got = T.compact_logits(x, cache_w, None, cursor)
    want = F.linear(x.double(), cache_w.double()).float()
    torch.testing.assert_close(got[:, :33], want[:, :33], rtol=1e-5, atol=1e-5)
    assert torch.isneginf(got[:, 33:]).all()


@needs_interpreter
@pytest.mark.parametrize("name", list(triton_head.HEAD_CONFIGS))
def test_every_head_configuration_matches_the_reference(name, use_kernels):
    use_kernels(head_config=name)
    g = torch.Generator().manual_seed(0)
    vocab, hidden, capacity = 90, 40, 48
    w = torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)
    s = schema.new_state(vocab, hidden, capacity, torch.bfloat16, "cpu")
    R.observe(torch.randint(0, vocab, (60,), generator=g), w, None, *s, 0)
    x = torch.randn(17, hidden, generator=g).to(torch.bfloat16)
    with direct_launch():
        got = T.head_logits(x, s[3], None, s[0], s[2], vocab)
    want = R.head_logits(x.float(), s[3].float(), None, s[0], s[2], vocab).to(torch.bfloat16)
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)


def test_unknown_head_configuration_is_an_error(use_kernels):
    with pytest.raises(ValueError, match="default"):
        use_kernels(head_config="fastest")


_MUTATION_SCRIPT = r"""
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors
from nanospec_fx.kernels import triton_head as th, triton_select as ts

class Sm90:  # inductor asks the active driver for the target; no GPU here
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)
driver.set_active(Sm90())

x, w, b = torch.randn(4, 64), torch.randn(32, 64), torch.randn(32)
cur, ids, out = torch.zeros(1, dtype=torch.int64), torch.zeros(32, dtype=torch.int64), torch.empty(4, 32)
cases = []
for scatter in (False, True):
    for use_dot in (False, True):
        cases.append((th._head_kernel, dict(x_ptr=x, w_ptr=w, b_ptr=b, cursor_ptr=cur, ids_ptr=ids, out_ptr=out,
            M=4, C=32, H=64, V=100, stride_xm=64, stride_wc=64, stride_om=32, HAS_BIAS=True, SCATTER=scatter,
            UPCAST=False, IEEE=False, USE_DOT=use_dot, BLOCK_M=16 if use_dot else 4, BLOCK_C=32, BLOCK_K=128),
            {"out_ptr"}))
cases.append((th._scatter_kernel, dict(src_ptr=out, ids_ptr=ids, cursor_ptr=cur, out_ptr=torch.empty(4, 100),
    C=32, V=100, stride_sm=32, stride_om=100, stride_ids=0, stride_cursor=0, BLOCK=1024), {"out_ptr"}))
cases.append((ts._topk_kernel, dict(src_ptr=out, ids_ptr=ids, cursor_ptr=cur, val_ptr=torch.empty(4, 3),
    tok_ptr=torch.empty(4, 3, dtype=torch.int64), C=32, K=3, stride_s=32, stride_ids=0, stride_cursor=0,
    LARGEST=True, BLOCK=32), {"val_ptr", "tok_ptr"}))
rows, cw, cb, curs, rids = (torch.tensor([1, 0, 1, 2]), torch.randn(3, 32, 64), torch.randn(3, 32),
                            torch.zeros(3, dtype=torch.int64), torch.zeros(3, 32, dtype=torch.int64))
for scatter in (False, True):  # the per-request head (rows given)
    cases.append((th._head_rows_kernel, dict(x_ptr=x, rows_ptr=rows, w_ptr=cw, b_ptr=cb, cursor_ptr=curs,
        ids_ptr=rids, out_ptr=out, R=3, C=32, H=64, V=100, stride_xm=64, stride_wr=32 * 64, stride_wc=64, stride_br=32,
        stride_ir=32, stride_om=32, HAS_BIAS=True, SCATTER=scatter, BLOCK_C=32, BLOCK_K=64), {"out_ptr"}))
for kernel, kwargs, want in cases:
    acc = identify_accessed_tensors(kernel, kwargs, {})
    got = {d.name for d in acc.read_writes.writes}
    assert got == want, (kernel.fn.__name__, sorted(got))
print("ok", len(cases))
"""


@pytest.mark.slow
def test_inductor_sees_the_read_only_kernels_as_read_only():
    """Inductor's TTIR mutation analysis must find that the head, scatter and top-k kernels write
    only their outputs. When the analysis fails it assumes every argument is written, and the
    compiled graph then clones the [C, H] cache on every step, silently."""
    proc = run_python(_MUTATION_SCRIPT, env=_COMPILED_TRITON, unset=_UNSET, timeout=300)
    assert "ok" in proc.stdout, (proc.stdout + proc.stderr)[-3000:]


# --------------------------------------------------------------------------- schema
@pytest.mark.parametrize("op", schema.OPS)
def test_every_implementation_follows_the_schema(op):
    want = schema.arguments(op)
    impls = [getattr(ops, f"_{op}"), getattr(R, op), getattr(H, op), getattr(T, op)]
    for fn in impls:
        assert tuple(inspect.signature(fn).parameters) == want, (op, fn.__module__)
    registered = getattr(torch.ops.nanospec, op).default._schema
    assert tuple(a.name for a in registered.arguments) == want
    assert {a.name for a in registered.arguments if a.alias_info is not None and a.alias_info.is_write} == set(
        schema.mutated(op)
    )


def test_state_order_is_the_schemas():
    from nanospec_fx import ActiveVocab

    av = ActiveVocab(torch.randn(30, 4), None, capacity=8)
    assert [t.data_ptr() for t in av.tensors()] == [getattr(av, n).data_ptr() for n in schema.STATE]
    assert schema.mutated("observe") == schema.STATE
    for f, t in zip(schema.STATE_FIELDS, schema.new_state(30, 4, 8, torch.float16, "cpu")):
        assert t.dtype == (f.dtype or torch.float16)


# --------------------------------------------------------------------------- 3. the GPU check itself
def _gpu_check(tmp_path, bench_extra="", **env):
    results = tmp_path / "results"
    base = {
        "GPU_CHECK_CPU": "1", "GPU_CHECK_FALLBACK": "1", "GPU_CHECK_RESULTS": str(results),
        "GPU_CHECK_PYTEST_K": "device_guard_selects", "PYTHON": sys.executable,
        "GPU_CHECK_BENCH_ARGS": f"--device cpu --small --iters 1 --warmup 0 --rows 1 --out {results} {bench_extra}",
        "GPU_CHECK_GRAPH_ARGS": "--device cpu --steps 1 --vocab 101 --hidden 8 --shapes 2x3",
        "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    base.update(env)
    proc = run_command(["bash", ROOT / "benchmarks" / "gpu_check.sh"], env=base, unset=_UNSET, cwd=tmp_path,
                       check=False)
    return proc, results


@pytest.mark.slow
@needs_interpreter
def test_gpu_check_rehearsal_passes_through_the_fallback_tree(tmp_path):
    proc, results = _gpu_check(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "symlink tree" in out and "PASS" in out
    assert "PASS per-request step cpu float32 requests=2 k=3" in out  # step 5 ran
    import json

    bench = json.loads((results / "gpu_bench_cpu_small.json").read_text())
    assert bench["checks"] and all(v == "pass" for v in bench["checks"].values())
    assert bench["rows"]["1"]["insertions_per_step"] >= 2  # fresh tokens were inserted


@pytest.mark.slow
@needs_interpreter
def test_gpu_check_fails_loudly_when_steps_break(tmp_path):
    """pytest hidden and the benchmark's logits corrupted: both steps are reported, the later
    steps still run (their results are kept), and the check fails."""
    import json

    fake = tmp_path / "nopytest"
    fake.mkdir()
    (fake / "pytest.py").write_text("raise ImportError('pytest hidden by the test')\n")
    proc, results = _gpu_check(tmp_path, bench_extra="--corrupt --fail-fast", PYTHONPATH=str(fake))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "STEP FAILED: pytest and hypothesis are required" in out and "STEP FAILED: gpu_bench.py failed" in out, out[
        -3000:
    ]
    checks = json.loads((results / "gpu_bench_cpu_small.json").read_text())["checks"]
    assert checks["observe_stress"] == "pass"  # the JSON was written before the failing step
    assert checks["logits_match_dense_rows1"].startswith("FAIL")


def test_gpu_check_runs_nothing_past_its_budget(tmp_path):
    """The whole check's budget (GPU_CHECK_TOTAL_S) bounds every step: with none left, the first command that
    could take time is not run, and the check fails saying so (a device session's time is fixed)."""
    proc, _ = _gpu_check(tmp_path, GPU_CHECK_TOTAL_S="0")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "no time left of the 0s budget: not run:" in out and "torch with CUDA and triton are needed" in out, out


def test_gpu_check_worst_case_fits_a_device_session():
    """On a GPU the defaults bound the whole check at 9 minutes or less (15 of device time, start-up included):
    the budget every step is cut to, read from the script as it runs them."""
    import re

    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    gpu = script.split("else\n    TOTAL=", 1)[1].split("\nfi", 1)[0]
    total = int(re.match(r"\$\{GPU_CHECK_TOTAL_S:-(\d+)\}", gpu).group(1))
    assert total <= 9 * 60
    # every command that can take time goes through the budget: the one `timeout` is limited()'s own
    assert len(re.findall(r"^\s*(?:\w+=\S+ )*timeout ", script, re.M)) == 1


# --------------------------------------------------------------------------- 8. the request axis (rows given)
class NoHostReads(TorchDispatchMode):
    """Fails on any read of tensor data by the host (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("host read of a tensor value: this would sync with a GPU")
        return func(*args, **(kwargs or {}))


@needs_interpreter
def test_the_triton_path_with_rows_never_reads_data_on_the_host(use_kernels):
    """Padding rows (-1) included: the device paths clamp and mask them on the device."""
    use_kernels("triton")
    vocab, hidden, capacity, requests = 29, 8, 7, 3
    w, b = torch.randn(vocab, hidden), torch.randn(vocab)
    state = schema.new_request_state(requests, vocab, hidden, capacity, torch.float32, "cpu")
    ids, _, cursor, cache_w, cache_b = state
    rows = torch.tensor([2, 0, 2, 1, -1])
    with NoHostReads():
        ops.observe(torch.randint(0, vocab, (5, 3)), w, b, *state, 1, rows)
        x = torch.randn(5, hidden)
        compact = ops.compact_logits(x, cache_w, cache_b, cursor, rows)
        ops.head_logits(x, cache_w, cache_b, ids, cursor, vocab, rows)
        ops.scatter_logits(compact, ids, cursor, vocab, rows)
        ops.compact_topk(compact, ids, cursor, 3, True, rows)
        ops.compact_argmax(compact, ids, cursor, rows)
    assert int(cursor.sum()) > 0  # it did observe
    with pytest.raises(AssertionError, match="host read"), NoHostReads():  # the detector works: the host path reads
        H.compact_logits(x, cache_w, cache_b, cursor, rows)


@pytest.mark.cuda
def test_on_a_gpu_the_per_request_path_matches_the_reference_without_syncing(use_kernels):
    """On CUDA tensors (auto -> Triton): equal to the reference on CPU, and no host sync (sync debug mode errors)."""
    from nanospec_fx import RequestVocabs

    vocab, hidden, capacity, requests = 29, 8, 7, 3
    use_kernels("reference", device="cpu")  # the oracle
    use_kernels("auto", device="cuda")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(vocab, hidden, generator=g), torch.randn(vocab, generator=g)
    cpu, gpu = RequestVocabs(w, b, requests, capacity), RequestVocabs(w.cuda(), b.cuda(), requests, capacity)
    for v in (cpu, gpu):
        for rid in "abc":
            v.assign(rid)
    batch, tokens = ["c", "a", "c", "b"], torch.randint(-1, vocab, (4, 5), generator=g)
    x = torch.randn(4, hidden, generator=g)
    cpu.observe_rows(cpu.rows_for(batch), tokens)
    want = cpu.logits(x, cpu.rows_for(batch)), cpu.topk(x, cpu.rows_for(batch), 3)
    rows, tokens, x = gpu.rows_for(batch), tokens.cuda(), x.cuda()  # copies before the check: they may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu.observe_rows(rows, tokens)
        logits, (vals, toks) = gpu.logits(x, rows), gpu.topk(x, rows, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(logits.cpu(), want[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(vals.cpu(), want[1][0], rtol=1e-5, atol=1e-4)
    assert torch.equal(toks.cpu(), want[1][1])
    for name, got, ref in zip(schema.STATE, gpu.tensors(), cpu.tensors()):
        assert torch.equal(got.cpu(), ref), name
