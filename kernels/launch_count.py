"""Count the device work a piece of eager code dispatches: Triton launches and torch compute ops.

On a GPU every Triton launch and every torch compute op outside it is one kernel launch, each paying the
dispatcher and the launch before anything runs: what an eager draft step costs beyond its bytes is their number.
:func:`counting` counts both, on any device (CPU tensors under ``TRITON_INTERPRET=1`` count the same launches a GPU
would run): Triton launches by wrapping the launcher (``JITFunction.run`` and, in the interpreter,
``InterpretedFunction.run``), torch ops with a ``TorchDispatchMode`` over the code, which sees every aten op the
code dispatches outside those launches (the interpreter's own copies inside a launch are not the code's, so the
mode is off during a launch). Views (``is_view``: metadata only) and allocations (``empty``: no kernel) are not
compute ops. The tests of the op budgets (``tests/kernels/test_launch_budget.py``) and ``benchmarks/gpu_bench.py``
use it. A ``torch.ops.nanospec`` call is not counted itself: its body runs under the mode (the kernels the
selection picks for a traced call: Triton on CUDA or under ``use_kernels("triton")``, else the reference).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

#: aten ops that allocate without computing (no kernel launch on a GPU).
ALLOCATIONS = frozenset({"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
                         "aten::new_empty_strided"})


@dataclasses.dataclass
class DispatchCount:
    """What :func:`counting` saw: Triton kernel names and torch compute ops (aten names), in order."""

    triton: list[str] = dataclasses.field(default_factory=list)
    torch_ops: list[str] = dataclasses.field(default_factory=list)

    @property
    def launches(self) -> int:
        """Device launches: every Triton launch and every torch compute op (one kernel each on a GPU)."""
        return len(self.triton) + len(self.torch_ops)


class _ComputeOps(TorchDispatchMode):
    def __init__(self, seen: list[str]):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if func.namespace == "nanospec":  # an op call: count what its body dispatches, not the call itself
            from . import ops
            from .triton_util import direct_launch

            with self, direct_launch():
                return getattr(ops, f"_{func._opname}")(*args, **(kwargs or {}))
        if not func.is_view and name not in ALLOCATIONS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _launchers() -> list[type]:
    classes = []
    try:
        from triton.runtime.jit import JITFunction
        classes.append(JITFunction)
    except ImportError:  # pragma: no cover - no triton: nothing launches
        pass
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover
        pass
    return classes


@contextlib.contextmanager
def counting() -> Iterator[DispatchCount]:
    """``with counting() as seen: ...``: ``seen.triton`` and ``seen.torch_ops`` list what the block dispatched."""
    seen = DispatchCount()
    patched = []
    for cls in _launchers():
        real = cls.run

        def run(self, *args, _real=real, **kwargs):
            name = getattr(getattr(self, "fn", None), "__name__", repr(self))
            seen.triton.append(name)
            with _disable_current_modes():  # the interpreter's own tensor copies are not the code's ops
                return _real(self, *args, **kwargs)

        cls.run = run
        patched.append((cls, real))
    try:
        with _ComputeOps(seen.torch_ops):
            yield seen
    finally:
        for cls, real in patched:
            cls.run = real
