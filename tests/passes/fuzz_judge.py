"""The pass fuzzer's judge: a drawn drafter (a ``fuzz_drafters.Recipe``) or a schedule of several (a ``Scenario``)
compiled with ``backend="nanospec"`` and each call judged against the masked dense oracle (tests/passes/
test_pass_fuzzer.py draws the cases; test_pass_fuzzer_regressions.py replays the ones that once failed).

``run_case`` / ``run_scenario`` return the verdict ("matched", or "dense (...)" after a ``NanoSpecWarning`` with the
dense drafter's output) and raise ``Mismatch`` (an AssertionError naming the recipe) on anything else."""
from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch
import torch._dynamo
from hypothesis import assume

import nanospec_fx
from fuzz_drafters import GRAD_MODES, FuzzDrafter, Recipe, bad_inputs, compute_dtype, make_inputs
from helpers import compile_nanospec
from nanospec_fx.diagnostics.warning import NanoSpecWarning
from nanospec_fx.vocab import reports as pass_reports
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 5e-2)}


class Mismatch(AssertionError):
    pass


# ----------------------------------------------------------------------------- comparisons
def _close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: tuple[float, float]) -> None:
    """Equal within ``tol``; infinities (and NaNs) must be the same."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise Mismatch(f"{name}: compiled {tuple(actual.shape)} {actual.dtype}, "
                       f"expected {tuple(expected.shape)} {expected.dtype}")
    if not expected.is_floating_point():
        bad = actual != expected
        if bad.any():
            raise Mismatch(f"{name}: {int(bad.sum())}/{bad.numel()} entries differ "
                           f"(e.g. {actual[bad][:3].tolist()} vs {expected[bad][:3].tolist()})")
        return
    rtol, atol = tol
    a, e = actual.double(), expected.double()
    same = (a == e) | (a.isnan() & e.isnan())
    bad = ~same & ~(torch.isfinite(e) & ((a - e).abs() <= atol + rtol * e.abs()))  # infinities must be equal
    if bad.any():
        i = bad.nonzero()[0].tolist()
        raise Mismatch(f"{name}: {int(bad.sum())}/{bad.numel()} entries differ, "
                       f"e.g. at {i}: compiled {a[tuple(i)].item()!r} "
                       f"vs expected {e[tuple(i)].item()!r}")


def _check_selection(name, x, vals, idx, k, largest, tol) -> None:
    """Top-k of the oracle's input ``x`` (inactive tokens already -inf there where the contract says so), up to ties:
    the values equal ``x``'s top-k values (infinities exactly), ``x`` at each returned id equals the returned value,
    and no id repeats within a row."""
    width = x.shape[-1]
    if idx.dtype != torch.int64:
        raise Mismatch(f"{name}: indices are {idx.dtype}")
    valid = (idx >= 0) & (idx < width)
    if not valid.all():
        raise Mismatch(f"{name}: ids outside [0, {width}): {idx[~valid][:5].tolist()}")
    expected = x.float().topk(min(k, width), dim=-1, largest=largest).values
    at = x.float().gather(-1, idx)
    got = vals.float() if vals is not None else at
    rtol, atol = tol

    def near(a, b):
        return (a == b) | (a.isnan() & b.isnan()) | (torch.isfinite(b) & ((a - b).abs() <= atol + rtol * b.abs()))
    ok = near(got, expected)
    if not ok.all():
        raise Mismatch(f"{name}: selected values {got[~ok][:4].tolist()} vs expected {expected[~ok][:4].tolist()} "
                       f"(k={k}, largest={largest})")
    ok = near(at, got)
    if not ok.all():
        raise Mismatch(f"{name}: the value at a selected id is not the selected value "
                       f"(ids {idx[~ok][:4].tolist()}: {at[~ok][:4].tolist()} vs {got[~ok][:4].tolist()})")
    rows = idx.reshape(-1, idx.shape[-1]) if idx.dim() else idx.reshape(1, 1)
    for r in rows:
        if r.unique().numel() != r.numel():
            raise Mismatch(f"{name}: duplicate selected ids {r.tolist()}")


def _check_output(name, out, kind, source, params, tol) -> None:
    """``out``: the compiled output; ``source``: (the eager output, the tensor a selection read) for ``kind``."""
    expected, x = source
    if kind == "values":
        _close(name, out, expected, tol)
        return
    if kind == "topk":
        k, largest = params
        if out[0].dtype != expected[0].dtype or out[0].shape != expected[0].shape:
            raise Mismatch(f"{name}: top-k values {tuple(out[0].shape)} {out[0].dtype} "
                           f"vs {tuple(expected[0].shape)} {expected[0].dtype}")
        _check_selection(name, x, out[0], out[1], k, largest, tol)
    elif kind == "max":
        _close(f"{name}.values", out[0], expected[0], tol)
        _check_selection(name, x, out[0].unsqueeze(-1), out[1].unsqueeze(-1), 1, True, tol)
    elif kind == "argmax":
        if out.shape != expected.shape or out.dtype != expected.dtype:
            raise Mismatch(f"{name}: argmax {tuple(out.shape)} {out.dtype} vs {tuple(expected.shape)} {expected.dtype}")
        _check_selection(name, x, None, out.unsqueeze(-1), 1, True, tol)
    elif kind == "sort":  # a plain sort of x, up to ties
        vals, idx = out
        _close(f"{name}.values", vals, expected[0], tol)
        if not torch.equal(idx.sort(-1).values, torch.arange(x.shape[-1]).expand_as(idx)):
            raise Mismatch(f"{name}: sort indices are not a permutation of the vocabulary")
        _close(f"{name}: x at the sorted ids", x.gather(-1, idx), vals, tol)
    elif kind == "sample":  # x: the probabilities sampled from; any id of positive probability
        if out.shape != expected.shape:
            raise Mismatch(f"{name}: samples {tuple(out.shape)} vs {tuple(expected.shape)}")
        if not ((out >= 0) & (out < x.shape[-1])).all():
            raise Mismatch(f"{name}: sampled ids outside the vocabulary: {out.flatten().tolist()}")
        # Rows whose probabilities are not numbers (the program divides inf by inf, e.g. softmax over -log_softmax
        # of masked logits) define no distribution: there the sample must be the oracle's own IEEE result.
        undefined = x.isnan().any(-1, keepdim=True).expand_as(out)
        if not torch.equal(out[undefined], expected[undefined]):
            raise Mismatch(f"{name}: samples from NaN probabilities {out[undefined].tolist()} vs the oracle's "
                           f"{expected[undefined].tolist()}")
        p = x.gather(-1, out)
        if not ((p > 0) | undefined).all():
            raise Mismatch(f"{name}: sampled ids {out[(p <= 0) & ~undefined].tolist()} have probability 0")
    else:
        raise AssertionError(kind)


def _compare(outputs, expected, record, tol, what: str) -> None:
    single = len(record) == 1  # a lone top-k/sort/max output is itself a tuple
    outs = (outputs,) if single or not isinstance(outputs, tuple) else outputs
    exps = (expected,) if single or not isinstance(expected, tuple) else expected
    if len(outs) != len(exps) or len(exps) != len(record):
        raise Mismatch(f"{what}: {len(outs)} outputs, expected {len(exps)}")
    for i, (out, exp, (kind, x, params)) in enumerate(zip(outs, exps, record)):
        _check_output(f"{what} out[{i}] ({kind})", out, kind, (exp, x), params, tol)


# ----------------------------------------------------------------------------- running one case
def _context(recipe: Recipe):
    stack = contextlib.ExitStack()
    if recipe.mode == "inference":
        stack.enter_context(torch.inference_mode())
    elif recipe.mode in ("no_grad", "enable_grad_inside"):
        stack.enter_context(torch.no_grad())
    if recipe.autocast:
        stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
    return stack


def _eager(model, inputs, recipe, mask=None):
    record: list = []
    with _context(recipe):
        torch.manual_seed(recipe.seed)
        out = model(**inputs, _mask=mask, _record=record)
    return out, record


def _float_outputs(out, kinds):
    """The float outputs a loss may use: values, and the values of max / top-k largest."""
    outs = (out,) if len(kinds) == 1 or not isinstance(out, tuple) else out
    flat = []
    for o, (kind, _, params) in zip(outs, kinds):
        if kind == "values":
            flat.append(o)
        elif kind == "max" or (kind == "topk" and params[1]):
            flat.append(o[0])
    return [o for o in flat if o.is_floating_point() and o.requires_grad]


def _backward(model, out, recipe, kinds) -> dict:
    """Gradients of a fixed weighted sum of the finite float outputs w.r.t. the trainable parameters."""
    model.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(recipe.seed)
    loss = 0.0
    for o in _float_outputs(out, kinds):
        w = torch.rand(o.shape, generator=g)
        loss = loss + (torch.where(torch.isfinite(o), o, torch.zeros_like(o)).float() * w).sum()
    if isinstance(loss, float):
        return {}
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def _state(model):
    try:  # with extra heads (several states) the head's is asked for by its weight
        return nanospec_fx.active_vocab(model.head_weight() if model.recipe.extra_heads else model)
    except LookupError:
        return None


def _extra_states(model) -> list:
    """The state of each extra head (several-heads block), None where it has none or none of its graphs ran."""
    states = []
    weights = [head.weight for head in model.extra_heads] + ([model.stacked_W] if model.recipe.stacked else [])
    for weight in weights:  # stacked heads: one weight, one state (one set for the K heads)
        try:
            state = nanospec_fx.active_vocab(weight)
        except LookupError:
            state = None
        states.append(state if state is not None and pass_reports.reports(state) else None)
    return states


def _fed_ids_active(state, ids) -> None:
    ids = ids[ids < state.vocab_size].unique()
    if ids.numel() > state.capacity - state.num_pinned:
        if len(state) != state.capacity:
            raise Mismatch(f"{ids.numel()} distinct ids fed, more than the capacity {state.capacity}, "
                           f"but only {len(state)} are active")
        return
    missing = ids[~state.contains(ids)]
    if missing.numel():
        raise Mismatch(f"ids fed to the drafter are not active: {missing[:8].tolist()}")


def _snapshot(model) -> dict:
    with torch.no_grad():
        return {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}


@dataclasses.dataclass
class Judgement:
    """What the calls of one case showed: differences from the oracle and from the dense drafter, warnings.

    Judged call by call: a call is right when it equals the oracle, or when a warning was given by then and it
    equals the dense drafter (a recompile may run one call rewritten and a later one dense with a warning)."""
    problems: list = dataclasses.field(default_factory=list)
    dense_problems: list = dataclasses.field(default_factory=list)
    warned: list = dataclasses.field(default_factory=list)
    calls: list = dataclasses.field(default_factory=list)  # per call: (oracle problems, dense problems, warned by then)

    def close_call(self, problems_before: int, dense_before: int) -> None:
        self.calls.append((self.problems[problems_before:], self.dense_problems[dense_before:], bool(self.warned)))

    def verdict(self, reproduce: str) -> str:
        if not self.problems:
            return "matched"
        wrong = [(p, d, w) for p, d, w in self.calls if p and (not w or d)]
        if not wrong:
            return f"dense (warned: {self.warned[0][:80]})"
        silent = any(not w for _, _, w in wrong)
        raise AssertionError(
            ("SILENT difference (no NanoSpecWarning)" if silent
             else "warned, but equals neither the oracle nor the dense drafter")
            + ":\n  " + "\n  ".join(q for p, d, w in wrong for q in p + [f"[dense] {x}" for x in d if w])
            + (f"\n  warnings: {self.warned}" if self.warned else "")
            + f"\nreproduce: {reproduce}"
        )


def _judge_call(judge: Judgement, model, compiled, twin, recipe: Recipe, inputs: dict, what: str,
                earlier_ids: torch.Tensor | None = None, prefill: bool = False):
    """One compiled call judged against the oracle (the eager ``twin`` from the same pre-call state, masked where
    the contract says) and against the plain dense eager drafter. Returns the ids the call embedded."""
    problems_before, dense_before = len(judge.problems), len(judge.dense_problems)
    try:
        return _judge_one_call(judge, model, compiled, twin, recipe, inputs, what, earlier_ids, prefill)
    finally:
        judge.close_call(problems_before, dense_before)


def _judge_one_call(judge: Judgement, model, compiled, twin, recipe: Recipe, inputs: dict, what: str,
                    earlier_ids: torch.Tensor | None, prefill: bool):
    tol = TOLERANCES[compute_dtype(recipe)]
    pre = _snapshot(model)
    before = int(model.calls)
    extra = {"prefill": True} if prefill else {}
    kinds: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with _context(recipe):
                torch.manual_seed(recipe.seed)
                out = compiled(**inputs, **extra)
            if recipe.mode in GRAD_MODES and not prefill:
                _, kinds = _eager(twin, inputs, recipe)
                grads = _backward(model, out, recipe, kinds)
            else:
                grads = None
        except Exception as exc:
            raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}") from exc
    judge.warned += [str(w.message) for w in caught if issubclass(w.category, NanoSpecWarning)]
    if "counter" in recipe.body and int(model.calls) != before + recipe.body.count("counter"):
        judge.problems.append(f"{what}: the body's buffer update ran {int(model.calls) - before} times")
        judge.dense_problems.append(judge.problems[-1])
    fed = model.fed_ids(inputs, None if prefill else out)
    want = fed if earlier_ids is None else torch.cat([earlier_ids, fed])
    extra = _extra_states(model)
    # each extra head masked by its own set where it was rewritten (in both oracles: its own state says so)
    twin.extra_masks = [s.contains(torch.arange(s.vocab_size)) if s is not None else None for s in extra]
    if not prefill:
        for i, s in enumerate(extra):
            try:
                if s is not None:
                    _fed_ids_active(s, want)
            except Mismatch as exc:
                judge.problems.append(f"{what}: extra head {i}: {exc}")

    def oracle(mask, label, problems):
        twin.load_state_dict(pre)
        try:
            if prefill:
                with _context(recipe):
                    expected, record = twin(**inputs, prefill=True), [("values", None, None)]
            else:
                expected, record = _eager(twin, inputs, recipe, mask)
            _compare(out, expected, record, tol, f"{what} vs {label}")
            if grads is not None:
                ref = _backward(twin, expected, recipe, kinds)
                for n in ref:
                    _close(f"{what} grad {n}", grads.get(n, torch.zeros_like(ref[n])), ref[n], (1e-4, 1e-4))
        except Mismatch as exc:
            problems.append(str(exc))

    state = _state(model)
    if state is None:
        if not prefill:
            judge.problems.append(f"{what}: no ActiveVocab reachable through nanospec_fx.active_vocab(model)")
    else:
        try:
            weight = model.head_weight()
            mapped = recipe.d2t == "option"  # token ids are target ids; head row i is target id draft_targets()[i]
            if state.vocab_size != (recipe.embed_rows if mapped else recipe.head_rows) or (
                    weight is not None and state.weight is not weight):
                raise Mismatch(f"{what}: the ActiveVocab is not the head's (its weight is {tuple(state.weight.shape)}, "
                               f"the head's {(recipe.head_rows, recipe.hidden)})")
            if mapped:  # fed target ids with no head row cannot be active
                targets = model.draft_targets()
                _fed_ids_active(state, want[torch.isin(want, targets)])
                oracle(state.contains(targets), "oracle", judge.problems)
            else:
                _fed_ids_active(state, want)
                oracle(state.contains(torch.arange(state.vocab_size)), "oracle", judge.problems)
        except Mismatch as exc:
            judge.problems.append(str(exc))
    oracle(None, "dense", judge.dense_problems)
    return fed


def _validate(twin, recipe: Recipe, inputs: dict) -> None:
    """The drafter must be a valid program in eager (forward and, with gradients, backward)."""
    try:
        out, kinds = _eager(twin, inputs, recipe)
        if recipe.mode in GRAD_MODES:
            _backward(twin, out, recipe, kinds)
    except Exception as exc:  # a recipe the generator should not have produced
        assume(False)
        raise AssertionError(exc)  # unreachable


def _compile_fresh(models: list, recipes: list, options: dict | None) -> list:
    """Each drafter compiled with its recipe's options, from a fresh Dynamo (``compile_nanospec``: one case is one
    hypothesis example, many in one pytest test)."""
    compiled = []
    for model, recipe in zip(models, recipes):
        extra = {}
        if recipe.d2t == "option":  # what the warning of a "buffer" recipe tells to pass
            extra = {"draft_to_target": model.draft_targets(), "target_vocab_size": recipe.embed_rows}
        compiled.append(compile_nanospec(model, **{"capacity": recipe.capacity, **extra, **(options or {})}))
    return compiled


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and values, NaN equal to NaN (a state's tensors before and after a call that must not change them)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.is_floating_point() else torch.equal(a, b)


def _judge_bad_call(judge: Judgement, model, compiled, twin, recipe: Recipe, reproduce: str) -> None:
    """A call with one invalid id after valid ones (``bad_inputs``) that eager rejects: whether the compiled call raises
    too or not (a compiled graph may skip reading an id it never needs), every state is exactly as it was before."""
    inputs = bad_inputs(recipe)
    twin.load_state_dict(_snapshot(model))
    try:
        _eager(twin, inputs, recipe)
        return  # eager runs it (``torch.take`` wraps a negative index): not a rejected call
    except Exception:  # noqa: BLE001 - the rejection this check is about
        pass
    states = [s for s in [_state(model), *_extra_states(model)] if s is not None]
    before = [[t.clone() for t in s.tensors()] for s in states]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with _context(recipe):
                torch.manual_seed(recipe.seed)
                compiled(**inputs)
        except Exception:  # noqa: BLE001 - eager raises too
            pass
    judge.warned += [str(w.message) for w in caught if issubclass(w.category, NanoSpecWarning)]
    for i, (s, snap) in enumerate(zip(states, before)):
        if not all(same_values(t, c) for t, c in zip(s.tensors(), snap)):
            raise AssertionError(f"SILENT: a call eager rejects ({recipe.bad_call} in {recipe.bad_at}) changed active "
                                 f"set {i} ({s!r})\nreproduce: {reproduce}")


def run_case(recipe: Recipe, options: dict | None = None) -> str:
    """Compile, call twice and judge ``recipe``: "matched" or "dense (warned: ...)". Raises on failure."""
    model, twin = FuzzDrafter(recipe), FuzzDrafter(recipe)
    calls = [make_inputs(recipe, 0), make_inputs(recipe, 1)]
    _validate(twin, recipe, calls[0])
    (compiled,) = _compile_fresh([model], [recipe], options)
    judge = Judgement()
    for call, inputs in enumerate(calls):
        try:
            _judge_call(judge, model, compiled, twin, recipe, inputs, f"call {call}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nreproduce: run_case({recipe!r})") from None
        if call == 0 and recipe.bad_call:
            _judge_bad_call(judge, model, compiled, twin, recipe, f"run_case({recipe!r})")
        state = _state(model)
        if call == 0 and state is not None and recipe.extra_active:
            g = torch.Generator().manual_seed(recipe.seed + 99)
            state.observe(torch.randint(0, min(recipe.vocab, state.vocab_size), (recipe.extra_active,), generator=g))
    return judge.verdict(f"run_case({recipe!r})")


# ------------------------------------------------------------------------- scenarios: several drafters in one process
@dataclasses.dataclass(frozen=True)
class Scenario:
    """Several drafters (one instance per recipe; recipes equal but for the seed are instances of one class) and
    a schedule of (drafter index, action): "call", "prefill" (embed the prompt, no head), "reset"
    (torch._dynamo.reset()), or "save:<how>" (torch_save, deepcopy, pickle, state_dict_keep_vars, weight)."""
    drafters: tuple
    schedule: tuple
    shared_embedding: bool = False  # every drafter whose table has drafter 0's shape uses drafter 0's nn.Embedding


SAVES = ("torch_save", "deepcopy", "pickle", "state_dict_keep_vars", "weight")


def _save(model, how: str) -> None:
    import copy
    import io
    import pickle

    if how == "torch_save":
        torch.save(model, io.BytesIO())
    elif how == "deepcopy":
        copy.deepcopy(model)
    elif how == "pickle":
        pickle.loads(pickle.dumps(model))
    elif how == "state_dict_keep_vars":
        torch.save(model.state_dict(keep_vars=True), io.BytesIO())
    else:
        w = model.head_weight()
        torch.save(w if w is not None else model.qweight, io.BytesIO())


def run_scenario(scenario: Scenario, options: dict | None = None) -> str:
    """Run ``scenario``'s schedule; each call is judged like a run_case call (fed ids: every id embedded by that
    drafter since the last reset must be active). Returns "matched" or "dense (warned: ...)"; raises on failure."""
    models = [FuzzDrafter(r) for r in scenario.drafters]
    twins = [FuzzDrafter(r) for r in scenario.drafters]
    if scenario.shared_embedding:
        _share_embedding(models)
        _share_embedding(twins)
    for twin, r in zip(twins, scenario.drafters):
        _validate(twin, r, make_inputs(r, 0))
    compiled = _compile_fresh(models, scenario.drafters, options)
    fed = [torch.zeros(0, dtype=torch.int64) for _ in models]
    n_calls = [0 for _ in models]
    # A warning about one drafter excuses none of the others, except drafters that share its head weight (a tied head
    # on a shared nn.Embedding): one head, one state, one warning naming it; a graph holding only shared tensors
    # cannot tell those drafters apart.
    by_head: dict[int, Judgement] = {}
    judges = []
    for m in models:
        w = m.head_weight()
        judges.append(by_head.setdefault(id(w), Judgement()) if w is not None else Judgement())
    reproduce = f"run_scenario({scenario!r})"
    for step, (i, action) in enumerate(scenario.schedule):
        r = scenario.drafters[i]
        if action == "reset":
            torch._dynamo.reset()  # the scenario's step: a user's reset between calls
            fed = [torch.zeros(0, dtype=torch.int64) for _ in models]
        elif action.startswith("save:"):
            try:
                _save(models[i], action[len("save:"):])
            except Exception as exc:
                try:  # torch's own limits (a parametrised module pickles only through its state_dict) are not ours
                    _save(twins[i], action[len("save:"):])
                except Exception:
                    continue
                raise AssertionError(f"step {step}: {action} of drafter {i} raised {type(exc).__name__}: {exc}\n"
                                     f"reproduce: {reproduce}") from None
        else:
            inputs = make_inputs(r, n_calls[i])
            n_calls[i] += 1
            try:
                ids = _judge_call(judges[i], models[i], compiled[i], twins[i], r, inputs,
                                  f"step {step} ({action} of drafter {i})",
                                  earlier_ids=fed[i], prefill=action == "prefill")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\nreproduce: {reproduce}") from None
            fed[i] = torch.cat([fed[i], ids])
    verdicts = []
    for i, judge in enumerate(judges):
        try:
            verdicts.append(judge.verdict(reproduce))
        except AssertionError as exc:
            raise AssertionError(str(exc).replace(":\n", f" (drafter {i}):\n", 1)) from None
    return next((v for v in verdicts if v != "matched"), "matched")


def _share_embedding(models: list) -> None:
    """Drafters sharing one ``nn.Embedding`` (drafters on the target's embedding, two heads of one table): each drafter
    whose table has drafter 0's shape and dtype takes drafter 0's module (a tied head its weight too)."""
    base = models[0].embed
    for m in models[1:]:
        if (m.embed.weight.shape != base.weight.shape or m.embed.weight.dtype != base.weight.dtype
                or m.recipe.lookup == "max_norm" or models[0].recipe.lookup == "max_norm"):
            continue
        m.embed = base
        if m.recipe.head == "linear_tied":
            m.lm_head.weight = base.weight
