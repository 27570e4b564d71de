#!/usr/bin/env bash
# GPU check of the nanospec kernels, for a bare CUDA machine (no network assumed):
#   1. make the package importable (pip --no-deps editable install, else a symlink tree);
#   2. run the kernel tests on CUDA (pytest -m cuda tests/kernels/test_kernels.py);
#   3. run benchmarks/gpu_bench.py at Llama-3-8B head shape (bf16) with a head-config sweep.
# Logs and results go to benchmarks/results/ and, when set, to $OUT. Budget: < 8 minutes.
#   bash benchmarks/gpu_check.sh
# GPU_CHECK_CPU=1 rehearses the script on a CPU machine (interpreter tests, --device cpu --small).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
RES="$ROOT/benchmarks/results"
mkdir -p "$RES"
LOG="$RES/gpu_check.log"
: >"$LOG"
PY=${PYTHON:-python3}
export TRITON_DEFAULT_FP_FUSION=1
CPU=${GPU_CHECK_CPU:-0}
if [ "$CPU" = 1 ]; then
    export TRITON_INTERPRET=1 NANOSPEC_KERNELS=triton
    CUDA_ASSERT="" MARK="not cuda" BENCH_ARGS="--device cpu --small"
else
    unset TRITON_INTERPRET
    CUDA_ASSERT="assert torch.cuda.is_available(); print(torch.cuda.get_device_name())" MARK="cuda" BENCH_ARGS="--sweep"
fi

say() { echo "[gpu_check $(date +%T)] $*" | tee -a "$LOG"; }
finish() {
    if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && cp -r "$RES"/. "$OUT"/ 2>/dev/null; fi
    say "done (status $1)"
    exit "$1"
}

say "python: $($PY --version 2>&1)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG" || true

# 1. torch (with CUDA) and triton must be there; try pip once if not (fails offline).
if ! $PY -c 'import torch' 2>/dev/null; then
    say "torch missing: trying pip install torch"
    $PY -m pip install -q torch >>"$LOG" 2>&1 || { say "cannot install torch (offline?)"; finish 3; }
fi
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__); $CUDA_ASSERT" 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || { say "torch without CUDA or triton"; finish 3; }

# The package: editable install without dependencies, else a symlink tree on PYTHONPATH.
if ! $PY -c 'import nanospec_fx.kernels' 2>/dev/null; then
    if ! $PY -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1; then
        TREE=$(mktemp -d)
        mkdir -p "$TREE/nanospec_fx"
        for f in "$ROOT"/nanospec_fx/*; do ln -s "$f" "$TREE/nanospec_fx/"; done
        ln -s "$ROOT/kernels" "$TREE/nanospec_fx/kernels"
        ln -s "$ROOT/passes" "$TREE/nanospec_fx/passes"
        export PYTHONPATH="$TREE${PYTHONPATH:+:$PYTHONPATH}"
        say "pip install failed; using symlink tree $TREE"
    fi
fi
$PY -c 'import nanospec_fx.kernels.ops as o; print("triton_op registration:", o.USES_TRITON_OP)' 2>&1 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || { say "nanospec_fx.kernels does not import"; finish 4; }

# 2. Kernel tests on CUDA.
status=0
if ! $PY -c 'import pytest, hypothesis' 2>/dev/null; then
    $PY -m pip install -q pytest hypothesis >>"$LOG" 2>&1 || say "pytest/hypothesis unavailable: skipping the tests"
fi
if $PY -c 'import pytest, hypothesis' 2>/dev/null; then
    say "pytest -m '$MARK' tests/kernels/test_kernels.py"
    timeout 300 $PY -m pytest -q -m "$MARK" -p no:cacheprovider --durations=10 tests/kernels/test_kernels.py 2>&1 | tee "$RES/gpu_pytest.log" | tail -40 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    say "pytest exit status $rc"
    [ "$rc" -eq 0 ] || status=1
fi

# 3. Benchmark (also checks zero host syncs and CUDA-graph observe).
say "gpu_bench.py $BENCH_ARGS"
# shellcheck disable=SC2086
timeout 200 $PY benchmarks/gpu_bench.py $BENCH_ARGS 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
say "gpu_bench exit status $rc"
[ "$rc" -eq 0 ] || status=1
finish "$status"
