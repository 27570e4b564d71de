#!/usr/bin/env bash
# GPU check of the nanospec kernels, for a bare CUDA machine (no network assumed). Every step
# must pass; anything missing or failing ends the script with a non-zero status and says why.
#   1. torch with CUDA and triton; the package importable (pip --no-deps editable install, else a
#      symlink tree on PYTHONPATH with PYTHONSAFEPATH=1, so the checkout itself never shadows it);
#   2. compile_check: every launched kernel variant compiles for this GPU's arch, int64 offsets;
#   3. the kernel tests on CUDA (pytest -m cuda; needs pytest + hypothesis: installed or an error);
#   4. benchmarks/gpu_bench.py: observe stress vs the reference, Llama-3-8B head shape in bf16 for
#      every head configuration, observe timing with 0/2/16 new ids, zero host syncs, CUDA graphs;
#   5. benchmarks/gpu_graph_per_request.py: a per-request draft step (observe_rows + logits + argmax of
#      RequestVocabs) captured in a CUDA graph, replayed with new request rows, ids and hidden states, equal
#      to eager and to a plain-torch oracle; 1 row per request and B*K rows (parallel drafters); the same for
#      vLLM Model Runner V2's head (CompactLMHead reading its rows from a slot buffer, padded slots included).
# Logs and JSON (written after every step) go to benchmarks/results/ and, when set, to $OUT.
# Budget: the whole check ends within GPU_CHECK_TOTAL_S (default 500 s, 8 min 20 s; a session's device time is
# 15 min, start-up included): every command that can take time runs under `timeout` with the smaller of its step's
# limit and what is left of that budget (a step with nothing left is skipped and fails the check). Step limits
# (seconds, knobs GPU_CHECK_*_S): compile 90, pytest 120, bench 170, graph 80 (460 in all), pip 60 per install,
# import checks 60; typical 4-7 minutes. The CPU rehearsal: 900 s in all, pytest 210, bench 240, graph 150.
#   bash benchmarks/gpu_check.sh
# Rehearsal on a CPU machine (interpreter, tiny shapes):
#   GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh
# Knobs: PYTHON (interpreter), GPU_CHECK_FALLBACK=1 (skip pip, use the symlink tree), GPU_CHECK_GRAPH_ARGS,
#   GPU_CHECK_PYTEST_K (pytest -k selection), GPU_CHECK_BENCH_ARGS (replaces the benchmark's arguments).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
RES=${GPU_CHECK_RESULTS:-"$ROOT/benchmarks/results"}
mkdir -p "$RES"
LOG="$RES/gpu_check.log"
: >"$LOG"
PY=${PYTHON:-python3}
export TRITON_DEFAULT_FP_FUSION=1
CPU=${GPU_CHECK_CPU:-0}
if [ "$CPU" = 1 ]; then
    export TRITON_INTERPRET=1 NANOSPEC_KERNELS=triton
    CUDA_ASSERT="" MARK="not cuda" BENCH_ARGS=${GPU_CHECK_BENCH_ARGS:-"--device cpu --small"}
    GRAPH_ARGS=${GPU_CHECK_GRAPH_ARGS:-"--device cpu --steps 1 --vocab 501 --hidden 16 --shapes 2x3"}
else
    unset TRITON_INTERPRET
    CUDA_ASSERT="assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
    MARK="cuda" BENCH_ARGS=${GPU_CHECK_BENCH_ARGS:-"--sweep"}
    GRAPH_ARGS=${GPU_CHECK_GRAPH_ARGS:-""}
fi

say() { echo "[gpu_check $(date +%T)] $*" | tee -a "$LOG"; }
# The whole check's budget, from the script's start (bash's SECONDS), and each step's limit. The CPU rehearsal
# runs the Triton interpreter on a shared machine: it keeps the longer limits it has always had (no device time).
if [ "$CPU" = 1 ]; then
    TOTAL=${GPU_CHECK_TOTAL_S:-900} COMPILE_S=0 PYTEST_S=${GPU_CHECK_PYTEST_S:-210}
    BENCH_S=${GPU_CHECK_BENCH_S:-240} GRAPH_S=${GPU_CHECK_GRAPH_S:-150}
