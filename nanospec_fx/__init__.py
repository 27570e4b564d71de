"""nanospec-fx: NanoSpec's dynamic active vocabulary as a torch.compile backend.

    compiled = torch.compile(drafter, backend="nanospec")
    nanospec_fx.active_vocab(drafter)   # the ActiveVocab of its LM head

The pass lives in ``nanospec_fx.passes``, the kernels in ``nanospec_fx.kernels``, the state
in ``nanospec_fx.vocab.state`` and the backend in ``nanospec_fx.compiler``; the evaluation (CLI,
benchmarks) in ``nanospec_fx.eval``, which the runtime never imports.

Importing the package is cheap: the names below load their module on first use (the backend
itself is registered with Dynamo by the ``torch_dynamo_backends`` entry point).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "ActiveVocab": "nanospec_fx.vocab.state", "active_vocab": "nanospec_fx.diagnostics.lookup",
    "RequestVocabs": "nanospec_fx.vocab.request_vocab",
    "DEFAULT_CAPACITY": "nanospec_fx.vocab.config", "VocabConfig": "nanospec_fx.vocab.config",
    "BACKEND_NAME": "nanospec_fx.compiler.backend", "NanoSpecWarning": "nanospec_fx.diagnostics.warning",
    "nanospec_backend": "nanospec_fx.compiler.backend",
    "NanoSpecOptions": "nanospec_fx.compiler.options", "OptionError": "nanospec_fx.compiler.options",
    "POLICIES": "nanospec_fx.vocab.config", "FrequencyTable": "nanospec_fx.vocab.policies",
    "attach": "nanospec_fx.integrations.transformers", "speculative_pair": "nanospec_fx.integrations.transformers",
    "detach": "nanospec_fx.integrations.transformers",
    "explain": "nanospec_fx.diagnostics.explain", "HeadCost": "nanospec_fx.diagnostics.cost_model",
    "use_kernels": "nanospec_fx.kernels.selection", "KernelConfig": "nanospec_fx.kernels.selection",
}

if TYPE_CHECKING:
    from nanospec_fx.compiler.backend import BACKEND_NAME, nanospec_backend
    from nanospec_fx.compiler.options import NanoSpecOptions, OptionError
    from nanospec_fx.diagnostics.cost_model import HeadCost
    from nanospec_fx.diagnostics.explain import explain
    from nanospec_fx.integrations.transformers import attach, detach, speculative_pair
    from nanospec_fx.kernels.selection import KernelConfig, use_kernels
    from nanospec_fx.diagnostics.lookup import active_vocab
    from nanospec_fx.vocab.policies import FrequencyTable
    from nanospec_fx.vocab.request_vocab import RequestVocabs
    from nanospec_fx.vocab.state import ActiveVocab
    from nanospec_fx.diagnostics.warning import NanoSpecWarning
    from nanospec_fx.vocab.config import DEFAULT_CAPACITY, POLICIES, VocabConfig


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        try:  # a submodule: nanospec_fx.testing, nanospec_fx.kernels, ...
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


def compile(model, options: dict | None = None, *, in_place: bool = False, **keywords):
    """``torch.compile(model, backend="nanospec", options=...)`` with the options checked at once
    (:func:`nanospec_fx.integrations.transformers.compile`). The backend's options may also be given as keywords
    (``nanospec_fx.compile(m, capacity=1024)``, as ``attach`` takes them); other keywords go to torch.compile."""
    from nanospec_fx.integrations.transformers import compile as compile_checked
    from nanospec_fx.compiler.options import split_keywords

    options, keywords = split_keywords(options, keywords)
    return compile_checked(model, options, in_place=in_place, **keywords)


def register() -> None:
    """Register the ``nanospec`` backend with Dynamo, unless it is known already.

    After ``pip install`` the ``torch_dynamo_backends`` entry point makes it known without
    any import; this is for a source checkout that is not installed.
    """
    from torch._dynamo import list_backends, register_backend

    from nanospec_fx.compiler.backend import BACKEND_NAME, nanospec_backend

    if BACKEND_NAME not in list_backends(exclude_tags=()):
        register_backend(compiler_fn=nanospec_backend, name=BACKEND_NAME)


__all__ = [
    "ActiveVocab", "RequestVocabs", "active_vocab", "attach", "detach", "speculative_pair", "explain", "HeadCost",
    "FrequencyTable",
    "POLICIES",
    "DEFAULT_CAPACITY", "VocabConfig", "NanoSpecOptions", "OptionError", "NanoSpecWarning", "nanospec_backend",
    "register",
    "BACKEND_NAME", "compile", "use_kernels", "KernelConfig",
]
