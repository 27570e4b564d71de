"""Which kernels the nanospec ops run: one config, process defaults from the environment, scoped overrides.

:class:`KernelConfig` holds the two per-call choices: ``kernels`` (``auto`` | ``reference`` | ``host`` |
``triton``, see :mod:`nanospec_fx.kernels.dispatch`) and ``head_config`` (a name in :data:`HEAD_CONFIGS`, the
Triton head's tile settings). Their process defaults come from ``NANOSPEC_KERNELS`` and
``NANOSPEC_HEAD_CONFIG``, read ONCE, at the first kernel call (a bad value raises there, as before; a
program may still set them after ``import nanospec_fx``, before the first op runs);
a later change to them has no effect and warns once (:class:`KernelSelectionWarning`).
``NANOSPEC_TRITON_OP`` (``auto`` | ``0`` | ``force``) is read once too, when the ops are registered: it
decides whether the read-only ops are ``triton_op`` (traced into by inductor) or opaque, so it cannot
change per scope.

:func:`use_kernels` overrides the defaults inside a ``with`` block, for every device or for one device
type (``"cpu"``, ``"cuda"``); blocks nest (inner wins), and the overrides live in a
:class:`contextvars.ContextVar`, so threads and asyncio tasks do not see each other's.

Every op call asks for its config (issue 39: that lookup was ~6 of the ~30 us of Python around a tiny CPU op), so
it is resolved once per scope and device type: each ``use_kernels`` block is a new :class:`_Scope` holding the
configs resolved under it, a block's exit restores the enclosing scope (a switch takes effect at the next call),
and a resolved config is kept only with the defaults it was resolved from. The read-once check of the environment
compares os.environ's own stored bytes (a dict lookup, not a decode per variable per call).

What traced code depends on: an opaque op (CPU machines, ``TRITON_INTERPRET=1``, ``NANOSPEC_TRITON_OP=0``)
chooses its kernels when it runs, so a compiled function follows the config of each call. A ``triton_op``
(CUDA with triton) is traced into: the kernels and tile settings in effect when it is COMPILED are baked
into the compiled code (a ``with use_kernels(...)`` around a later call of the same compiled function does
not change them; Dynamo does not guard on it). :func:`cache_key` names the effective config; the backend
adds it to ``torch.compiler.config.cache_key_tag`` while inductor compiles, so inductor's FX-graph and
AOTAutograd caches never hand a graph compiled under one config to another.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import threading
import warnings
from typing import Iterator

KERNEL_CHOICES = ("auto", "reference", "host", "triton")
TRITON_OP_CHOICES = ("auto", "0", "force")

#: Tile and launch settings of the Triton head kernel (:mod:`nanospec_fx.kernels.triton_head`). At
#: Llama-3-8B shape (C = 3,072, H = 4,096, bf16) ``default`` launches 96 programs per row block on a
#: 132-SM H100/H200, ~1.5 MB in flight; ``c16_k256_s4`` launches 192 with twice the bytes per k-step and
#: a deeper pipeline, and ``c16_k128_s4`` / ``c64_w8`` are the two directions around it. None has been
#: timed on a GPU yet (``bash benchmarks/gpu_check.sh`` sweeps them all). Kept here, not in triton_head,
#: so a name is checked without importing triton.
HEAD_CONFIGS: dict[str, dict] = {
    "default": dict(BLOCK_C=32, BLOCK_K=128, num_warps=4, num_stages=3),
    "c16_k256_s4": dict(BLOCK_C=16, BLOCK_K=256, num_warps=4, num_stages=4),
    "c16_k128_s4": dict(BLOCK_C=16, BLOCK_K=128, num_warps=4, num_stages=4),
    "c64_w8": dict(BLOCK_C=64, BLOCK_K=128, num_warps=8, num_stages=3),
    # Tiles chosen by the row count (issue 39): up to FMA_ROWS rows, any dtype, register FMAs on BLOCK_M = the rows
    # rounded up (no 16-row tl.dot padding) over 16-slot tiles (192 programs at C = 3,072: every SM of an H100/H200
    # busy, where 32-slot tiles leave 36 of 132 idle); more rows: tl.dot on 16 x 16 tiles. Not timed on a GPU yet.
    "by_rows": dict(BLOCK_C=16, BLOCK_K=256, num_warps=4, num_stages=4, FMA_ROWS=4, FMA_BLOCK_K=128),
}

_ENV = ("NANOSPEC_KERNELS", "NANOSPEC_HEAD_CONFIG", "NANOSPEC_TRITON_OP")


class KernelSelectionWarning(UserWarning):
    """A kernel-selection variable changed after it was read (the change has no effect)."""


def _check_kernels(value: str, source: str) -> str:
    mode = value.strip().lower() or "auto"
    if mode not in KERNEL_CHOICES:
        raise ValueError(f"{source}={value!r} is not one of {', '.join(KERNEL_CHOICES)}")
    return mode


def _check_head_config(value: str, source: str) -> str:
    name = value.strip() or "default"
    if name not in HEAD_CONFIGS:
        raise ValueError(f"{source}={value!r} is not one of {', '.join(HEAD_CONFIGS)}")
    return name


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The kernel choices of one call: ``kernels`` (the implementation set) and ``head_config`` (tiles)."""

    kernels: str = "auto"
    head_config: str = "default"

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernels", _check_kernels(self.kernels, "kernels"))
        object.__setattr__(self, "head_config", _check_head_config(self.head_config, "head_config"))


