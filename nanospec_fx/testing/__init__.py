"""Check a drafter against the nanospec contract (docs/testing.md) in your own CI.

    from nanospec_fx.testing import assert_equivalent
    assert_equivalent(drafter.eval(), (input_ids,))

compiles the drafter with nanospec, runs it and the eager drafter on the same inputs, and raises
``AssertionError`` naming the output, the number of mismatches and the largest error if the
compiled drafter breaks the contract. This module holds that check (the contract helpers); its two
other jobs have a module each, their names importable from here:

- :mod:`nanospec_fx.testing.strategies`: :func:`active_sets` and :func:`token_ids`, hypothesis
  strategies for property tests (hypothesis is only imported when they are called);
- :mod:`nanospec_fx.testing.distribution`: for speculative *sampling*, :func:`assert_same_distribution`
  compares generated token sequences with the target's exact distribution (:func:`sequence_distribution`)
  or with samples of the target alone, by a chi-square test at a fixed significance (docs/sampling.md).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch._dynamo
import torch.nn as nn
from torch.utils import _pytree as pytree

from nanospec_fx.diagnostics.lookup import active_vocab
from nanospec_fx.vocab.module_heads import registered_states, unwrap
from nanospec_fx.vocab.state import ActiveVocab
# The strategies and the distribution tests, a module each (one job each), under the public names the docs use.
from nanospec_fx.testing.distribution import (
    ChiSquareResult, assert_same_distribution, chi2_sf, chi_square_test, sequence_cells, sequence_distribution,
    two_sample_chi_square_test,
)
from nanospec_fx.testing.strategies import active_sets, token_ids

TOLERANCES = {  # (rtol, atol): logits from a compact GEMM round differently from the full one
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 5e-2),
}

# The last compiled configuration, reused while the same drafter (unchanged) and options come back:
# hypothesis calls assert_equivalent once per example, and recompiling each time would be slow.
_last: "_Compiled | None" = None
# While the checker runs, Dynamo may compile this many graphs per function before it silently runs
# eager; every configuration is its own backend, and earlier ones (and the user's) stay cached.
RECOMPILE_LIMIT = 256


def count_launches():
    """``with count_launches() as seen: step()``: the device work an eager step dispatches, for a budget in CI or a
    benchmark (``seen.launches``: Triton launches plus torch compute ops outside them, each one kernel launch on a
    GPU; ``seen.triton`` and ``seen.torch_ops`` name them). Views and allocations are not counted; a
    ``torch.ops.nanospec`` call counts what its body dispatches (:mod:`nanospec_fx.kernels.launch_count`)."""
    from nanospec_fx.kernels.launch_count import counting

    return counting()


def assert_equivalent(
    drafter: nn.Module,
    example_inputs: Any,
    *,
    options: dict | None = None,
    active_ids: torch.Tensor | Sequence[int] | None = None,
    reference: Callable[[torch.Tensor], Any] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    token_inputs: Sequence[int | str] | None = None,
    reset_dynamo: bool = False,
) -> ActiveVocab:
    """Assert that ``drafter`` compiled with nanospec keeps the correctness contract on ``example_inputs``.

    Args:
        drafter: the eager drafter (in eval mode, deterministic); not modified.
        example_inputs: a tensor, a tuple of positional arguments, or a dict of keyword arguments.
        options: nanospec options; ``inductor`` defaults to ``False`` here (fast), pass ``True`` to
            check the inductor-compiled drafter.
        active_ids: if given, the active set is reset to these ids before the checked call (the
            call then adds the input tokens, as it always does).
        reference: ``reference(mask)`` -> the eager outputs with inactive logits masked to -inf,
            where ``mask`` is bool ``[V]`` (a draft-vocabulary head, ``draft_to_target``: ``[R]``, one entry per
            head row, True where that row's target token is active). Needed for drafters that run softmax/top-k/argmax
            themselves: every output is then compared with it instead of with the eager drafter.
        rtol, atol: tolerance for floating outputs; by default per dtype (:data:`TOLERANCES`).
        token_inputs: positions (or keyword names) of the inputs holding token ids, which must
            all be active. By default every integer tensor input; pass this when the drafter
            also takes positions or attention masks.
        reset_dynamo: call ``torch._dynamo.reset()`` before compiling a new configuration (drops
            every compiled graph of the process, yours included); off by default.

    The check runs on a copy of the drafter (``copy.deepcopy``), compiled with its own backend for
    these options, so your drafter, its active vocabulary and your compiled wrappers are untouched.
    Returns the copy's :class:`ActiveVocab` after the checked call.

    A drafter with several heads over the vocabulary (Medusa heads, MTP depths with heads of their own; without
    ``options['head']`` nanospec rewrites each, with its own set) is checked whole: each head's set is given a
    token no other holds, and every logits row is checked against the set of the head that computed it (inactive
    tokens -inf, active ones equal to eager); the fed ids must be in every set. It then returns
    ``{head name: ActiveVocab}``, and ``reference`` receives ``{head name: mask}``.
    """
    options = {"inductor": False, **(options or {})}
    args, kwargs = _split_inputs(example_inputs)
    module = unwrap(drafter)
    checked = _compile(module, options, reset_dynamo)

    with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), _torch_trace_uncaptured():
        checked.compiled(*args, **kwargs)  # the first call creates the state
        if not checked.backend.compiles:
            global _last
            _last = None  # not reused: the next check compiles afresh
            from nanospec_fx.diagnostics.diagnosis import diagnose

            found = diagnose(checked.compiled)
            if found.skipped:  # a frame Dynamo skips: that cause alone, with its remedy (a reset would not help)
                raise AssertionError(f"Dynamo did not hand {type(module).__name__} to the nanospec backend, so "
                                     f"nothing was checked: {found.text()}")
            raise AssertionError(
                f"Dynamo did not hand {type(module).__name__} to the nanospec backend (it ran eager: a recompile "
                "limit, or a frame Dynamo skips), so nothing was checked; pass reset_dynamo=True or call "
                "torch._dynamo.reset() before the check"
            )
        states = _states_of(checked.module, options)
        if active_ids is not None:
            for state in states.values():
                state.reset()
                state.observe(torch.as_tensor(active_ids, dtype=torch.int64))
        elif len(states) > 1:
            _tell_apart(states)
        actual = checked.compiled(*args, **kwargs)
        masks = {name: state.contains(_logit_columns(state)) for name, state in states.items()}
        eager = _eager(module)(*args, **kwargs)
        expected = None
        if reference is not None:
            expected = reference(next(iter(masks.values())) if len(masks) == 1 else masks)

    _check_structure(actual, eager, "eager drafter")
    if expected is not None:
        _check_structure(actual, expected, "reference(mask)")
        for name, a, e in _leaves(actual, expected):
            _check_close(name, a, e, rtol, atol, "reference(mask)")
    else:
        for name, a, e in _leaves(actual, eager):
            heads = {n: m for n, m in masks.items() if _is_logits(e, m.numel())}
            if len(heads) == 1:
                _check_logits(name, a, e, next(iter(heads.values())), rtol, atol)
            elif heads:
                _check_rows_of_several_heads(name, a, e, heads, rtol, atol)
            else:
                _check_close(name, a, e, rtol, atol, "the eager drafter")
    if options.get("observe_inputs", True):
        for state in states.values():
            _check_inputs_active(state, args, kwargs, token_inputs)
    return next(iter(states.values())) if len(states) == 1 else states


# --------------------------------------------------------------------------- running
@contextlib.contextmanager
def _torch_trace_uncaptured():
    """Keep torch's structured trace log (``torch.__trace``, always at DEBUG, meant for ``TORCH_TRACE`` files
    only) out of other handlers while the check compiles: pytest attaches its log capture to every logger that
    does not propagate, so a user's test report would list a blank DEBUG line per compile event. Only that
    logger, only during the check; torch's own handlers (``TORCH_TRACE``) stay."""
    try:
        from torch._logging._internal import _is_torch_handler
    except ImportError:  # torch moved it: leave the logger alone
        yield
        return
    trace = logging.getLogger("torch.__trace")
    others = [h for h in trace.handlers if not _is_torch_handler(h)]
    for h in others:
        trace.removeHandler(h)
    try:
        yield
    finally:
        for h in others:
            trace.addHandler(h)


