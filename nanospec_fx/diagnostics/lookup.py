"""The state of a head: which ActiveVocab belongs to a model's LM head, found by module, name or weight.

The registry in :mod:`nanospec_fx.vocab.state` maps a head weight to its ActiveVocab;
:mod:`nanospec_fx.vocab.module_heads`
walks a model (compiled wrapper or not) to its head weights and names; this module picks a head's state by name,
creates it on demand, and says why there is none (:mod:`nanospec_fx.diagnostics.diagnosis`).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from nanospec_fx.vocab.module_heads import module_tensors, state_names, unwrap
from nanospec_fx.vocab.state import ActiveVocab, registered_state, state_for
from nanospec_fx.vocab.config import VocabConfig


def active_vocab(module: nn.Module | torch.Tensor, head: str | None = None) -> ActiveVocab:
    """The ActiveVocab of ``module``'s head (``module`` may be the compiled or the original one).

    ``head`` picks one when there are several: any name of the head's weight (for a tied head the
    embedding's name works too), its module path, or a dotted suffix of one (``"lm_head"``).
    Before the first compiled call, a head that can be found without tracing (``head`` names a
    parameter or buffer, or ``get_output_embeddings()``) gets its ActiveVocab now, with the
    default options (a later compile with other options rebuilds it in place, keeping this object).
    ``module`` may also be the head's weight tensor itself (a head weight passed to ``forward`` as
    an argument, or a global, is not held by any module).
    """
    wrapper = module if unwrap(module) is not module else None
    module = unwrap(module)
    if isinstance(module, torch.Tensor):
        state = registered_state(module)
        if state is None:
            raise LookupError("this tensor is not the weight of a head with an active vocabulary (yet)")
        return state
    if not isinstance(module, nn.Module):
        raise TypeError(f"active_vocab expects an nn.Module or a head weight tensor, got {type(module).__name__}")
    found = state_names(module)
    if head is not None:
        hits = [s for s, names in found.items() if any(n == head or n.endswith("." + head) for n in names)]
        if len(hits) == 1:
            return hits[0]
        if not hits and not found:
            created = _create_on_demand(module, head)
            if created is not None:
                return created
        known = sorted({n for names in found.values() for n in names})
        raise KeyError(f"no single active vocabulary for head {head!r}; names of heads with one: {known or 'none'}; "
                       f"the parameters and buffers of {type(module).__name__} it may name (2-D, or 3-D: heads "
                       f"stacked in one weight): {_head_candidates(module) or 'none'}")
    if not found:
        if wrapper is None:
            created = _create_on_demand(module, None)
            if created is not None:
                return created
        from nanospec_fx.diagnostics.diagnosis import diagnose

        why = diagnose(module if wrapper is None else wrapper).text()
        raise LookupError(
            f"{type(module).__name__} has no active vocabulary yet: {why} "
            "To create the set before the first call: nanospec_fx.attach(model, head='<weight name>')"
        )
    if len(found) > 1:
        raise LookupError(
            f"several heads have an active vocabulary: {sorted(n[0] for n in found.values())}; pass head=<name>")
    return next(iter(found))


def _create_on_demand(module: nn.Module, head: str | None) -> ActiveVocab | None:
    """The head's ActiveVocab with the default vocabulary options, when the head can be found without tracing."""
    try:
        return state_for(*head_parameters(module, head), VocabConfig())
    except (KeyError, ValueError):
        return None


def _head_candidates(module: nn.Module) -> list[str]:
    """The names of the tensors a ``head=`` may name: 2-D (one head) or 3-D (K heads stacked in one weight)."""
    return sorted(n for n, t in module_tensors(module) if t.dim() in (2, 3))


def head_parameters(module: nn.Module, head: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, bias)`` of a model's LM head: the parameter or buffer named ``head`` (``"lm_head.weight"``,
    or the module ``"lm_head"``; its bias beside it) or, without a name, ``get_output_embeddings()``
    (transformers models)."""
    module = unwrap(module)
    if head is not None:
        tensors = dict(module_tensors(module))
        # a 2-D head weight, or K Medusa heads stacked in one 3-D weight (read [K, V, H]: ActiveVocab's stacked_axes)
        name = head if head in tensors and tensors[head].dim() in (2, 3) else f"{head}.weight"
        if name not in tensors:
            raise KeyError(f"{type(module).__name__} has no parameter or buffer {head!r} of 2 dims (a head) or 3 "
                           f"(heads stacked in one weight); its tensors of 2 or 3 dims: {_head_candidates(module)}")
        bias = tensors.get(name.rsplit(".", 1)[0] + ".bias") if name.endswith(".weight") else None
        return tensors[name], bias
    get_head = getattr(module, "get_output_embeddings", None)
    layer = get_head() if callable(get_head) else None
    if layer is None or not isinstance(getattr(layer, "weight", None), torch.Tensor):
        raise ValueError(f"{type(module).__name__} has no get_output_embeddings(); pass head='<weight parameter name>'")
    return layer.weight, getattr(layer, "bias", None)


__all__ = ["active_vocab", "head_parameters"]
