"""Shared bits of the Triton kernels: interpreter detection and the launch context."""
from __future__ import annotations

import contextlib
import os

import torch

# Under TRITON_INTERPRET=1 kernels run on CPU tensors (tests without a GPU). The interpreter
# computes bf16 arithmetic and bf16 tl.dot wrongly, so kernels upcast to fp32 first there.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

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