class _Scope:
    """The overrides in effect in one ``use_kernels`` block (``((device type or None for all devices, fields), ...)``,
    innermost last) and the configs resolved under them: ``configs[device_type] = (defaults, config)``."""

    __slots__ = ("overrides", "configs")

    def __init__(self, overrides: tuple) -> None:
        self.overrides = overrides
        self.configs: dict[str | None, tuple] = {}


# The environment as read once: (its fingerprint, raw values, default config); None until the first kernel call.
_defaults: tuple[tuple, tuple, KernelConfig] | None = None
_triton_op: str | None = None  # NANOSPEC_TRITON_OP as read at the ops' registration
_defaults_lock = threading.Lock()
_warned: set[tuple] = set()
_scope: contextvars.ContextVar[_Scope] = contextvars.ContextVar("nanospec_kernel_scope", default=_Scope(()))


# The two variables' keys as os.environ stores them (bytes on POSIX, upper-case on Windows); None: no such mapping.
_ENV_KEYS = tuple(map(os.environ.encodekey, _ENV[:2])) if hasattr(os.environ, "encodekey") else None


def _read_env() -> tuple:
    return tuple(os.environ.get(name) for name in _ENV[:2])


def _env_fingerprint() -> tuple:
    """The two variables as ``os.environ`` stores them (its encoded mapping, where it has one: two dict lookups
    instead of two decodes); equal fingerprints mean equal :func:`_read_env` values."""
    data = getattr(os.environ, "_data", None)
    if not isinstance(data, dict) or _ENV_KEYS is None:
        return _read_env()
    return (data.get(_ENV_KEYS[0]), data.get(_ENV_KEYS[1]))


def _load() -> tuple[tuple, tuple, KernelConfig]:
    global _defaults
    with _defaults_lock:
        if _defaults is None:
            fingerprint, raw = _env_fingerprint(), _read_env()
            config = KernelConfig(_check_kernels(raw[0] or "auto", "NANOSPEC_KERNELS"),
                                  _check_head_config(raw[1] or "default", "NANOSPEC_HEAD_CONFIG"))
            _defaults = (fingerprint, raw, config)
        return _defaults


def _check_unchanged(fingerprint: tuple, raw: tuple, stacklevel: int) -> None:
    """Warn once per changed value: the environment was read at the first kernel call, a change is ignored."""
    if _env_fingerprint() == fingerprint:
        return
    now = _read_env()
    if now == raw:
        return
    for name, was, is_ in zip(_ENV, raw, now):
        if was != is_ and (name, is_) not in _warned:
            _warned.add((name, is_))
            warnings.warn(
                f"{name} changed from {was!r} to {is_!r} after the kernels read it; the change has no effect "
                "(the variables are process defaults, read once). Use nanospec_fx.kernels.use_kernels(...) to "
                "switch kernels inside a process.", KernelSelectionWarning, stacklevel=stacklevel)


