"""nanospec kernels: the custom ops, their torch reference and (on CUDA) Triton kernels.

This directory installs as ``nanospec_fx.kernels``. Run from the repository root, Python can
also find it as a top-level ``kernels`` package - transformers imports that name to probe for
Hugging Face's ``kernels`` library - and importing it twice would register the
``nanospec::*`` ops twice. Under any other name it is therefore an empty package.
"""
if __name__ == "nanospec_fx.kernels":
    from . import ops, ops_per_request, reference
    from .dispatch import kernel_mode

    __all__ = ["ops", "ops_per_request", "reference", "kernel_mode"]
else:
    __all__ = []
