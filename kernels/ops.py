"""The nanospec custom ops: the boundary between the FX rewrite and the kernels.

The rewritten graph calls these ops (``torch.ops.nanospec.*``). Shapes never depend on the
active set, so the ops trace, compile and capture into CUDA graphs as they are. Each op's body
picks its kernel set per call (see :func:`nanospec_fx.kernels.dispatch.implementation_for`): the plain-torch
reference (``kernels/reference.py``) or the Triton kernels (``kernels/triton_*.py``).

How they are registered:
  * CUDA available, triton importable, not interpreting: the read-only ops are
    ``torch.library.triton_op``, so inductor traces into the body and sees the Triton kernels
    (``wrap_triton``) instead of an opaque call (if that registration fails: the opaque op
    below). ``observe`` mutates the state and stays an opaque custom op (see ``_register``).
  * otherwise (CPU machines, ``TRITON_INTERPRET=1``): ``torch.library.custom_op`` with a fake
    implementation; the body still runs the Triton kernels under ``use_kernels("triton")`` (or
    ``NANOSPEC_KERNELS=triton``) (on CPU tensors through the interpreter).
``NANOSPEC_TRITON_OP=0`` forces the opaque registration; ``=force`` the triton_op one even
without CUDA (CPU tensors then take the reference branch, inlined by the compiler). It is read once, at
registration (:mod:`nanospec_fx.kernels.selection`).

The ops' signatures and the state's order are declared once, in :mod:`nanospec_fx.kernels.schema`;
each op is registered with that schema string (and a test checks every implementation against it).
Every op takes an optional ``rows``: None for the shared set of :class:`nanospec_fx.ActiveVocab` (what the passes
emit), or the request row of each batch row for the per-request state of :class:`nanospec_fx.RequestVocabs`
(a leading request axis on every state tensor; the rules, padding rows included: :mod:`kernels.request_rows`).

Under ``torch.autocast`` the head ops (compact_logits, head_logits) cast like ``F.linear``; the
differentiable ops have a backward with respect to their logits/hidden input (not the cached
weights), so a frozen head trains the body (see the end of this file); per-request calls are inference only.
"""
from __future__ import annotations

import functools
import operator
import os
import warnings
from typing import Callable

import torch

from . import reference
from .dispatch import implementation_for
from .selection import current_config, triton_op_choice
from .schema import arguments, check_num_pinned, mutated, schema_of
from .state_lock import serialised_op


def _want_triton_op() -> bool:
    choice = triton_op_choice()  # NANOSPEC_TRITON_OP, read once
    if choice == "0" or os.environ.get("TRITON_INTERPRET", "0") == "1" or not hasattr(torch.library, "triton_op"):
        return False
    if choice != "force" and not torch.cuda.is_available():  # force: tests of the registration on CPU
        return False
    try:
        from . import triton_kernels  # noqa: F401
    except ImportError:
        return False
    return True


USES_TRITON_OP = _want_triton_op()


def _register(name: str, body: Callable, fake: Callable):
    """Register ``body`` as ``nanospec::<name>`` with its declared schema (:func:`~kernels.schema.schema_of`)
    (triton_op when possible, else an opaque custom op).

    ``observe`` (the one op that mutates) stays opaque everywhere: inlined, its kernels would be
    functionalised, and a clone of the [C, H] cache per step would cost more than the head.
    """
    global USES_TRITON_OP
    qualname = f"nanospec::{name}"
    mutates_args, schema = mutated(name), schema_of(name)
    if USES_TRITON_OP and not mutates_args:
        try:
            try:
                return torch.library.triton_op(qualname, mutates_args=mutates_args, schema=schema)(body)
            except TypeError:  # an older torch without triton_op(schema=): inferred from the same hints
                return torch.library.triton_op(qualname, mutates_args=mutates_args)(body)
        except Exception as exc:  # noqa: BLE001 - any failure: keep the op usable, opaque
            warnings.warn(f"nanospec: triton_op registration of {qualname} failed ({exc}); using an opaque custom op")
            USES_TRITON_OP = False

    @functools.wraps(body)
    def opaque(*args, **kwargs):
        from .triton_util import direct_launch

        with direct_launch():  # launch kernels directly, not through the tracing wrapper
            return body(*args, **kwargs)
    op = torch.library.custom_op(qualname, mutates_args=mutates_args, schema=schema)(opaque)
    op.register_fake(fake)
    _CPU_LIB.impl(name, _cpu_kernel(body), "CPU")
    return op