def _split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


class _Backend:
    """The nanospec backend with one configuration; a new object per configuration, so Dynamo never reuses
    another configuration's graphs for it (its cache entries are checked against the backend that made them)."""

    nanospec = True  # a nanospec backend (nanospec_fx.diagnostics.diagnosis reads it)

    def __init__(self, options: dict):
        self.options, self.compiles = dict(options), 0

    def __call__(self, gm, example_inputs, **_):
        from nanospec_fx.compiler.backend import nanospec_backend

        self.compiles += 1
        return nanospec_backend(gm, example_inputs, options=self.options)


@dataclass
class _Compiled:
    """One checked configuration: the user's drafter, a copy of it compiled with ``backend``, and the keys it was
    made for (what the options hold, by value, and the identity and version of the drafter's tensors)."""

    source: nn.Module
    key: Any
    tensors: Any
    module: nn.Module
    compiled: Callable
    backend: _Backend
    options: dict  # keeps the option objects keyed by identity alive, so their ids are not reused


def _compile(module: nn.Module, options: dict, reset_dynamo: bool = False) -> _Compiled:
    global _last
    key, tensors = options_key(options), _tensor_versions(module)
    if _last is not None and _last.source is module and _last.key == key and _last.tensors == tensors:
        return _last
    _last = None
    if reset_dynamo:
        torch._dynamo.reset()
    copy_ = _copy(module)
    backend = _Backend(options)
    _last = _Compiled(module, key, tensors, copy_, torch.compile(copy_, backend=backend), backend, dict(options))
    return _last