else
    TOTAL=${GPU_CHECK_TOTAL_S:-500} COMPILE_S=${GPU_CHECK_COMPILE_S:-90} PYTEST_S=${GPU_CHECK_PYTEST_S:-120}
    BENCH_S=${GPU_CHECK_BENCH_S:-170} GRAPH_S=${GPU_CHECK_GRAPH_S:-80}
fi
# limited CAP CMD...: CMD under `timeout` of min(CAP, seconds left of TOTAL); status 124 (a timeout) without
# running it when nothing is left.
limited() {
    local cap=$1 left=$((TOTAL - SECONDS))
    shift
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -le 0 ]; then
        say "no time left of the ${TOTAL}s budget: not run: $*"
        return 124
    fi
    timeout "$cap" "$@"
}
# Only this check's own files go to $OUT (the device tool brings back at most 8).
copy_out() {
    [ -n "${OUT:-}" ] || return 0
    mkdir -p "$OUT"
    for f in gpu_check.log compile_check.log gpu_pytest.log gpu_pytest.xml; do
        [ -f "$RES/$f" ] && cp "$RES/$f" "$OUT/"
    done
    return 0
}
FAILED=()
# A failed step that later steps do not depend on: recorded, the check goes on, the end fails.
fail_step() { say "STEP FAILED: $1"; FAILED+=("$1"); copy_out; }
finish() {
    copy_out
    if [ "$1" -eq 0 ]; then say "PASS"; else say "FAIL (status $1): $2"; fi
    exit "$1"
}

say "python: $($PY --version 2>&1)"
if [ "$CPU" != 1 ]; then
    limited 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
fi

# 1. torch (with CUDA) and triton.
limited 60 $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__); $CUDA_ASSERT" 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || finish 3 "torch with CUDA and triton are needed (install the CUDA build of torch first)"