def default_config() -> KernelConfig:
    """The process defaults (from the environment, read on the first call)."""
    fingerprint, raw, config = _defaults or _load()
    _check_unchanged(fingerprint, raw, stacklevel=4)  # the caller of default_config
    return config


def triton_op_choice() -> str:
    """``NANOSPEC_TRITON_OP`` as read once (when the ops register): ``auto``, ``0`` (opaque ops) or ``force``."""
    global _triton_op
    with _defaults_lock:
        if _triton_op is None:
            raw = os.environ.get("NANOSPEC_TRITON_OP")
            choice = (raw or "auto").strip().lower() or "auto"
            if choice not in TRITON_OP_CHOICES:
                raise ValueError(f"NANOSPEC_TRITON_OP={raw!r} is not one of {', '.join(TRITON_OP_CHOICES)}")
            _triton_op = choice
        return _triton_op


def current_config(device_type: str | None = None) -> KernelConfig:
    """The config in effect for a call on ``device_type`` (the defaults, then every enclosing override that
    covers this device type, innermost last), resolved once per scope and device type."""
    defaults = _defaults or _load()
    _check_unchanged(defaults[0], defaults[1], stacklevel=3)  # the caller of current_config
    scope = _scope.get()
    hit = scope.configs.get(device_type)
    if hit is not None and hit[0] is defaults:
        return hit[1]
    config = _resolve(defaults[2], scope.overrides, device_type)
    scope.configs[device_type] = (defaults, config)
    return config


@functools.lru_cache(maxsize=256)
def _resolve(config: KernelConfig, overrides: tuple, device_type: str | None) -> KernelConfig:
    for device, fields in overrides:
        if device is None or device == device_type:
            config = dataclasses.replace(config, **dict(fields))
    return config


@contextlib.contextmanager
def use_kernels(kernels: str | None = None, *, device: str | None = None,
                head_config: str | None = None) -> Iterator[None]:
    """Run the nanospec ops with ``kernels`` (``auto`` | ``reference`` | ``host`` | ``triton``) and/or the
    Triton head's ``head_config`` inside the block, on every device or only on ``device`` (a device type
    or device: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` means every CUDA device). Unset arguments keep the
    enclosing choice. Bad values raise ``ValueError`` here. Under a ``triton_op`` registration (CUDA), a
    compiled function keeps the choice in effect when it was compiled (see the module docstring)."""
    fields: dict[str, str] = {}
    if kernels is not None:
        fields["kernels"] = _check_kernels(kernels, "kernels")
    if head_config is not None:
        fields["head_config"] = _check_head_config(head_config, "head_config")
    device_type = None
    if device is not None:
        import torch

        device_type = torch.device(device).type
    token = _scope.set(_Scope((*_scope.get().overrides, (device_type, tuple(sorted(fields.items()))))))
    try:
        yield
    finally:
        _scope.reset(token)


def cache_key() -> str:
    """The effective config as a string, for compile caches: the defaults with every override in effect
    (all of them, whatever device they name) and ``NANOSPEC_TRITON_OP``."""
    parts = [f"default={default_config()}"]
    parts += [f"{device or 'all'}:{list(fields)}" for device, fields in _scope.get().overrides]
    return f"nanospec-kernels({'; '.join(parts)}; triton_op={triton_op_choice()})"


@contextlib.contextmanager
def inductor_cache_tag() -> Iterator[None]:
    """Add :func:`cache_key` to ``torch.compiler.config.cache_key_tag`` (part of inductor's FX-graph and
    AOTAutograd cache keys) while inductor compiles."""
    import torch.compiler.config as cconfig

    tag = cconfig.cache_key_tag
    with cconfig.patch(cache_key_tag=f"{tag}|{cache_key()}" if tag else cache_key()):
        yield


def _reset_for_tests() -> None:
    """Forget the environment as read (tests of the read-once rule only)."""
    global _defaults, _triton_op
    with _defaults_lock:
        _defaults = _triton_op = None
        _warned.clear()