def _copy(module: nn.Module) -> nn.Module:
    """A deep copy to compile, detached from any ``module.compile()`` of the original (whose compiled
    ``_call_impl`` a deep copy would still call)."""
    try:
        copy_ = copy.deepcopy(module)
    except Exception as exc:  # noqa: BLE001 - say what to do, whatever the drafter holds
        raise TypeError(
            f"assert_equivalent checks a copy of the drafter, and copy.deepcopy({type(module).__name__}) failed: {exc}"
        ) from exc
    for sub in copy_.modules():
        if getattr(sub, "_compiled_call_impl", None) is not None:
            sub._compiled_call_impl = None
    return copy_


def _tensor_versions(module: nn.Module) -> tuple:
    """What changes when the drafter's parameters or buffers are replaced or written in place."""
    found = []
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        try:
            version = t._version
        except RuntimeError:  # an inference tensor has no version counter: compare its values
            version = _tensor_key(t)
        found.append((name, id(t), t.data_ptr(), version))
    return tuple(found)


def options_key(value: Any) -> Any:
    """A hashable key equal for two option values exactly when they configure the same compile: tensors and
    arrays by dtype, shape, device and bytes (never by their printout), containers item by item, plain values
    by type and value, any other object by identity."""
    if isinstance(value, torch.Tensor):
        return _tensor_key(value)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, np.ascontiguousarray(value).tobytes())
    if isinstance(value, dict):
        return ("dict", tuple(sorted(((repr(k), options_key(v)) for k, v in value.items()), key=lambda kv: kv[0])))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(options_key(v) for v in value))
    if isinstance(value, float):
        return ("float", value.hex())
    if value is None or isinstance(value, (bool, int, str, bytes, torch.dtype, torch.device, Path)):
        return (type(value).__name__, str(value) if isinstance(value, (torch.device, Path)) else value)
    return ("object", type(value).__qualname__, id(value))


def _tensor_key(t: torch.Tensor) -> tuple:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return ("tensor", str(t.dtype), tuple(t.shape), str(t.device), flat.view(torch.uint8).numpy().tobytes())


def _eager(module: nn.Module) -> Callable:
    """The eager call; a module compiled in place (``module.compile()``) compiles ``__call__`` only."""
    return module.forward if getattr(module, "_compiled_call_impl", None) is not None else module


def _states_of(module: nn.Module, options: dict) -> dict[str, ActiveVocab]:
    """``{name: state}`` of every head the check compiled with a state: one with ``options['head']``, else each head
    over the vocabulary that nanospec rewrote (Medusa heads, MTP depths with heads of their own), held by the module
    or given to its call (a ``head_weight`` argument)."""
    from nanospec_fx.diagnostics.diagnosis import argument_heads, diagnose

    head = options.get("head")
    for name in (head, f"{head}.weight") if head else ():
        try:
            return {name: active_vocab(module, head=name)}
        except (KeyError, LookupError):
            pass
    states = dict(registered_states(module))
    states.update({names[0]: state for state, names in argument_heads(module).items()})
    if states:
        return states
    raise AssertionError(f"nanospec did not rewrite a head of {type(module).__name__}: {diagnose(module).text()}")


