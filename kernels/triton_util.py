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


def device_guard(tensor: torch.Tensor):
    """Context that makes ``tensor``'s CUDA device current for the launches inside it.

    Triton launches on the *current* device, not on the device of its arguments: a drafter on
    ``cuda:1`` launched from ``cuda:0`` would crash or touch the wrong memory. No-op off CUDA.
    """
    device = tensor.device
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


# (data_ptr, shape, strides, dtype, device) -> (weak ref to the storage, version, contiguous copy)
_ROW_COPIES: dict[tuple, tuple] = {}


def contiguous_rows(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [V, H] with unit stride along H, copied at most once per weight (and version).

    ``observe`` copies whole rows of the head; from a transposed or tied weight ([H, V] storage)
    each element of a row sits in its own memory segment, so the copy would be uncoalesced on
    every call. The contiguous copy is made on first use and kept while the weight's storage lives
    and is not modified in place (keyed by storage, not by tensor object: a graph may hand over a
    fresh ``.t()`` view each call). It costs one more head in memory; a contiguous head avoids it.
    """
    if weight.stride(-1) == 1:
        return weight
    from torch.multiprocessing.reductions import StorageWeakRef

    for k in [k for k, v in _ROW_COPIES.items() if v[0].expired()]:
        del _ROW_COPIES[k]  # the weight is gone: drop its copy
    key = (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight.device)
    hit = _ROW_COPIES.get(key)
    if hit is not None and hit[1] == weight._version:
        return hit[2]
    copy = weight.contiguous()
    _ROW_COPIES[key] = (StorageWeakRef(weight.untyped_storage()), weight._version, copy)
    return copy
