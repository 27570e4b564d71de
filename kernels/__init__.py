"""nanospec kernels: the custom ops, their torch reference and (on CUDA) Triton kernels."""
from . import ops, reference
from .dispatch import kernel_mode

__all__ = ["ops", "reference", "kernel_mode"]