# The opaque ops' CPU kernel, registered on the CPU key itself (issue 39). custom_op's kernel sits on
# CompositeExplicitAutograd behind a torch._disable_dynamo frame, checks the result's aliasing and enters
# ``direct_launch`` on every call: about half of a ~30 us call on a tiny CPU state, whose body takes a few us. The
# CPU key wins over CompositeExplicitAutograd for CPU tensors, so this kernel runs the same body with less around
# it: ``direct_launch`` only where a CPU call can launch Triton (``kernels="triton"``, through the interpreter), and
# Dynamo's frame hook unset around the body as torch._dynamo.disable does, without its Python frames. The outputs
# are fresh tensors (opcheck's schema test checks they alias no input). Every other key (fake, autograd, autocast,
# functionalisation, other devices) is unchanged (tests/kernels/test_opcheck.py checks the ops as registered).
_CPU_LIB = torch.library.Library("nanospec", "IMPL")


try:  # what torch._dynamo.disable does around a call (callback None under every stance), without its Python frames
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
except ImportError:  # pragma: no cover - a torch without it: the public wrapper
    _set_eval_frame = None


def _cpu_kernel(body: Callable) -> Callable:
    def kernel(*args):
        prior = _set_eval_frame(None)  # Dynamo never compiles the body's frames, as under custom_op's kernel
        try:
            if current_config("cpu").kernels == "triton":  # the one CPU choice that launches Triton kernels
                from .triton_util import direct_launch

                with direct_launch():
                    return body(*args)
            return body(*args)
        finally:
            _set_eval_frame(prior)
    return kernel if _set_eval_frame is not None else torch._disable_dynamo(kernel)


# ----------------------------------------------------------------------------- bodies
# 1-byte floats (weight-only float8 heads): few kernels index them, so ``observe`` copies their rows as uint8 bytes.
_BYTE_FLOATS = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                if hasattr(torch, n)}


def _observe(
    token_ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, slot_of: torch.Tensor,
    cursor: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor, num_pinned: int,
    rows: torch.Tensor | None = None,
) -> None:
    """Add ``token_ids`` to the active vocabulary held in the state tensors (in place); with ``rows``, the ids
    ``[B, n]`` (-1 ignored) of batch row b to request row ``rows[b]``.

    Every implementation renews first the active ids of this call that its new ids would evict
    (:func:`reference.renew_fed_ids`), so a call never evicts a token it feeds while they fit.
    """
    check_num_pinned(num_pinned, ids.shape[-1])
    if cache_w.dtype in _BYTE_FLOATS and weight.dtype == cache_w.dtype:  # float8 rows: copied as their bytes
        weight, cache_w = weight.view(torch.uint8), cache_w.view(torch.uint8)
    implementation_for("observe", cache_w)(
        token_ids, weight, bias, ids, slot_of, cursor, cache_w, cache_b, num_pinned, rows)


