"""Which tensors a model holds, and which of them are LM heads with an ActiveVocab (under every name).

The registry in :mod:`nanospec_fx.vocab.state` maps a head weight to its ActiveVocab; this module walks a model
(compiled wrapper or not) to its tensors and head names. :mod:`nanospec_fx.diagnostics.lookup` (``active_vocab``) and
:mod:`nanospec_fx.diagnostics.diagnosis` read it.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn

from nanospec_fx.vocab import reports as pass_reports
from nanospec_fx.vocab.state import ActiveVocab, registered_state


def unwrap(module):
    """The module a ``torch.compile`` wrapper compiles (``module`` itself when it is no wrapper)."""
    return getattr(module, "_orig_mod", module)


def module_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a module holds, under every name: parameters, buffers (tied ones under each
    of their names) and plain tensor attributes. The pass can rewrite a head held in any of them."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and not attr.startswith("_"):
                yield (f"{prefix}.{attr}" if prefix else attr), value


def state_names(module: nn.Module) -> dict[ActiveVocab, list[str]]:
    """Every ActiveVocab reachable from ``module``, with all the names it can be asked by: each name
    of its weight tensor (tied heads have several) and that name without ``.weight`` (the module).
    A name belongs to the weight its module holds now: the state of a head's former weight (untied, replaced) is
    left out when every module the pass saw it run as holds another weight."""
    found: dict[ActiveVocab, list[str]] = {}
    for name, tensor in module_tensors(module):
        state = registered_state(tensor)
        if state is not None:
            names = found.setdefault(state, [])
            for n in (name, name[: -len(".weight")] if name.endswith(".weight") else None):
                if n and n not in names:
                    names.append(n)
    for state, names in list(found.items()):
        reports = pass_reports.reports(state)
        if reports and all(r.module_path and not _holds_now(module, r.module_path, state) for r in reports):
            del found[state]  # a former head: every module it ran as holds another weight now (which has its state)
            continue
        for report in reports:
            head, path = report.head, report.module_path
            if head in names:  # the name the pass reported first (explain shows it)
                names.insert(0, names.pop(names.index(head)))
            if path and path not in names and _holds_now(module, path, state):
                names.append(path)
    return found


def _holds_now(module: nn.Module, path: str, state: ActiveVocab) -> bool:
    """Whether the module path a compiled graph reported for ``state``'s head still names it: the submodule there
    holds ``state``'s weight now. A head whose weight was replaced (untied, re-assigned) has a new state, which the
    name belongs to; the old one keeps only the names of the tensors that hold its weight. A path that names no
    submodule (the head ran in a function) is kept."""
    try:
        sub = module.get_submodule(path)
    except AttributeError:
        return True
    return any(state.is_weight(t) for _, t in module_tensors(sub))


def registered_states(module: nn.Module) -> dict[str, ActiveVocab]:
    """The ActiveVocab of every head of ``module`` (parameters, buffers and tensor attributes),
    once each, under the first name of its weight."""
    return {names[0]: state for state, names in state_names(module).items()}


__all__ = ["module_tensors", "registered_states", "state_names", "unwrap"]
