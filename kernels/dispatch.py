"""Which implementation a nanospec op runs: Triton kernels, the host path or the torch reference.

The ``kernels`` choice of :func:`nanospec_fx.kernels.selection.current_config` selects it
(``with nanospec_fx.kernels.use_kernels("reference"): ...``; process default: ``NANOSPEC_KERNELS``, read once):
  * ``auto`` (default): Triton for CUDA tensors when triton imports, the host path
    (:mod:`kernels.host`: reads the count on the host, computes only the active rows) for CPU
    tensors, the reference elsewhere;
  * ``reference``: always the torch reference (works over the whole capacity, never syncs);
  * ``host``: the host path for CPU tensors, the reference elsewhere;
  * ``triton``: always Triton (on CPU tensors this needs ``TRITON_INTERPRET=1``).
A traced call (fake tensors, an active dispatch mode, Dynamo) never takes the host path: it reads
data on the host. It takes the reference, which computes the same values.
The config is looked up on each call, for the call's device type. Inside ``torch.compile`` it is
looked up when the op is traced (``triton_op``) or run (opaque op).
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import host, reference
from .selection import current_config


def kernel_mode(device_type: str | None = None) -> str:
    """The ``kernels`` choice in effect for a call on ``device_type`` (None: the all-devices choice)."""
    return current_config(device_type).kernels


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_ops():
    """The Triton implementations, or None when triton (or its kernels) is unavailable."""
    try:
        from . import triton_kernels
    except ImportError:
        return None
    return triton_kernels


def _is_fake(tensor: torch.Tensor) -> bool:
    """``fake_tensor.is_fake``, answered without its walk for a plain tensor (the per-call case: ~3 us saved)."""
    if (type(tensor) is torch.Tensor and not torch._is_functional_tensor(tensor)
            and not torch._C._functorch.is_functorch_wrapped_tensor(tensor)):
        return False  # no subclass, no functional or functorch wrapper: nothing that can hold a fake tensor
    return torch._subclasses.fake_tensor.is_fake(tensor)


def _host_readable(tensor: torch.Tensor) -> bool:
    """A real CPU tensor outside any tracing: its data can be read on the host."""
    return (
        tensor.device.type == "cpu"
        and _get_current_dispatch_mode() is None
        and not torch.compiler.is_compiling()
        and not _is_fake(tensor)
    )


def path_for(device: torch.device | str) -> str:
    """Which implementation set runs untraced ops on ``device``: "triton", "host" or "reference"."""
    kind = torch.device(device).type
    mode = kernel_mode(kind)
    if mode == "triton" or (mode == "auto" and kind == "cuda" and _triton_ops() is not None):
        return "triton"
    if mode in ("auto", "host") and kind == "cpu":
        return "host"
    return "reference"


def implementation_for(op: str, tensor: torch.Tensor) -> Callable:
    """The function that runs ``op`` for a call whose main tensor is ``tensor``."""
    mode = current_config(tensor.device.type).kernels
    if mode in ("auto", "host") and _host_readable(tensor):
        return getattr(host, op)
    if mode in ("reference", "host") or (mode == "auto" and tensor.device.type != "cuda"):
        return getattr(reference, op)
    if mode == "triton" and tensor.device.type == "cpu" and not _interpreting():
        raise RuntimeError("kernels=triton on CPU tensors needs TRITON_INTERPRET=1 "
                           "(set before importing triton)")
    triton_ops = _triton_ops()
    if triton_ops is None or not hasattr(triton_ops, op):
        if mode == "triton":
            raise RuntimeError(f"kernels=triton but no Triton kernel for {op!r} could be imported")
        return getattr(reference, op)
    return getattr(triton_ops, op)
