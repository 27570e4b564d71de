"""What a kernel benchmark needs beyond the ops themselves (``torch.ops.nanospec.*``): a fresh op state, and which
implementation and Triton head configuration the ops run. One documented place that follows the kernels' layout, so
that a script in benchmarks/ never imports their internals (benchmarks/README.md)."""
from __future__ import annotations

import contextlib

import torch


def op_state(weight: torch.Tensor, capacity: int) -> list[torch.Tensor]:
    """Fresh, empty state tensors for ``weight``'s head, in the order the ops take them (``ids, slot_of, cursor,
    cache_w, cache_b``): those of a new :class:`nanospec_fx.ActiveVocab`."""
    from nanospec_fx import ActiveVocab

    return ActiveVocab(weight, capacity=capacity).tensors()


def state_names() -> tuple[str, ...]:
    """The names of :func:`op_state`'s tensors, in its order (to say which one differs)."""
    from nanospec_fx.kernels.schema import STATE

    return tuple(STATE)


def kernels(mode: str) -> contextlib.AbstractContextManager:
    """Eager op calls in the block run ``mode``'s implementation: ``"reference"`` (plain torch: the oracle of a
    kernel check), ``"host"``, ``"triton"`` or ``"auto"`` (docs/kernels.md: :func:`nanospec_fx.use_kernels`)."""
    from nanospec_fx.kernels.selection import use_kernels

    return use_kernels(mode)


def head_configs() -> dict[str, dict]:
    """The Triton compact-logits tile configurations by name (docs/kernels.md); empty without triton."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return {}
    from nanospec_fx.kernels.selection import HEAD_CONFIGS

    return dict(HEAD_CONFIGS)


def head_config(name: str) -> contextlib.AbstractContextManager:
    """Calls of the Triton head kernel in the block use the configuration ``name`` (:func:`nanospec_fx.use_kernels`)."""
    from nanospec_fx.kernels.selection import use_kernels

    return use_kernels(head_config=name)


def triton_op_registration() -> bool:
    """Whether the read-only ops are registered as ``torch.library.triton_op`` (inductor inlines their kernels)."""
    from nanospec_fx.kernels import ops

    return bool(ops.USES_TRITON_OP)


def host_body(op: str):
    """The CPU host path's function behind ``torch.ops.nanospec.<op>``, called directly: what the op costs without
    the dispatcher and kernel selection in front of it (benchmarks/op_call_overhead.py)."""
    from nanospec_fx.kernels import host

    return getattr(host, op)
