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

# Under pytest-xdist (`-n auto`) the cores are shared by the workers: one worker per core, one thread each, so the
# workers' OpenMP threads do not oversubscribe the cores (spinning threads on a shared core slow down every test).
# Processes a test starts (examples, gloo ranks) inherit one thread per worker too.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = max(1, min(2, os.cpu_count() or 1) // _WORKERS)
torch.set_num_threads(_THREADS)
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

try:  # hypothesis' defaults time each example (a 200 ms deadline, a too-slow health check): on a busy machine a
    # correct test would fail. Here no outcome depends on the clock; a test's own settings still apply.
    from hypothesis import HealthCheck, settings
except ImportError:
    pass
else:
    settings.register_profile("clock-free", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile("clock-free")


def pytest_configure(config):
    # A NanoSpecWarning in a test is an error unless the test expects it (pytest.warns).
    config.addinivalue_line("filterwarnings", "error::nanospec_fx.diagnostics.warning.NanoSpecWarning")


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


@pytest.fixture
def use_kernels():
    """``use_kernels("reference")`` / ``use_kernels(head_config="c64_w8", device="cpu")``: the kernel selection
    (:func:`nanospec_fx.use_kernels`) for the rest of the test, undone at its end (the fixture form of the
    context manager; calls stack, the last wins)."""
    import contextlib

    from nanospec_fx.kernels.selection import use_kernels as scope

    with contextlib.ExitStack() as stack:
        yield lambda *args, **kwargs: stack.enter_context(scope(*args, **kwargs))