def _tell_apart(states: dict[str, ActiveVocab]) -> None:
    """Give each head's set a token no other set holds (where capacity allows), so that every logits row can be told
    apart by the set it was computed over: the one whose inactive tokens are all -inf in it."""
    taken = torch.zeros(max(s.vocab_size for s in states.values()), dtype=torch.bool)
    for state in states.values():
        taken[: state.vocab_size] |= state.contains(torch.arange(state.vocab_size)).cpu()
    free = (~taken).nonzero().flatten().tolist()
    for state, token in zip(states.values(), free):
        if len(state) < state.capacity - state.num_pinned and token < state.vocab_size:
            state.observe(torch.tensor([token]))


def _check_rows_of_several_heads(name: str, actual: torch.Tensor, eager: torch.Tensor,
                                 masks: dict[str, torch.Tensor], rtol, atol) -> None:
    """Logits of several heads over one vocabulary (stacked Medusa heads, MTP depths): each row is checked against
    the set of the head it was computed with, the one set whose every inactive token is -inf in that row."""
    rows_a, rows_e = actual.reshape(-1, actual.shape[-1]), eager.reshape(-1, eager.shape[-1])
    for i, (a, e) in enumerate(zip(rows_a, rows_e)):
        fits = [n for n, m in masks.items() if torch.isneginf(a[~m]).all()]
        if not fits:
            raise AssertionError(
                f"{name} row {i}: finite logits outside the set of every head ({', '.join(masks)}): "
                f"{int((~torch.isneginf(a)).sum())} finite, at most {max(int(m.sum()) for m in masks.values())} active")
        own = min(fits, key=lambda n: int(masks[n].sum()))  # the smallest set it fits: its own
        _check_close(f"{name} row {i} (active tokens of {own})", a[masks[own]], e[masks[own]], rtol, atol,
                     "the eager drafter")


# --------------------------------------------------------------------------- checks
def _leaves(actual: Any, expected: Any):
    """(name, actual leaf, expected leaf) pairs; names as in ``out[0]`` or ``out.logits``."""
    paths, _ = pytree.tree_flatten_with_path(expected)
    for (path, e), a in zip(paths, pytree.tree_leaves(actual)):
        yield "out" + pytree.keystr(path), a, e


