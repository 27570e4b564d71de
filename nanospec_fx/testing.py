"""Check a drafter against the nanospec contract (docs/testing.md) in your own CI.

    from nanospec_fx.testing import assert_equivalent
    assert_equivalent(drafter.eval(), (input_ids,))

compiles the drafter with nanospec, runs it and the eager drafter on the same inputs, and raises
``AssertionError`` naming the output, the number of mismatches and the largest error if the
compiled drafter breaks the contract. :func:`active_sets` and :func:`token_ids` are hypothesis
strategies for property tests (hypothesis is only imported when they are called).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch._dynamo
import torch.nn as nn
from torch.utils import _pytree as pytree

from nanospec_fx.state import ActiveVocab, active_vocab

TOLERANCES = {  # (rtol, atol): logits from a compact GEMM round differently from the full one
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 5e-2),
}

# The last compiled drafter, reused while the same module and options come back (hypothesis
# calls assert_equivalent once per example; recompiling each time would be slow, and Dynamo
# silently falls back to eager after too many recompiles of one function).
_last: tuple[nn.Module, str, nn.Module] | None = None


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
            where ``mask`` is bool ``[V]``. Needed for drafters that run softmax/top-k/argmax
            themselves: every output is then compared with it instead of with the eager drafter.
        rtol, atol: tolerance for floating outputs; by default per dtype (:data:`TOLERANCES`).
        token_inputs: positions (or keyword names) of the inputs holding token ids, which must
            all be active. By default every integer tensor input; pass this when the drafter
            also takes positions or attention masks.

    Returns the drafter's :class:`ActiveVocab` after the checked call. Compiling a new drafter
    calls ``torch._dynamo.reset()``, as between tests.
    """
    options = {"inductor": False, **(options or {})}
    args, kwargs = _split_inputs(example_inputs)
    module = getattr(drafter, "_orig_mod", drafter)
    compiled = _compile(module, options)

    with torch.inference_mode():
        compiled(*args, **kwargs)  # the first call creates the state
        state = _state_of(module, options)
        if active_ids is not None:
            state.reset()
            state.observe(torch.as_tensor(active_ids, dtype=torch.int64))
        actual = compiled(*args, **kwargs)
        mask = state.contains(torch.arange(state.vocab_size, device=state.ids.device))
        eager = _eager(module)(*args, **kwargs)
        expected = reference(mask) if reference is not None else None

    _check_structure(actual, eager, "eager drafter")
    if expected is not None:
        _check_structure(actual, expected, "reference(mask)")
        for name, a, e in _leaves(actual, expected):
            _check_close(name, a, e, rtol, atol, "reference(mask)")
    else:
        for name, a, e in _leaves(actual, eager):
            if _is_logits(e, state.vocab_size):
                _check_logits(name, a, e, mask, rtol, atol)
            else:
                _check_close(name, a, e, rtol, atol, "the eager drafter")
    if options.get("observe_inputs", True):
        _check_inputs_active(state, args, kwargs, token_inputs)
    return state


# --------------------------------------------------------------------------- running
def _split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _compile(module: nn.Module, options: dict) -> nn.Module:
    global _last
    key = repr(sorted(options.items()))
    if _last is not None and _last[0] is module and _last[1] == key:
        return _last[2]
    torch._dynamo.reset()
    compiled = torch.compile(module, backend="nanospec", options=dict(options))
    _last = (module, key, compiled)
    return compiled


def _eager(module: nn.Module) -> Callable:
    """The eager call; a module compiled in place (``module.compile()``) compiles ``__call__`` only."""
    return module.forward if getattr(module, "_compiled_call_impl", None) is not None else module


def _state_of(module: nn.Module, options: dict) -> ActiveVocab:
    head = options.get("head")
    try:
        return active_vocab(module)
    except LookupError as exc:
        for name in (head, f"{head}.weight") if head else ():
            try:
                return active_vocab(module, head=name)
            except KeyError:
                pass
        raise AssertionError(
            f"nanospec did not rewrite a head of {type(module).__name__} ({exc}); "
            "see the NanoSpecWarning of the compile for why"
        ) from None


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
            assert type(actual) is type(expected), f"{name}: compiled gives {type(actual).__name__}, {what} {type(expected).__name__}"
        else:
            assert actual == expected, f"{name}: compiled gives {actual!r}, {what} {expected!r}"
        return
    if not expected.is_floating_point():
        bad = actual != expected
        assert not bad.any(), (
            f"{name}: {int(bad.sum())} of {expected.numel()} entries differ from {what} "
            f"(first at index {tuple(bad.nonzero()[0].tolist())}: {actual[bad][0].item()} vs {expected[bad][0].item()})"
        )
        return
    rtol, atol = _tolerance(expected.dtype, rtol, atol)
    a, e = actual.double(), expected.double()
    same_inf = (a == e)  # equal infinities (and exact matches)
    err = torch.where(same_inf, torch.zeros_like(a), (a - e).abs())
    bad = ~same_inf & ~(err <= atol + rtol * e.abs())  # NaN errors count as mismatches
    if bad.any():
        err = torch.where(bad, err.nan_to_num(nan=float("inf")), torch.zeros_like(err))
        worst = err.argmax()
        index = tuple(int(i) for i in torch.unravel_index(worst, err.shape))
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {expected.numel()} entries differ from {what} "
            f"(max abs error {err.flatten()[worst].item():.3g} at index {index}: "
            f"{a.flatten()[worst].item()!r} vs {e.flatten()[worst].item()!r}; rtol={rtol}, atol={atol})"
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
        if unique.numel() > state.capacity - state.num_pinned:
            assert len(state) == state.capacity, (
                f"input {key!r}: {unique.numel()} distinct tokens exceed the capacity, yet the set is not full"
            )
            continue
        missing = unique[~state.contains(unique)]
        assert missing.numel() == 0, (
            f"input {key!r}: {missing.numel()} of {unique.numel()} distinct token ids are not active "
            f"(e.g. {missing[:5].tolist()}); every token fed to the drafter must join the active vocabulary"
        )


def _is_token_tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and not v.is_floating_point() and not v.is_complex() and v.dtype != torch.bool


# --------------------------------------------------------------------------- hypothesis
def active_sets(vocab_size: int, max_size: int, min_size: int = 0):
    """Strategy: a 1-D int64 tensor of distinct token ids in ``[0, vocab_size)``."""
    from hypothesis import strategies as st

    ids = st.lists(st.integers(0, vocab_size - 1), min_size=min_size, max_size=min(max_size, vocab_size), unique=True)
    return ids.map(lambda xs: torch.tensor(xs, dtype=torch.int64))


def token_ids(vocab_size: int, shape):
    """Strategy: an int64 tensor of token ids in ``[0, vocab_size)``; ``shape`` is a tuple or a strategy of tuples."""
    from hypothesis import strategies as st

    def of_shape(dims: tuple[int, ...]):
        n = 1
        for d in dims:
            n *= d
        values = st.lists(st.integers(0, vocab_size - 1), min_size=n, max_size=n)
        return values.map(lambda xs: torch.tensor(xs, dtype=torch.int64).reshape(dims))

    if isinstance(shape, st.SearchStrategy):
        return shape.flatmap(lambda dims: of_shape(tuple(dims)))
    return of_shape(tuple(shape))