def _compact_logits(
    x: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, cursor: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits of the active slots (of each row's request), [..., C]; slots past the count are -inf."""
    return implementation_for("compact_logits", x)(x, cache_w, cache_b, cursor, rows)


def _scatter_logits(compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, vocab_size: int,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """Compact logits [..., C] -> full-vocabulary logits [..., V], -inf for inactive tokens."""
    return implementation_for("scatter_logits", compact)(compact, ids, cursor, vocab_size, rows)


def _head_logits(
    x: torch.Tensor, cache_w: torch.Tensor, cache_b: torch.Tensor | None, ids: torch.Tensor, cursor: torch.Tensor,
    vocab_size: int, rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """compact_logits then scatter_logits in one op (a head without post-ops), [..., V]."""
    return implementation_for("head_logits", x)(x, cache_w, cache_b, ids, cursor, vocab_size, rows)


def _compact_topk(
    compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor, k: int, largest: bool = True,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over the active slots -> (values, token ids); ties: smaller token id first."""
    return implementation_for("compact_topk", compact)(compact, ids, cursor, k, largest, rows)


def _compact_argmax(compact: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
    """Token id of the largest active logit (ties: smaller id; NaN is largest; 0 if none)."""
    return implementation_for("compact_argmax", compact)(compact, ids, cursor, rows)


# ----------------------------------------------------------------------------- fakes
# ``rows`` only picks each batch row's state, so it changes no output shape; C is the state's last slot dim.
def _observe_fake(token_ids, weight, bias, ids, slot_of, cursor, cache_w, cache_b, num_pinned, rows=None):
    check_num_pinned(num_pinned, ids.shape[-1])
    return None


def _compact_logits_fake(x, cache_w, cache_b, cursor, rows=None):
    return x.new_empty((*x.shape[:-1], cache_w.shape[-2]))


def _scatter_logits_fake(compact, ids, cursor, vocab_size, rows=None):
    return compact.new_empty((*compact.shape[:-1], vocab_size))


def _head_logits_fake(x, cache_w, cache_b, ids, cursor, vocab_size, rows=None):
    return x.new_empty((*x.shape[:-1], vocab_size))


def _compact_topk_fake(compact, ids, cursor, k, largest=True, rows=None):
    shape = (*compact.shape[:-1], k)
    return compact.new_empty(shape), compact.new_empty(shape, dtype=torch.int64)


def _compact_argmax_fake(compact, ids, cursor, rows=None):
    return compact.new_empty(compact.shape[:-1], dtype=torch.int64)


# Serialised on the state it writes: a compiled graph's observers, called from several threads, never interleave.
observe = _register("observe", serialised_op(_observe, arguments("observe").index("ids")), _observe_fake)
compact_logits = _register("compact_logits", _compact_logits, _compact_logits_fake)
scatter_logits = _register("scatter_logits", _scatter_logits, _scatter_logits_fake)
head_logits = _register("head_logits", _head_logits, _head_logits_fake)
compact_topk = _register("compact_topk", _compact_topk, _compact_topk_fake)
compact_argmax = _register("compact_argmax", _compact_argmax, _compact_argmax_fake)


# ----------------------------------------------------------------------------- autocast
# Under torch.autocast, eager ``F.linear`` computes in the autocast dtype and returns it. The
# head ops are the drafter's linear, so they follow the same rule: floating inputs other than
# float64 are cast to the current autocast dtype (read per call, as autocast itself does), and
# the op runs with autocast off. Without this, the body of an opaque op would inherit autocast
# in eager runs but not in compiled ones, and the Triton kernels never would.
_AUTOCAST_LIB = torch.library.Library("nanospec", "IMPL")


def _register_autocast(name: str, device_type: str) -> None:
    key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    overload = getattr(torch.ops.nanospec, name).default
    excluded = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def kernel(_keyset, *args):
        dtype = torch.get_autocast_dtype(device_type)
        cast = [
            a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.float64 else a
            for a in args
        ]
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return overload(*cast)

    _AUTOCAST_LIB.impl(name, kernel, key, with_keyset=True)


for _name in ("compact_logits", "head_logits"):
    for _device in ("cpu", "cuda"):
        if torch.amp.is_autocast_available(_device):
            _register_autocast(_name, _device)


# ----------------------------------------------------------------------------- observe's autograd key
# ``observe`` returns nothing and writes only state tensors, which never require grad: it has no gradient. The
# autograd and ADInplaceOrView kernels custom_op registers for it cost ~half of an eager observe call on the CPU
# host path (Python: argument defaults filled per call, each mutated argument checked); this one kernel does
# what they do for this op - bump the version counters of the five mutated state tensors (so autograd still sees
# a saved cache that an observe overwrote) - and dispatches straight to the backend kernel below them.
_OBSERVE = torch.ops.nanospec.observe.default
_MUTATED = operator.itemgetter(*(arguments("observe").index(name) for name in mutated("observe")))


def _observe_autograd(keyset, *args):
    torch.autograd.graph.increment_version(_MUTATED(args))  # the five state tensors, one call
    with torch._C._AutoDispatchBelowADInplaceOrView():
        return _OBSERVE.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args)


_AUTOCAST_LIB.impl("observe", _observe_autograd, "Autograd", with_keyset=True)
# Under ``torch.inference_mode`` (how a decode loop runs) the Autograd key is skipped and custom_op's Python
# ADInplaceOrView kernel ran instead (``fill_defaults`` over the schema per call: ~30 us of an ~75 us eager observe
# on the CPU host path); the same kernel does its work (bump the mutated tensors' versions, dispatch below).
_AUTOCAST_LIB.impl("observe", _observe_autograd, "ADInplaceOrView", with_keyset=True)


# ----------------------------------------------------------------------------- autograd
# Gradients flow into the head's input x (how EAGLE drafters are trained: body trainable, head
# frozen). The weights are the state's cached rows, never trainable: their gradient is None.
# Inactive tokens and free slots are constants (-inf), so they pass no gradient. The formulas
# are plain torch, so they trace into AOT autograd's backward graph. Per-request calls (``rows`` given) are
# inference only: their forward runs, their backward raises instead of returning the shared set's gradient.
def _shared_only(ctx) -> None:
    if ctx.per_request:
        raise NotImplementedError("nanospec: the per-request ops (rows given) have no autograd; train through the "
                                  "shared-set ops (rows=None)")


def _active(cursor: torch.Tensor, capacity: int) -> torch.Tensor:
    return torch.arange(capacity, device=cursor.device) < cursor


def _grad_x(grad_compact: torch.Tensor, cache_w: torch.Tensor, cursor: torch.Tensor) -> torch.Tensor:
    g = torch.where(_active(cursor, cache_w.shape[0]), grad_compact,
                    torch.zeros((), dtype=grad_compact.dtype, device=grad_compact.device))
    return g @ cache_w.to(g.dtype)


def _gather_slots(grad_full: torch.Tensor, ids: torch.Tensor, cursor: torch.Tensor) -> torch.Tensor:
    """[..., V] gradient -> [..., C] at the active slots' token ids, 0 at free slots."""
    g = grad_full.index_select(-1, torch.clamp(ids, min=0))
    return torch.where(_active(cursor, ids.numel()), g, torch.zeros((), dtype=g.dtype, device=g.device))


def _topk_grad(ids, cursor, tokens, grad_values, grad_tokens):
    if grad_values is None:
        return None
    # The slot of each selected token; padding entries (inactive ids) match no slot.
    hit = (tokens.unsqueeze(-1) == ids) & _active(cursor, ids.numel())
    return (grad_values.unsqueeze(-1) * hit.to(grad_values.dtype)).sum(-2)


def _register_gradient(op: str, saved: tuple[str, ...], grad_of_first: Callable, save_tokens: bool = False) -> None:
    """Autograd of ``op``: ``grad_of_first(*saved inputs[, selected tokens], *output grads)`` is the gradient of its
    first input (x or the logits); every other input gets None. ``saved`` names inputs as the schema declares them."""
    names = arguments(op)

    def setup(ctx, inputs, output):
        given = dict(zip(names, inputs))
        ctx.per_request = given["rows"] is not None
        ctx.save_for_backward(*(given[n] for n in saved), *((output[1],) if save_tokens else ()))

    def backward(ctx, *grads):
        _shared_only(ctx)
        return (grad_of_first(*ctx.saved_tensors, *grads),) + (None,) * (len(names) - 1)

    torch.library.register_autograd(f"nanospec::{op}", backward, setup_context=setup)


_register_gradient("compact_logits", ("cache_w", "cursor"),
                   lambda cache_w, cursor, grad: _grad_x(grad, cache_w, cursor))
_register_gradient("head_logits", ("cache_w", "ids", "cursor"),
                   lambda cache_w, ids, cursor, grad: _grad_x(_gather_slots(grad, ids, cursor), cache_w, cursor))
_register_gradient("scatter_logits", ("ids", "cursor"), lambda ids, cursor, grad: _gather_slots(grad, ids, cursor))
_register_gradient("compact_topk", ("ids", "cursor"), _topk_grad, save_tokens=True)

__all__ = [
    "observe", "compact_logits", "scatter_logits", "head_logits", "compact_topk", "compact_argmax",
    "reference", "USES_TRITON_OP",
]
