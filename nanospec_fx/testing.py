"""Check a drafter against the nanospec contract (docs/testing.md) in your own CI.

    from nanospec_fx.testing import assert_equivalent
    assert_equivalent(drafter.eval(), (input_ids,))

compiles the drafter with nanospec, runs it and the eager drafter on the same inputs, and raises
``AssertionError`` naming the output, the number of mismatches and the largest error if the
compiled drafter breaks the contract. :func:`active_sets` and :func:`token_ids` are hypothesis
strategies for property tests (hypothesis is only imported when they are called).

For speculative *sampling*, :func:`assert_same_distribution` compares generated token sequences
with the target's exact distribution (:func:`sequence_distribution`) or with samples of the target
alone, by a chi-square test at a fixed significance (docs/sampling.md).
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

from nanospec_fx.lookup import active_vocab
from nanospec_fx.module_heads import registered_states, unwrap
from nanospec_fx.state import ActiveVocab

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
            where ``mask`` is bool ``[V]``. Needed for drafters that run softmax/top-k/argmax
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
            from nanospec_fx.diagnosis import diagnose

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
        masks = {name: state.contains(torch.arange(state.vocab_size, device=state.ids.device))
                 for name, state in states.items()}
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
            heads = {n: m for n, m in masks.items() if _is_logits(e, states[n].vocab_size)}
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

    nanospec = True  # a nanospec backend (nanospec_fx.diagnosis reads it)

    def __init__(self, options: dict):
        self.options, self.compiles = dict(options), 0

    def __call__(self, gm, example_inputs, **_):
        from nanospec_fx.backend import nanospec_backend

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
    from nanospec_fx.diagnosis import argument_heads, diagnose

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
    bad = ~same_inf & ~(err <= atol + rtol * e.abs())  # NaN errors count as mismatches
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


# --------------------------------------------------------------------------- distributions
# Lossless speculative *sampling* cannot be checked sample by sample: it is a claim about a
# distribution. These helpers compare the tokens a sampler generates with the target's exact
# distribution (or with samples of the target alone) by a chi-square test at a fixed significance.
@dataclass(frozen=True)
class ChiSquareResult:
    """A chi-square test of generated token sequences.

    ``p_value`` is the probability, for a sampler that *is* distributed as the reference, of a
    statistic at least this large; the test rejects when it is below ``alpha``, so ``alpha`` is its
    false-alarm rate (with a fixed seed the outcome is deterministic). ``impossible`` counts samples
    in cells of reference probability 0 (a token the target can never produce there): any makes
    the test reject, whatever the statistic.
    """

    statistic: float
    dof: int
    p_value: float
    num_samples: int
    num_cells: int
    alpha: float
    impossible: int = 0

    @property
    def rejected(self) -> bool:
        return self.impossible > 0 or self.p_value < self.alpha

    def __str__(self) -> str:
        verdict = "differs from" if self.rejected else "is consistent with"
        extra = f", {self.impossible} samples of probability 0" if self.impossible else ""
        return (f"the sample {verdict} the reference: chi2 = {self.statistic:.2f}, dof = {self.dof}, "
                f"p = {self.p_value:.3g} (alpha = {self.alpha:g}), {self.num_samples} samples in "
                f"{self.num_cells} cells{extra}")


def chi2_sf(statistic: float, dof: int) -> float:
    """Survival function of the chi-square distribution: ``Q(dof / 2, statistic / 2)`` (no scipy needed)."""
    if dof <= 0:
        return 1.0
    x = torch.tensor(statistic / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), x))


def sequence_cells(samples: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Cell index of each sampled sequence: ``samples [N, L]`` (or ``[N]``) -> ``[N]`` in ``[0, V**L)``."""
    samples = torch.as_tensor(samples).long().cpu()
    if samples.dim() == 1:
        samples = samples[:, None]
    if samples.dim() != 2:
        raise ValueError(f"samples must be [N] or [N, L] token ids, got shape {tuple(samples.shape)}")
    if samples.numel() and (samples.min() < 0 or samples.max() >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {int(samples.min())}..{int(samples.max())}")
    weights = vocab_size ** torch.arange(samples.shape[1] - 1, -1, -1, dtype=torch.int64)
    return (samples * weights).sum(-1)


def _pool(observed: list[torch.Tensor], expected: list[torch.Tensor], min_expected: float):
    """Group cells so that each group is expected at least ``min_expected`` times.

    Cells are taken in increasing order of expected count and grouped greedily until a group is
    large enough (a leftover group joins the last one). The grouping depends on the expected counts
    only, never on the observed ones, so the test stays valid; cells of expected 0 join a group.
    """
    weight = torch.stack(expected).min(0).values
    order = weight.argsort()
    group = torch.empty_like(order)
    current, acc = 0, 0.0
    for cell, w in zip(order.tolist(), weight[order].tolist()):
        group[cell] = current
        acc += w
        if acc >= min_expected:
            current, acc = current + 1, 0.0
    leftover = bool((group == current).any())  # the last cells, expected fewer than min_expected times
    if leftover and current > 0:
        group[group == current] = current - 1
    groups = max(current, 1)
    pooled_o = [torch.zeros(groups, dtype=torch.float64).index_add_(0, group, o.double()) for o in observed]
    pooled_e = [torch.zeros(groups, dtype=torch.float64).index_add_(0, group, e.double()) for e in expected]
    return pooled_o, pooled_e


def chi_square_test(samples: torch.Tensor, probs: torch.Tensor, *, alpha: float = 1e-3,
                    min_expected: float = 5.0) -> ChiSquareResult:
    """Goodness of fit of sampled sequences to their exact distribution.

    Args:
        samples: ``[N, L]`` (or ``[N]``) generated token ids, one sequence per row.
        probs: the exact joint distribution, shape ``[V] * L`` (e.g. from :func:`sequence_distribution`).
        alpha: the significance, i.e. the false-alarm rate of a correct sampler.
        min_expected: cells expected fewer times are pooled (the chi-square approximation needs ~5).
    """
    probs = torch.as_tensor(probs, dtype=torch.float64).cpu()
    vocab_size = probs.shape[-1]
    cells = sequence_cells(samples, vocab_size)
    length = 1 if torch.as_tensor(samples).dim() == 1 else torch.as_tensor(samples).shape[1]
    if probs.dim() != length or any(s != vocab_size for s in probs.shape):
        raise ValueError(f"probs must have shape [V] * L = {[vocab_size] * length}, got {list(probs.shape)}")
    flat = probs.flatten() / probs.sum()
    n = cells.numel()
    observed = torch.bincount(cells, minlength=flat.numel()).double()
    impossible = int(observed[flat == 0].sum())
    (o,), (e,) = _pool([observed], [flat * n], min_expected)
    statistic = float(((o - e) ** 2 / e).sum())
    dof = o.numel() - 1
    return ChiSquareResult(statistic, dof, chi2_sf(statistic, dof), n, o.numel(), alpha, impossible)


def two_sample_chi_square_test(samples: torch.Tensor, reference_samples: torch.Tensor, vocab_size: int, *,
                               alpha: float = 1e-3, min_expected: float = 5.0) -> ChiSquareResult:
    """Chi-square test of homogeneity: were two sets of sampled sequences drawn from one distribution?

    For targets too large for :func:`sequence_distribution`: compare speculative samples with
    samples of the target alone (``reference_samples``), ``[N, L]`` and ``[M, L]`` token ids.
    """
    a, b = sequence_cells(samples, vocab_size), sequence_cells(reference_samples, vocab_size)
    cells = torch.cat([a, b]).unique()
    count_a = (a[:, None] == cells).sum(0).double()
    count_b = (b[:, None] == cells).sum(0).double()
    n_a, n_b = a.numel(), b.numel()
    total = count_a + count_b
    expected_a, expected_b = total * n_a / (n_a + n_b), total * n_b / (n_a + n_b)
    (oa, ob), (ea, eb) = _pool([count_a, count_b], [expected_a, expected_b], min_expected)
    statistic = float(((oa - ea) ** 2 / ea).sum() + ((ob - eb) ** 2 / eb).sum())
    dof = oa.numel() - 1
    return ChiSquareResult(statistic, dof, chi2_sf(statistic, dof), n_a + n_b, oa.numel(), alpha)


@torch.inference_mode()
def sequence_distribution(next_token_probs: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor,
                          length: int, *, max_cells: int = 1 << 20) -> torch.Tensor:
    """The exact joint distribution ``[V] * length`` of the next ``length`` tokens after ``prompt``.

    ``next_token_probs(ids [B, T]) -> [B, V]`` is the target's sampling distribution at the last
    position (after temperature/top-k/top-p). Every prefix is enumerated (``V ** (length - 1)``
    rows at the last step), so it is for tiny vocabularies: ``V ** length <= max_cells``.
    """
    prompt = torch.as_tensor(prompt).long().view(1, -1)
    joint, prefixes = torch.ones(1, dtype=torch.float64), prompt
    vocab_size = None
    for step in range(length):
        probs = next_token_probs(prefixes).double().cpu()
        vocab_size = probs.shape[-1]
        if vocab_size ** length > max_cells:
            raise ValueError(f"V ** length = {vocab_size}**{length} cells exceed max_cells={max_cells}; "
                             "use two_sample_chi_square_test with samples of the target alone")
        joint = (joint[:, None] * probs).flatten()
        if step + 1 < length:
            tokens = torch.arange(vocab_size, device=prefixes.device)
            prefixes = torch.cat([prefixes.repeat_interleave(vocab_size, 0),
                                  tokens.repeat(prefixes.shape[0])[:, None]], 1)
    return joint.view([vocab_size] * length)


def assert_same_distribution(samples: torch.Tensor, probs: torch.Tensor | None = None, *,
                             reference_samples: torch.Tensor | None = None, vocab_size: int | None = None,
                             alpha: float = 1e-3, min_expected: float = 5.0) -> ChiSquareResult:
    """Assert that sampled sequences follow the target's distribution; return the test's result.

    Give either ``probs`` (the exact distribution, :func:`chi_square_test`) or ``reference_samples``
    and ``vocab_size`` (samples of the target alone, :func:`two_sample_chi_square_test`). Raises
    ``AssertionError`` with the statistic and p-value when the test rejects at ``alpha``.
    """
    if (probs is None) == (reference_samples is None):
        raise ValueError("give exactly one of probs= (exact distribution) or reference_samples= (target samples)")
    if probs is not None:
        result = chi_square_test(samples, probs, alpha=alpha, min_expected=min_expected)
    else:
        if vocab_size is None:
            raise ValueError("reference_samples= needs vocab_size=")
        result = two_sample_chi_square_test(samples, reference_samples, vocab_size, alpha=alpha,
                                            min_expected=min_expected)
    if result.rejected:
        raise AssertionError(str(result))
    return result
