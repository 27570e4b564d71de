"""Test configuration.

Without a GPU, Triton kernels run in the interpreter: TRITON_INTERPRET must be set before
triton (or anything importing it) is imported, hence here, first.
"""
import os
import shutil

if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_configure(config):
    # A NanoSpecWarning in a test is an error unless the test expects it (pytest.warns).
    config.addinivalue_line("filterwarnings", "error::nanospec_fx.backend.NanoSpecWarning")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test starts and ends with no compiled graph cached: no test depends on what an earlier one
    compiled, and a long run never reaches Dynamo's recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
