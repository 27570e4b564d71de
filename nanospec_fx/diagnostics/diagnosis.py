"""Why a model's head is (not) rewritten: the one diagnosis behind every "not rewritten" message.

``explain``, ``active_vocab``'s ``LookupError``, ``assert_equivalent``'s failure and the warnings below all say
what :func:`diagnose` finds, so they never guess different causes. What it reads, all recorded as it happens:

* the heads of the model with a compiled graph (their ``pass_reports``) and those without;
* the dense fallbacks of the model's graphs (the backend's warning text: the reason, ``file:line``, the fixes);
* compiled calls of the model that looked up token ids and scored no head (a prefill, or a head computed
  outside the compiled call: an engine-style ``compute_logits(h)``, a head in a ``@torch.compiler.disable``
  helper);
* whether Dynamo was handed the model's ``forward`` and compiled no graph of it (a skipped frame: a graph break
  inside a ``for``/``while`` loop, a first call that ran no tensor op), or was never handed it (a
  ``torch.compile`` wrapper that transformers' ``generate`` bypassed, or the original module called);
* the target observers feeding the model's heads.

Two of these are said as they happen, once per model, by a ``NanoSpecWarning``: a model whose compiled calls
looked up ids :data:`HEADLESS_CALLS` times with no head of it ever rewritten, and a frame Dynamo skipped while
compiling it for nanospec because of a graph break (:func:`install`).
"""
from __future__ import annotations

import re
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from nanospec_fx.vocab import reports as pass_reports
from nanospec_fx.vocab.module_heads import module_tensors, state_names, unwrap
from nanospec_fx.diagnostics.warning import warn_once

# Head-less compiled calls (ids looked up, no head scored) of one model before it is said that no head of it was
# ever rewritten. A prefill is one such call per request, followed by decode calls that rewrite the head; eight
# in a row with no head rewritten is a model whose head never runs in a graph nanospec sees.
HEADLESS_CALLS = 8

_DENSE: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a parameter/buffer of a dense graph -> its warning texts
_HEADLESS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a token table -> head-less compiled calls that read it
_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a token table -> weakref of the model it was compiled from
_TARGETS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # an ActiveVocab -> observe_topk of each target observer
_FEEDS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a target's parameter/buffer -> (ActiveVocab ref, topk) it feeds
_SETTLED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # models (or states) diagnosed at the threshold already
_RUN_BY: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a model -> weakrefs of the states its compiled graphs rewrote
_SKIPPED: dict = {}  # code object -> why Dynamo skipped it while compiling it for nanospec (warned once per function)
_SKIPPED_MODELS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # the module instance whose frame was skipped -> why
_LOCAL = threading.local()


def _note(table: dict, key: Any, value: Any) -> None:
    try:
        items = table.setdefault(key, [])
    except TypeError:  # not weakly referenceable
        return
    if value not in items:
        items.append(value)


