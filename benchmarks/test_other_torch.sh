#!/usr/bin/env bash
# Run the test suite (or a part of it) against another torch release in a scratch virtual environment, so a
# widened torch range in pyproject.toml is checked without touching the environment you develop in.
#
#   bash benchmarks/test_other_torch.sh 2.14.1                                  # the whole suite
#   bash benchmarks/test_other_torch.sh 2.14.1 tests/passes/test_find_head.py   # pytest arguments after it
#
# The venv is kept in ${SCRATCH_VENV:-/tmp/nanospec-torch-VERSION} and reused, so the (multi-GB) wheels are
# fetched once. Plain PyPI gives the CUDA build of torch; it runs on a CPU too. The exit status is pytest's.
set -euo pipefail
# A pip constraints file (PIP_CONSTRAINT, or pip's config file) that caps torch would refuse the release asked
# for: the scratch venv ignores it (/dev/null overrides the config file's too; an empty value would not).
# NANOSPEC_PIP_CONSTRAINT=FILE applies one on purpose.
export PIP_CONSTRAINT=${NANOSPEC_PIP_CONSTRAINT:-/dev/null}
if [ $# -lt 1 ]; then
    echo "usage: $0 TORCH_VERSION [pytest arguments...]" >&2
    exit 2
fi
version=$1
shift
cd "$(dirname "$0")/.."
venv=${SCRATCH_VENV:-/tmp/nanospec-torch-$version}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')"; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q "torch==$version"
fi
# The project itself, editable, with the test dependencies; torch stays at $version (the range allows it, and
# a release outside the range is refused here rather than silently replaced).
"$venv/bin/python" -m pip install -q -e ".[dev]" "torch==$version"
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
if [ $# -eq 0 ]; then
    set -- tests
fi
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
