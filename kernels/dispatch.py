"""Which implementation a nanospec op runs: Triton kernels or the torch reference.

``NANOSPEC_KERNELS`` selects it:
  * ``auto`` (default): Triton for CUDA tensors when triton imports, the reference elsewhere;
  * ``reference``: always the torch reference;
  * ``triton``: always Triton (on CPU tensors this needs ``TRITON_INTERPRET=1``).
The variable is read on each call, so tests can switch it with ``monkeypatch.setenv``. Inside
``torch.compile`` it is read when the op is traced (``triton_op``) or run (opaque op).
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from . import reference

_CHOICES = ("auto", "reference", "triton")


def kernel_mode() -> str:
    mode = os.environ.get("NANOSPEC_KERNELS", "auto").strip().lower() or "auto"
    if mode not in _CHOICES:
        raise ValueError(f"NANOSPEC_KERNELS={mode!r} is not one of {', '.join(_CHOICES)}")
    return mode


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _triton_ops():
    """The Triton implementations, or None when triton (or its kernels) is unavailable."""
    try:
        from . import triton_kernels
    except ImportError:
        return None
    return triton_kernels


def implementation_for(op: str, tensor: torch.Tensor) -> Callable:
    """The function that runs ``op`` for a call whose main tensor is ``tensor``."""
    mode = kernel_mode()
    if mode == "reference" or (mode == "auto" and tensor.device.type != "cuda"):
        return getattr(reference, op)
    if mode == "triton" and tensor.device.type == "cpu" and not _interpreting():
        raise RuntimeError("NANOSPEC_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (set before importing triton)")
    triton_ops = _triton_ops()
    if triton_ops is None or not hasattr(triton_ops, op):
        if mode == "triton":
            raise RuntimeError(f"NANOSPEC_KERNELS=triton but no Triton kernel for {op!r} could be imported")
        return getattr(reference, op)
    return getattr(triton_ops, op)
