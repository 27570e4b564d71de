"""Shared bits of the Triton kernels: interpreter detection and the launch context."""
from __future__ import annotations

import contextlib
import importlib
import os

import torch

# Under TRITON_INTERPRET=1 kernels run on CPU tensors (tests without a GPU). The interpreter
# computes bf16 arithmetic and bf16 tl.dot wrongly, so kernels upcast to fp32 first there.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"



def _reload_triton_language_for_the_interpreter() -> None:
    """Make triton's own ``@jit`` helpers (tl.zeros, tl.sum, tl.cumsum...) interpretable.

    They are wrapped when ``triton.language`` is first imported. If something imported triton
    before TRITON_INTERPRET=1 was set (e.g. pytest importing torch._dynamo while resolving a
    warning filter), they are compiled-mode JIT functions that raise when the interpreter calls
    them; re-executing those modules with the variable now set fixes that.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.standard.zeros, InterpretedFunction):
        return
    importlib.reload(tl.standard)
    importlib.reload(tl.random)
    importlib.reload(tl)


if INTERPRET:
    _reload_triton_language_for_the_interpreter()

# Supported floating dtypes; others (fp64) go to the reference.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def direct_launch():
    """Context in which ``wrap_triton(kernel)[grid](...)`` launches directly (eager, opaque op).

    Inside ``torch.library.triton_op`` torch sets this itself; outside it, wrap_triton would go
    through the tracing higher-order op, which costs ~1 ms per launch in eager.
    """
    try:
        from torch._library.triton import set_wrap_triton_enabled
    except ImportError:  # pragma: no cover - older torch
        return contextlib.nullcontext()
    return set_wrap_triton_enabled(False)
