"""nanospec kernels: the custom ops, their torch reference and (on CUDA) Triton kernels.

This directory installs as ``nanospec_fx.kernels``. Run from the repository root, Python can
also find it as a top-level ``kernels`` package, the name of Hugging Face's ``kernels`` library, which
transformers (>= 5.25 depends on it) imports. Under that name this package hands the import over to that
library when one is installed further down ``sys.path``, and is empty otherwise (importing our ops twice
would register the ``nanospec::*`` ops twice).
"""
if __name__ == "nanospec_fx.kernels":
    from . import ops, reference
    from .dispatch import kernel_mode
    from .selection import KernelConfig, current_config, use_kernels

    __all__ = ["ops", "reference", "kernel_mode", "KernelConfig", "current_config", "use_kernels"]
elif __name__ == "kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _spec = _machinery.PathFinder.find_spec(
        __name__, [p for p in _sys.path if _os.path.abspath(p or _os.getcwd()) != _checkout])
    if _spec is not None and _spec.loader is not None:  # the real library: the import system returns it
        _real = _util.module_from_spec(_spec)
        _sys.modules[__name__] = _real
        _spec.loader.exec_module(_real)
    __all__ = []
else:
    __all__ = []
