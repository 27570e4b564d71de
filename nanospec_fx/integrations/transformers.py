"""One-line setup for speculative decoding stacks (transformers' assisted generation).

    state = nanospec_fx.speculative_pair(target, drafter)
    target.generate(input_ids, assistant_model=drafter, do_sample=False)
    nanospec_fx.detach(target)   # both models as they were before the pair

compiles the drafter in place with the nanospec backend and the target in place as a target
observer, so the drafter's active vocabulary gets NanoSpec's full context: every token fed to
either model, and the target's top-k predictions at every position it scores.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo
import torch.nn as nn

from nanospec_fx.diagnostics import diagnosis
from nanospec_fx.diagnostics.lookup import head_parameters
from nanospec_fx.compiler.options import NanoSpecOptions, with_mode
from nanospec_fx.vocab.state import ActiveVocab, state_for


def attach(drafter: nn.Module, head: str | None = None, **vocab_options) -> ActiveVocab:
    """Create the drafter's ActiveVocab now, before its first compiled call.

    The head is ``drafter.get_output_embeddings()`` (transformers models) or the parameter or buffer
    named ``head`` (e.g. ``"lm_head.weight"`` or ``"lm_head"``). ``vocab_options`` are the backend's vocabulary options
    (capacity, policy, frequencies, ...); compile the drafter with the same ones.
    """
    diagnosis.install()
    weight, bias = head_parameters(drafter, head)
    return state_for(weight, bias, NanoSpecOptions.parse(vocab_options).vocab_config)


PAIR_RECOMPILE_LIMIT = 32  # variants of the shared forward: 2 models x prefill/decode x cache states


def speculative_pair(target: nn.Module, drafter: nn.Module | None = None, *, mtp: bool | nn.Module = False,
                     observe_topk: int = 3, observe_prompt: bool = True, inductor: bool = True,
                     **vocab_options) -> ActiveVocab:
    """Compile ``drafter`` (nanospec head) and ``target`` (top-k observer) in place; return the drafter's ActiveVocab.

    Drafters that score the target's own head (:mod:`nanospec_fx.integrations.mtp`, docs/mtp.md) leave the target
    uncompiled:
    ``speculative_pair(target, mtp=True)`` (or ``mtp=`` an ``MtpModel``) for ``generate(use_mtp=True)``, and a
    DFlash drafter (``speculative_pair(target, drafter)``) for ``generate(assistant_model=drafter,
    speculation_type="dflash")``: only the drafting reads of the shared head are compact (``observe_prompt``
    does not apply: the prompt joins the set as fed tokens).

    ``vocab_options``: capacity, policy, frequencies, static_size, pinned_size, num_pinned,
    draft_to_target... as for the backend. ``observe_prompt`` also observes the target's top-k at
    the prompt positions at prefill (transformers asks the target for the last position's logits
    only; this costs one more head pass over the prompt). Target outputs are unchanged; generation
    stays lossless.

    A target and a drafter of one transformers class share one compiled function, and prefill and decode
    steps of both need their own variants: more than Dynamo's default recompile limit (8), past which it
    runs them uncompiled (a dense head, said by a ``NanoSpecWarning``). So this raises
    ``torch._dynamo.config.recompile_limit`` to at least ``PAIR_RECOMPILE_LIMIT`` for the process.
    ``nanospec_fx.detach(target)`` (or ``detach(drafter)``) undoes it.
    """
    if mtp is not False:
        if drafter is not None:
            raise ValueError("speculative_pair(target, mtp=...) drafts with the target's MTP layers: pass no drafter")
        from nanospec_fx.integrations.mtp import mtp_layers, mtp_pair

        _check_not_wrapped(target, "speculative_pair")
        layers = mtp_layers(target, None if mtp is True else mtp)  # checked (and loaded) before any setup
        state = attach(target, **vocab_options)
        return mtp_pair(target, state, layers, observe_topk=observe_topk, inductor=inductor, **vocab_options)
    if drafter is None:
        raise TypeError("speculative_pair(target, drafter) needs a drafter, or mtp=True to draft with the target's "
                        "MTP layers (generate(use_mtp=True))")
    _check_not_wrapped(drafter, "speculative_pair")
    _check_not_wrapped(target, "speculative_pair")
    from nanospec_fx.integrations.mtp import dflash_pair, is_dflash_drafter

    if is_dflash_drafter(drafter):
        return dflash_pair(target, drafter, attach(target, **vocab_options), observe_topk=observe_topk,
                           inductor=inductor, **vocab_options)
    # paired before (and not detached): detach restores what was there before the first pair
    calls = {m: _PAIRS[m].call if m in _PAIRS else _call_of(m) for m in (target, drafter)}
    limit_before = next((_PAIRS[m].recompile_limit for m in (target, drafter) if m in _PAIRS),
                        torch._dynamo.config.recompile_limit)
    limit = max(torch._dynamo.config.recompile_limit, PAIR_RECOMPILE_LIMIT)
    torch._dynamo.config.recompile_limit = limit
    state = attach(drafter, **vocab_options)
    drafter.compile(backend="nanospec", options={**vocab_options, "inductor": inductor})
    target.compile(backend="nanospec", options={"observe_topk": observe_topk, "vocab": state, "inductor": inductor,
                                                "observe_prompt": observe_prompt})
    _PAIRS[target] = _Paired(weakref.ref(drafter), calls[target], limit_before, limit)
    _PAIRS[drafter] = _Paired(weakref.ref(target), calls[drafter], limit_before, limit)
    return state


@dataclass
class _Paired:
    """What speculative_pair changed on one model, as it was before: its compiled call (``module.compile()``
    sets ``_compiled_call_impl``; None: not compiled), and Dynamo's recompile limit before and as set."""

    partner: weakref.ref
    call: Any
    recompile_limit: int
    limit_set: int


