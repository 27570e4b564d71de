"""One-line setup for speculative decoding stacks (transformers' assisted generation).

    state = nanospec_fx.speculative_pair(target, drafter)
    target.generate(input_ids, assistant_model=drafter, do_sample=False)

compiles the drafter in place with the nanospec backend and the target in place as a target
observer, so the drafter's active vocabulary gets NanoSpec's full context: every token fed to
either model, and the target's top-k predictions at every position it scores.
"""
from __future__ import annotations

import torch
import torch._dynamo
import torch.nn as nn

from nanospec_fx.lookup import head_parameters
from nanospec_fx.options import NanoSpecOptions
from nanospec_fx.state import ActiveVocab, state_for


def attach(drafter: nn.Module, head: str | None = None, **vocab_options) -> ActiveVocab:
    """Create the drafter's ActiveVocab now, before its first compiled call.

    The head is ``drafter.get_output_embeddings()`` (transformers models) or the parameter or buffer
    named ``head`` (e.g. ``"lm_head.weight"`` or ``"lm_head"``). ``vocab_options`` are the backend's vocabulary options
    (capacity, policy, frequencies, ...); compile the drafter with the same ones.
    """
    weight, bias = head_parameters(drafter, head)
    return state_for(weight, bias, NanoSpecOptions.parse(vocab_options).vocab_config)


PAIR_RECOMPILE_LIMIT = 32  # variants of the shared forward: 2 models x prefill/decode x cache states


def speculative_pair(target: nn.Module, drafter: nn.Module, *, observe_topk: int = 3, observe_prompt: bool = True,
                     inductor: bool = True, **vocab_options) -> ActiveVocab:
    """Compile ``drafter`` (nanospec head) and ``target`` (top-k observer) in place; return the drafter's ActiveVocab.

    ``vocab_options``: capacity, policy, frequencies, static_size, pinned_size, num_pinned,
    draft_to_target... as for the backend. ``observe_prompt`` also observes the target's top-k at
    the prompt positions at prefill (transformers asks the target for the last position's logits
    only; this costs one more head pass over the prompt). Target outputs are unchanged; generation
    stays lossless.

    A target and a drafter of one transformers class share one compiled function, and prefill and decode
    steps of both need their own variants: more than Dynamo's default recompile limit (8), past which it
    runs them uncompiled (a dense head, said by a ``NanoSpecWarning``). So this raises
    ``torch._dynamo.config.recompile_limit`` to at least ``PAIR_RECOMPILE_LIMIT`` for the process.
    """
    _check_not_wrapped(drafter, "speculative_pair")
    _check_not_wrapped(target, "speculative_pair")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, PAIR_RECOMPILE_LIMIT)
    state = attach(drafter, **vocab_options)
    drafter.compile(backend="nanospec", options={**vocab_options, "inductor": inductor})
    target.compile(backend="nanospec", options={"observe_topk": observe_topk, "vocab": state, "inductor": inductor,
                                                "observe_prompt": observe_prompt})
    return state


def compile(model: nn.Module, options: dict | None = None, *, in_place: bool = False, **compile_kwargs):
    """``torch.compile(model, backend="nanospec", options=options)`` with the options checked now.

    ``torch.compile`` defers the backend to the first call, where a bad option surfaces as torch's
    ``BackendCompilerFailed``; here unknown keys and bad values raise ``ValueError`` at once. With
    ``in_place`` the module itself is compiled (``model.compile(...)``, what transformers' assisted
    generation needs) and returned. ``compile_kwargs`` go to ``torch.compile`` (``dynamic``, ``fullgraph``...).
    """
    NanoSpecOptions.parse(options)
    _check_not_wrapped(model, "nanospec_fx.compile")
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


__all__ = ["attach", "compile", "speculative_pair"]