def _check_structure(actual: Any, expected: Any, what: str) -> None:
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec, f"output structure differs from the {what}'s:\n  compiled: {a_spec}\n  expected: {e_spec}"
    for (name, a, e) in _leaves(actual, expected):
        if isinstance(e, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{name}: compiled gives {type(a).__name__}, {what} a tensor"
            assert a.shape == e.shape and a.dtype == e.dtype, (
                f"{name}: compiled is {tuple(a.shape)} {a.dtype}, {what} {tuple(e.shape)} {e.dtype}"
            )


def _logit_columns(state: ActiveVocab) -> torch.Tensor:
    """The token id of each column of the head's logits: a draft-vocabulary head's columns are its rows (row ``r``
    predicts target token ``draft_to_target[r]``), any other head's are the token ids ``0 .. V-1``."""
    if state.row_to_token is not None:
        return state.row_to_token
    return torch.arange(state.vocab_size, device=state.ids.device)


def _is_logits(t: Any, vocab_size: int) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0 and t.shape[-1] == vocab_size


def _tolerance(dtype: torch.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    default_rtol, default_atol = TOLERANCES.get(dtype, (0.0, 0.0))
    return (default_rtol if rtol is None else rtol, default_atol if atol is None else atol)


def _check_logits(name: str, actual: torch.Tensor, eager: torch.Tensor, mask: torch.Tensor, rtol, atol) -> None:
    """Active entries equal eager within tolerance; inactive ones are exactly -inf."""
    inactive = actual[..., ~mask]
    wrong = ~torch.isneginf(inactive)
    if wrong.any():
        raise AssertionError(
            f"{name}: {int(wrong.sum())} of {inactive.numel()} inactive logits are not -inf "
            f"(e.g. {inactive[wrong][0].item()!r}); if the drafter applies softmax or similar after the head, "
            "pass reference=..."
        )
    _check_close(f"{name} (active tokens)", actual[..., mask], eager[..., mask], rtol, atol, "the eager drafter")


def _check_close(name: str, actual: Any, expected: Any, rtol, atol, what: str) -> None:
    if not isinstance(expected, torch.Tensor):
        if type(expected).__eq__ is object.__eq__:  # e.g. a KV cache object: equal by identity only
            assert type(actual) is type(expected), (
                f"{name}: compiled gives {type(actual).__name__}, {what} {type(expected).__name__}")
        else:
            assert actual == expected, f"{name}: compiled gives {actual!r}, {what} {expected!r}"
        return
    if not expected.is_floating_point():
        bad = actual != expected
        assert not bad.any(), (
            f"{name}: {int(bad.sum())} of {expected.numel()} entries differ from {what} "
            f"(first at index {tuple(bad.nonzero()[0].tolist())}: {actual[bad][0].item()} vs {expected[bad][0].item()})"
            + ("; if the drafter picks token ids itself (argmax, top-k, sampling), the compiled one picks among "
               "active tokens only: pass reference=lambda mask: ... (its outputs with inactive logits at -inf)"
               if what == "the eager drafter" else "")
        )
        return
    rtol, atol = _tolerance(expected.dtype, rtol, atol)
    a, e = actual.double(), expected.double()
    same_inf = (a == e)  # equal infinities (and exact matches)
    err = torch.where(same_inf, torch.zeros_like(a), (a - e).abs())
    # an infinite expectation is met only exactly (its rtol bound is inf: a finite logit for a -inf one would pass);
    # NaN errors count as mismatches
    bad = ~same_inf & (e.isinf() | ~(err <= atol + rtol * e.abs()))
    if bad.any():
        err = torch.where(bad, err.nan_to_num(nan=float("inf")), torch.zeros_like(err))
        worst = err.argmax()
        index = tuple(int(i) for i in torch.unravel_index(worst, err.shape))
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {expected.numel()} entries differ from {what} "
            f"(max abs error {err.flatten()[worst].item():.3g} at index {index}: "
            f"{a.flatten()[worst].item()!r} vs {e.flatten()[worst].item()!r}; rtol={rtol}, atol={atol}); "
            "a drafter that is not deterministic (dropout: pass drafter.eval(); random sampling inside) differs "
            "from itself, and a low-precision head may need a wider rtol=/atol=; otherwise the compiled drafter "
            "breaks the contract"
        )


def _check_inputs_active(state: ActiveVocab, args: tuple, kwargs: dict, token_inputs) -> None:
    """Every token id fed to the drafter is active, unless there are more than the ring can hold."""
    if token_inputs is None:
        named = [*enumerate(args), *kwargs.items()]
        chosen = [(k, v) for k, v in named if _is_token_tensor(v)]
    else:
        chosen = [(k, args[k] if isinstance(k, int) else kwargs[k]) for k in token_inputs]
    for key, ids in chosen:
        unique = torch.unique(ids.to(state.ids.device))
        if state.token_to_row is not None:  # a draft vocabulary: only the fed ids its head has a row for can join
            unique = unique[state.rows_of(unique) >= 0]
        if unique.numel() > state.capacity - state.num_pinned:
            assert len(state) == state.capacity, (
                f"input {key!r}: {unique.numel()} distinct tokens exceed the capacity, yet the set is not full"
            )
            continue
        missing = unique[~state.contains(unique)]
        assert missing.numel() == 0, (
            f"input {key!r}: {missing.numel()} of {unique.numel()} distinct token ids are not active "
            f"(e.g. {missing[:5].tolist()}); every token fed to the drafter must join the active vocabulary"
            + ("" if token_inputs is not None else
               f"; if input {key!r} holds no token ids (positions, an attention mask), pass token_inputs= naming "
               "the inputs that do")
        )


def _is_token_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and not v.is_floating_point() and not v.is_complex() and v.dtype != torch.bool


__all__ = [
    "TOLERANCES", "RECOMPILE_LIMIT", "assert_equivalent", "count_launches", "options_key",
    "active_sets", "token_ids",
    "ChiSquareResult", "assert_same_distribution", "chi2_sf", "chi_square_test", "sequence_cells",
    "sequence_distribution", "two_sample_chi_square_test",
]