# ----------------------------------------------------------------------------- recording (from the backend)
def record_dense(tensors, messages: list[str]) -> None:
    """The graph that holds ``tensors`` (its parameters and buffers) runs a head dense, for ``messages``."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            for message in messages:
                _note(_DENSE, t, message)


def record_target_observer(state, topk: int, tensors) -> None:
    """A target observer graph, holding ``tensors`` (the target's parameters and buffers), feeds ``state`` its
    top-``topk``."""
    _note(_TARGETS, state, topk)
    for t in tensors:
        if isinstance(t, torch.Tensor):
            _note(_FEEDS, t, (weakref.ref(state), topk))


def target_observers(state) -> list[int]:
    """``observe_topk`` of each target observer graph feeding ``state``."""
    return list(_TARGETS.get(state, ()))


def record_rewritten(states, tensors) -> None:
    """The heads of ``states`` are rewritten in a graph of the model compiling now (the one holding some of
    ``tensors``): kept under that model, so that a head whose weight is a call argument (``F.linear(h,
    head_weight)``, vLLM style: the model does not hold it) is found through the state its weight keys."""
    if not states:
        return
    model = model_of_frame([t for t in tensors if isinstance(t, torch.Tensor)])
    if model is None:
        return
    for state in states:
        _note(_RUN_BY, model, weakref.ref(state))


_ARGUMENT = re.compile(r"^[LG]_(.+?)_$")


def argument_heads(module: nn.Module) -> dict:
    """``{state: [names]}`` of the heads rewritten in graphs of ``module`` whose weight ``module`` does not hold (a
    call argument), named as the pass reported them (the argument's name)."""
    held = state_names(module)
    found = {}
    for ref in _RUN_BY.get(module, ()):
        state = ref()
        if state is not None and state not in held and state not in found:
            names = [_ARGUMENT.sub(r"\1", r.head) + " (a call argument)"
                     for r in pass_reports.reports(state)]  # Dynamo's placeholder L_head_weight_: head_weight
            found[state] = list(dict.fromkeys(names)) or ["(a call argument)"]
    return found


def model_of_frame(tensors) -> nn.Module | None:
    """The module whose frame Dynamo is compiling now and that holds one of ``tensors`` (None: not found)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        local = InstructionTranslator.current_tx().f_locals
    except Exception:  # noqa: BLE001 - not called by Dynamo
        return None
    wanted = {id(t) for t in tensors}
    values = list(local.values())
    values += [v for value in values if isinstance(value, (tuple, list)) for v in value]  # a wrapper's *args
    for value in values:
        if isinstance(value, nn.Module) and any(id(t) in wanted for t in _tensors(value)):
            return value
    return None


class HeadlessCalls:
    """A compiled head-less graph that looks up ids in ``tables`` (input positions): counts its calls per table
    and, at the :data:`HEADLESS_CALLS`-th with no head of the table's model rewritten, says so once."""

    def __init__(self, compiled: Callable, positions: list[int], model: nn.Module | None, example_inputs: list):
        self.compiled, self.positions = compiled, positions
        if model is not None:
            for p in positions:
                _OWNER[example_inputs[p]] = weakref.ref(model)

    def __call__(self, *args: Any) -> Any:
        for p in self.positions:
            note_headless_call(args[p], args)
        return self.compiled(*args)


def note_headless_call(table: torch.Tensor, args: tuple = ()) -> None:
    count = _HEADLESS.get(table, 0) + 1
    _HEADLESS[table] = count
    owner = _OWNER.get(table)
    model = owner() if owner is not None else None
    if count == 1 and model is not None and model not in _SETTLED and _says_its_head(model) \
            and (missing := no_head(model, args)) is not None:
        _SETTLED[model] = True  # known at the first call: the model says it has no head, and none is given to it
        warn_once(f"nanospec: {type(unwrap(model)).__name__} has no LM head: {missing}", stacklevel=4)
        return
    if count < HEADLESS_CALLS:
        return
    if model is None or model in _SETTLED:
        return
    _SETTLED[model] = True  # diagnosed once: rewritten (a prefill), dense (said already), or said now
    found = diagnose(model)
    if found.rewritten or found.dense:
        return
    warn_once(f"nanospec: {found.model}'s head is not rewritten: {found.text()}", stacklevel=4)


def _says_its_head(model: Any) -> bool:
    """The model says what its head is (transformers' ``get_output_embeddings()``): a head-less answer is known at
    the first call. Another module's embedding table may still be read as a tied head by a later call."""
    return callable(getattr(unwrap(model), "get_output_embeddings", None))


def no_head(model: Any, args: tuple = ()) -> str | None:
    """Why ``model`` holds no LM head at all (None: it may have one): no parameter or buffer besides its token
    embedding, and no 2-D tensor among the call's ``args``, has a vocabulary-wide axis; and a transformers model's
    ``get_output_embeddings()`` is None, or another module holds nothing wider than its embedding's width (a wider
    weight could be a head over a draft or padded vocabulary). Then a compiled call that looks ids up and scores no
    head is no prefill of a head that comes later. For a module that does not say (no ``get_output_embeddings``)
    this is said only after :data:`HEADLESS_CALLS` such calls: its embedding table could be read as a tied head by
    another call, or by a selection the pass does not take for a head (Gemma-4's centroid head)."""
    module = unwrap(model)
    if not isinstance(module, nn.Module):
        return None
    tables = [m.weight for m in module.modules() if isinstance(m, nn.Embedding)]
    if not tables:
        return None
    widths = {t.shape[0] for t in tables}
    known = {id(t) for t in tables}
    held = [t for _, t in module_tensors(module)] + [a for a in args if isinstance(a, torch.Tensor)]
    if any(id(t) not in known and t.dim() >= 2 and widths & set(t.shape) for t in held):
        return None  # a weight it holds, or one the call is given (a vLLM-style head_weight argument)
    output = getattr(module, "get_output_embeddings", None)
    if callable(output):  # a transformers model says whether it has a head
        try:
            if output() is not None:
                return None
        except Exception:  # noqa: BLE001 - a model whose accessor raises: nothing known
            return None
    else:  # any tensor wider than the embedding's width could be a head over a draft or padded vocabulary
        width = min(t.shape[1] for t in tables)
        if any(id(t) not in known and t.dim() >= 2 and max(t.shape) > width for t in held):
            return None
    return (f"no parameter or buffer besides its token embedding has the vocabulary's {max(widths)} rows, and its "
            "compiled call scored none, so nothing is made compact. Compile the model that computes the logits "
            "(a transformers ...ForCausalLM, not its base model), or pass the head's weight to the compiled call.")


def note_target_call(state, vocab: Any, calls: int) -> None:
    """A target observer fed ``state`` for the ``calls``-th time, ``vocab`` being what it was compiled with: a
    ``torch.compile`` wrapper whose head no compiled graph ever read by then is one transformers bypassed."""
    if calls != HEADLESS_CALLS or not hasattr(vocab, "_orig_mod") or pass_reports.reports(state) or state in _SETTLED:
        return
    _SETTLED[state] = True
    found = diagnose(vocab)
    if found.dense:  # its dense graph said why already
        return
    warn_once(f"nanospec: the target observer fed {found.model}'s active vocabulary {calls} times, but no compiled "
              f"graph of it read the set: its head runs dense. {found.text()}", stacklevel=4)


# ----------------------------------------------------------------------------- frames Dynamo skips
def backend_called() -> None:
    """The backend was handed a graph (called by it)."""
    _LOCAL.graphs = getattr(_LOCAL, "graphs", 0) + 1
    install()


def install() -> None:
    """Watch Dynamo's compiles for a frame it skips, from now on: ``torch._dynamo.reset()`` drops every callback, and
    a model compiled after a reset may hand nanospec no graph at all (a graph break in a loop of its ``forward``), so
    the watcher is registered again by the reset itself (its handler's ``clear``), not by nanospec's next graph."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:
        return
    if _on_end not in callback_handler.end_callbacks:
        forget_skipped()  # a reset: what Dynamo skipped before it is compiled afresh
        callback_handler.register_start_callback(_on_start)
        callback_handler.register_end_callback(_on_end)
    clear = getattr(callback_handler, "clear", None)
    if callable(clear) and not getattr(clear, "_nanospec_reinstalls", False):
        def clear_then_install(*args, **kwargs):
            result = clear(*args, **kwargs)
            forget_skipped()  # Dynamo forgets the frames it skipped: it will try them again
            install()
            return result
        clear_then_install._nanospec_reinstalls = True
        callback_handler.clear = clear_then_install


def forget_skipped() -> None:
    """Forget the frames Dynamo skipped (``torch._dynamo.reset()`` forgets its compiled frames too)."""
    _SKIPPED.clear()
    _SKIPPED_MODELS.clear()


def _raised_to_caller(error: BaseException) -> bool:
    """An error of the backend's own (a bad option, a head that cannot be chosen, a compiler crash): it reaches the
    caller as an exception, so it is no skipped frame to diagnose later."""
    from torch._dynamo.exc import BackendCompilerFailed, ShortenTraceback

    return isinstance(error, (BackendCompilerFailed, ShortenTraceback)) or \
        type(error).__module__.split(".")[0] in ("nanospec_fx", "passes")


def _on_start(_args) -> None:
    _LOCAL.start = getattr(_LOCAL, "graphs", 0)


def _on_end(_args) -> None:
    """A frame compiled for nanospec that handed it no graph and ended in a graph break Dynamo cannot resume
    from (inside a loop): the whole function runs eager, its head dense. Said once per function."""
    try:
        if getattr(_LOCAL, "graphs", 0) != getattr(_LOCAL, "start", -1):
            return
        error = sys.exc_info()[1]
        if error is None or "No ops traced" in str(error) or _raised_to_caller(error):
            return
        frame = sys._getframe()
        while frame is not None and not (frame.f_code.co_name == "_compile" and "compiler_fn" in frame.f_locals):
            frame = frame.f_back
        if frame is None or not _is_nanospec(frame.f_locals["compiler_fn"]):
            return
        code = frame.f_locals.get("code")
        if code is None or code.co_name.startswith("torch_dynamo_resume_in"):
            return  # (Dynamo tries a function once per reset: a model of the same class after a reset is said again)
        reason = _first_line(error)
        for value in (frame.f_locals.get("locals") or {}).values():  # the instance whose forward was skipped
            if isinstance(value, nn.Module) and getattr(type(value).forward, "__code__", None) is code:
                _SKIPPED_MODELS[value] = reason
        if code in _SKIPPED:
            return
        _SKIPPED[code] = reason
        if _called_from_compiled_code(frame):
            return  # a graph of its compiled caller ends at this call: that piece says why its head is dense
        where = f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno})"
        warn_once(f"nanospec: Dynamo skipped {where} ({reason}) and handed nanospec no graph of it: it runs eager, "
                  f"its LM head dense, and nothing it embeds is observed. {_SKIP_REMEDY}", stacklevel=2)
    except Exception:  # noqa: BLE001 - a watcher never breaks a compile
        return


def _called_from_compiled_code(frame) -> bool:
    """Whether a frame above ``frame`` (Dynamo's ``_compile``) runs code Dynamo compiled."""
    try:
        from torch._dynamo.convert_frame import output_codes
    except ImportError:  # pragma: no cover - older Dynamo
        return False
    frame = frame.f_back
    while frame is not None:
        if frame.f_code in output_codes:
            return True
        frame = frame.f_back
    return False


def _first_line(error: BaseException) -> str:
    text = str(error)
    loop = "graph break in a for/while loop" if "graph break in loop" in text else None
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return f"{loop}: {first}" if loop else first


_SKIP_REMEDY = ("A graph break inside a for/while loop (`if (tok == eos).all(): break`, `.item()`, `print` in a draft "
                "loop) makes Dynamo skip the whole function: move the break out of the loop (return the tokens and "
                "stop in the caller, or stop with a tensor mask), or compile the loop body as its own function.")


def _is_nanospec(fn: Any) -> bool:
    for _ in range(8):
        if getattr(fn, "nanospec", False) is True:  # nanospec_fx.compiler.backend.nanospec_backend, testing's backends
            return True
        fn = next((n for n in (getattr(fn, a, None) for a in ("_torchdynamo_orig_backend", "compiler_fn"))
                   if n is not None and n is not fn), None)
        if fn is None:
            return False
    return False


# ----------------------------------------------------------------------------- the diagnosis
@dataclass
class Diagnosis:
    """What is known about why ``model``'s head is or is not rewritten (:func:`diagnose`)."""

    model: str
    rewritten: list[str] = field(default_factory=list)  # heads a compiled graph runs compact
    dense: list[str] = field(default_factory=list)  # the dense fallbacks of its graphs (reason, file:line, fixes)
    headless: int = 0  # compiled calls that looked up token ids and scored no head
    skipped: str | None = None  # Dynamo was handed its forward and compiled no graph of it (why, when known)
    compiled: bool = False  # compiled with backend='nanospec' (a wrapper or in place)
    handed: bool = False  # Dynamo was handed its forward
    wrapper: bool = False  # a torch.compile wrapper was diagnosed
    feeds: list = field(default_factory=list)  # (ActiveVocab, observe_topk) it feeds as a target observer
    no_head: str | None = None  # why it holds no LM head at all (:func:`no_head`), when its calls scored none

    def feeds_text(self) -> str:
        """What it feeds as a target observer (its own head stays dense, by design)."""
        return "; ".join(f"its top-{k} into an active vocabulary of V={s.vocab_size} ({len(s)} / {s.capacity} "
                         f"active, policy={s.policy})" for s, k in self.feeds)

    def causes(self) -> list[str]:
        """Each reason, with its remedy, that the head is not (or not everywhere) rewritten."""
        found = [f"a compiled graph ran its head dense: {m}" for m in self.dense]
        if self.skipped is not None:
            found.append(f"Dynamo was handed its forward and compiled no graph of it ({self.skipped}), so it ran "
                         f"eager with a dense head and nanospec saw nothing. {_SKIP_REMEDY} A first call that "
                         "runs no tensor op (an early return) makes Dynamo skip the function too.")
        if self.headless and not self.rewritten and self.no_head is not None:
            found.append(f"it has no LM head: {self.no_head}")
        elif self.headless and not self.rewritten:
            found.append(
                f"{self.headless} compiled call(s) of it looked up token ids and scored no head, and no head of it "
                "was ever rewritten: a prefill, or its head runs outside the compiled call (dense). If forward "
                "returns hidden states and the logits are computed outside it (an engine-style compute_logits(h), a "
                "head in a @torch.compiler.disable helper), compile the function that computes the logits, or use "
                "nanospec_fx.RequestVocabs(...).logits(h, rows) for an engine-style split.")
        if found or self.rewritten or self.feeds:
            return found
        if self.wrapper:
            return ["this is a torch.compile wrapper" + ("" if self.handed else " that was never called")
                    + ": transformers' generate(assistant_model=...) calls assistant_model.generate(), which "
                    "bypasses the wrapper (the head runs dense). Compile in place instead: "
                    "drafter.compile(backend='nanospec'), or nanospec_fx.compile(drafter, in_place=True)."]
        if not self.compiled:
            return ["it is not compiled with backend='nanospec': torch.compile(model, backend='nanospec') and call "
                    "the compiled module, or compile it in place: model.compile(backend='nanospec')."]
        if not self.handed:
            return ["it is compiled with backend='nanospec' but Dynamo was never handed its forward: call the "
                    "compiled module (not the original)."]
        return ["Dynamo was handed its forward but handed nanospec no graph with a head (the recompile limit, or "
                "a frame Dynamo skips: a first call that ran no tensor op, a graph break inside a loop)."]

    def text(self) -> str:
        causes = self.causes()
        return " ".join(causes) if len(causes) < 2 else " ".join(f"({i}) {c}" for i, c in enumerate(causes, 1))

    def __str__(self) -> str:
        head = (f"{', '.join(self.rewritten)} rewritten" if self.rewritten else "no head rewritten")
        return f"{self.model}: {head}" + (f"; {self.text()}" if self.causes() else "")


def diagnose(model: Any) -> Diagnosis:
    """The diagnosis of ``model`` (compiled wrapper, module compiled in place, or plain module)."""
    install()
    wrapper = hasattr(model, "_orig_mod")
    module = unwrap(model)
    found = Diagnosis(type(module).__name__, wrapper=wrapper)
    if not isinstance(module, nn.Module):
        return found
    heads = {**state_names(module), **argument_heads(module)}
    found.rewritten = [names[0] for state, names in heads.items() if pass_reports.reports(state)]
    tensors = list(_tensors(module))
    for t in tensors:
        for message in _DENSE.get(t, ()):
            if message not in found.dense:
                found.dense.append(message)
        found.headless = max(found.headless, _HEADLESS.get(t, 0))
        for ref, k in _FEEDS.get(t, ()):
            state = ref()
            if state is not None and not any(s is state and j == k for s, j in found.feeds):
                found.feeds.append((state, k))
    if found.headless and not found.rewritten:
        found.no_head = no_head(module)
    found.compiled = _compiled_with_nanospec(model) or _compiled_with_nanospec(module)
    code = getattr(getattr(type(module), "forward", None), "__code__", None)
    if code is not None:
        found.handed = _handed(code)
        if module in _SKIPPED_MODELS:  # this instance's frame, not another of its class
            found.skipped = _SKIPPED_MODELS[module]
        elif found.handed and found.compiled and not _cache_entries(code) and not found.rewritten:
            found.skipped = "a frame Dynamo skips"
    return found


def _tensors(module: nn.Module):
    for _, t in module_tensors(module):
        yield t


def _compiled_with_nanospec(model: Any) -> bool:
    """``model`` is a torch.compile wrapper, or a module compiled in place, whose backend is nanospec."""
    ctx = getattr(model, "dynamo_ctx", None)
    if ctx is None:
        impl = getattr(model, "_compiled_call_impl", None)
        cells = getattr(impl, "__closure__", None) or ()
        ctx = next((c.cell_contents for c in cells if hasattr(c.cell_contents, "callback")), None)
    return ctx is not None and _is_nanospec(getattr(ctx, "callback", None))


def _handed(code) -> bool:
    """Dynamo was handed ``code`` since its last reset (its compiled frames keep weak references to their code)."""
    try:
        from torch._dynamo.convert_frame import input_codes

        return any(ref() is code for ref in input_codes.seen)
    except Exception:  # noqa: BLE001 - another torch: not known
        return False


def _cache_entries(code) -> int:
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return len(_debug_get_cache_entry_list(code))
    except Exception:  # noqa: BLE001 - another torch: count it as compiled
        return 1


install()

__all__ = ["Diagnosis", "HEADLESS_CALLS", "diagnose"]