# The package: an editable install without dependencies (the license field needs setuptools >= 77),
# else a symlink tree. Either way, the import must come from there, never from the checkout's
# nanospec_fx/ directory (which lacks kernels/ and passes/): PYTHONSAFEPATH=1 keeps the working
# directory off sys.path.
export PYTHONSAFEPATH=1
install_editable() {
    [ "${GPU_CHECK_FALLBACK:-0}" = 1 ] && return 1
    if ! $PY -c 'import sys, setuptools; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null; then
        say "setuptools < 77 (too old for the license field): trying pip install 'setuptools>=77'"
        limited 60 $PY -m pip install -q 'setuptools>=77' >>"$LOG" 2>&1 || return 1
    fi
    limited 60 $PY -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1
}
if [ "${GPU_CHECK_FALLBACK:-0}" = 1 ] || ! limited 60 $PY -c 'import nanospec_fx.kernels.ops' >/dev/null 2>&1; then
    if install_editable; then
        say "editable install done"
    else
        TREE=$(mktemp -d)
        mkdir -p "$TREE/nanospec_fx"
        for f in "$ROOT"/nanospec_fx/*; do
            case "$(basename "$f")" in kernels|passes) ;; *) ln -s "$f" "$TREE/nanospec_fx/" ;; esac
        done
        ln -sfn "$ROOT/kernels" "$TREE/nanospec_fx/kernels"
        ln -sfn "$ROOT/passes" "$TREE/nanospec_fx/passes"
        export PYTHONPATH="$TREE${PYTHONPATH:+:$PYTHONPATH}"
        say "no editable install; using the symlink tree $TREE"
    fi
fi
# The import must work, include the Triton kernels, and (with the tree) come from the tree.
limited 60 $PY -c '
import sys, nanospec_fx, nanospec_fx.kernels.ops as o, nanospec_fx.kernels.triton_kernels
print("nanospec_fx from", nanospec_fx.__file__, "| kernels from", o.__file__, "| triton_op registration:", o.USES_TRITON_OP)
assert nanospec_fx.__file__.startswith(sys.argv[1]), "not imported from " + sys.argv[1]' "${TREE:-/}" 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || finish 4 "nanospec_fx.kernels (with its Triton kernels) does not import, or not from the symlink tree"

# 2. Every launched kernel variant compiles for this GPU (and keeps int64 offsets).
if [ "$CPU" != 1 ]; then
    ARCH=$(limited 30 $PY -c 'import torch; a, b = torch.cuda.get_device_capability(); print(a * 10 + b)')
    say "compile_check --arch $ARCH"
    TRITON_INTERPRET=0 limited "$COMPILE_S" $PY -m nanospec_fx.kernels.compile_check --arch "$ARCH" >"$RES/compile_check.log" 2>&1
    rc=$?
    tail -20 "$RES/compile_check.log" | tee -a "$LOG"
    [ "$rc" -eq 0 ] || fail_step "compile_check (status $rc, see compile_check.log)"
fi

# 3. Kernel tests: pytest and hypothesis are required (a skipped test suite is a failure).
if ! limited 60 $PY -c 'import pytest, hypothesis' >/dev/null 2>&1; then
    say "pytest/hypothesis missing: trying pip install pytest hypothesis"
    limited 60 $PY -m pip install -q pytest hypothesis >>"$LOG" 2>&1
    if [ -n "${GPU_CHECK_WHEELS:-}" ]; then  # offline: wheels carried to the machine
        limited 60 $PY -m pip install -q --no-index --find-links "$GPU_CHECK_WHEELS" pytest hypothesis >>"$LOG" 2>&1
    fi
fi
if ! limited 60 $PY -c 'import pytest, hypothesis' >/dev/null 2>&1; then
    fail_step "pytest and hypothesis are required for the kernel tests and could not be installed (carry wheels: GPU_CHECK_WHEELS=dir)"
else
K=${GPU_CHECK_PYTEST_K:-}
say "pytest -m '$MARK' ${K:+-k '$K' }tests/kernels/test_kernels.py tests/kernels/test_gpu_defects_caught_on_cpu.py"
limited "$PYTEST_S" $PY -m pytest -q -m "$MARK" ${K:+-k "$K"} -p no:cacheprovider --durations=10 --junitxml="$RES/gpu_pytest.xml" \
    tests/kernels/test_kernels.py tests/kernels/test_gpu_defects_caught_on_cpu.py >"$RES/gpu_pytest.log" 2>&1
rc=$?
tail -30 "$RES/gpu_pytest.log" | tee -a "$LOG"
# Pass = exit 0, at least one test run, and (on CUDA) nothing skipped.
limited 30 $PY - "$RES/gpu_pytest.xml" "$CPU" <<'EOF' 2>&1 | tee -a "$LOG"
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
n, skipped = int(suite.get("tests")), int(suite.get("skipped"))
bad = int(suite.get("failures")) + int(suite.get("errors"))
print(f"pytest: {n} tests, {bad} failed, {skipped} skipped")
sys.exit(1 if n - skipped == 0 or bad or (sys.argv[2] != "1" and skipped) else 0)
EOF
counts=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] && [ "$counts" -eq 0 ] || fail_step "kernel tests failed, errored, were skipped or none ran (see gpu_pytest.log)"
copy_out
fi

# 4. Benchmark + checks (its JSON is rewritten after every step, so a timeout keeps what ran).
say "gpu_bench.py $BENCH_ARGS"
# shellcheck disable=SC2086
limited "$BENCH_S" $PY benchmarks/gpu_bench.py $BENCH_ARGS 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || fail_step "gpu_bench.py failed (a check failed, it crashed or it timed out)"

# 5. The per-request draft step under CUDA-graph capture and replay.
say "gpu_graph_per_request.py $GRAPH_ARGS"
# shellcheck disable=SC2086
limited "$GRAPH_S" $PY benchmarks/gpu_graph_per_request.py $GRAPH_ARGS 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || fail_step "gpu_graph_per_request.py failed (a check failed, it crashed or it timed out)"
[ "${#FAILED[@]}" -eq 0 ] || finish 1 "$(printf '%s; ' "${FAILED[@]}")"
finish 0 ""