_PAIRS: "weakref.WeakKeyDictionary[nn.Module, _Paired]" = weakref.WeakKeyDictionary()


def _call_of(module: nn.Module) -> Any:
    return getattr(module, "_compiled_call_impl", None)


def detach(model: nn.Module) -> None:
    """Undo :func:`speculative_pair` for the pair ``model`` belongs to (its target or its drafter).

    The target stops observing (its calls no longer add its top-k to the drafter's set), both models get back
    the call they had before the pair (uncompiled, or their own earlier ``module.compile()``), and Dynamo's
    recompile limit returns to its earlier value unless it was changed since. The drafter's ActiveVocab stays
    registered to its head weight (its handles stay valid; a new pair or compile reuses it). Graphs already
    compiled stay in Dynamo's cache (``torch._dynamo.reset()`` drops them), but no call reaches them.
    """
    if "_nanospec_drafters" in vars(model):  # a target paired with its MTP layers or a DFlash drafter
        from nanospec_fx.integrations.mtp import mtp_detach

        mtp_detach(model)
        return
    paired = _PAIRS.pop(model, None)
    if paired is None:
        raise ValueError(f"{type(model).__name__} is not part of a pair made by nanospec_fx.speculative_pair "
                         "(or it was detached already)")
    model._compiled_call_impl = paired.call
    partner = paired.partner()
    if partner is not None and partner in _PAIRS and _PAIRS[partner].partner() is model:
        partner._compiled_call_impl = _PAIRS.pop(partner).call
    if torch._dynamo.config.recompile_limit == paired.limit_set:
        torch._dynamo.config.recompile_limit = paired.recompile_limit


def compile(model: nn.Module, options: dict | None = None, *, in_place: bool = False, **compile_kwargs):
    """``torch.compile(model, backend="nanospec", options=options)`` with the options checked now.

    ``torch.compile`` defers the backend to the first call, where a bad option raises :class:`OptionError`;
    here unknown keys and bad values raise the same error at once. With
    ``in_place`` the module itself is compiled (``model.compile(...)``, what transformers' assisted
    generation needs) and returned. ``compile_kwargs`` go to ``torch.compile`` (``dynamic``, ``fullgraph``...).
    """
    # torch.compile refuses mode= beside options=: the mode's inductor config joins the options instead
    options = with_mode(options, compile_kwargs.pop("mode", None))
    NanoSpecOptions.parse(options)
    _check_not_wrapped(model, "nanospec_fx.compile")
    diagnosis.install()  # say when Dynamo skips a frame it compiles for nanospec
    if in_place:
        model.compile(backend="nanospec", options=options, **compile_kwargs)
        return model
    return torch.compile(model, backend="nanospec", options=options, **compile_kwargs)


def _check_not_wrapped(module: nn.Module, caller: str) -> None:
    """A ``torch.compile`` wrapper already compiles its module; transformers' generate bypasses it."""
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        raise TypeError(
            f"{caller} got a torch.compile wrapper ({type(module._orig_mod).__name__}); pass the module itself. "
            "transformers' generate(assistant_model=...) calls assistant_model.generate(), which bypasses a wrapper "
            "(the head would run dense): compile in place: drafter.compile(backend='nanospec')"
        )


__all__ = ["attach", "compile", "detach", "speculative_pair"]
