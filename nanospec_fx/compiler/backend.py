"""The ``nanospec`` torch.compile backend: plan once, then execute.

``torch.compile(drafter, backend="nanospec")`` hands Dynamo's FX graph to :func:`nanospec_backend`, which takes
every decision first (:class:`~nanospec_fx.compiler.plan.CompilePlan`: which heads, each rewritten or dense and
why) and then carries them out (:func:`~nanospec_fx.compiler.execute.execute`: copy the graph, append the heads'
state tensors as inputs, rewrite each head into nanospec ops and observe the token-id inputs, compile with
inductor, and return a callable that appends the state tensors to every call). The state is updated in place, so
one compile serves every active set.

With ``options={"observe_topk": k, "vocab": drafter}`` it compiles a *target* instead: the target is not rewritten;
its top-k predictions at every scored position (and its input tokens) are observed into the drafter's active
vocabulary, on the device.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

from nanospec_fx.diagnostics import diagnosis
from nanospec_fx.compiler.execute import execute
from nanospec_fx.compiler.options import hold_options, option_error
from nanospec_fx.compiler.plan import CompilePlan
from nanospec_fx.diagnostics.limits import record_compiled_frame
from nanospec_fx.passes import HeadSelectionError

BACKEND_NAME = "nanospec"


def nanospec_backend(
    gm: fx.GraphModule, example_inputs: list, mode: str | None = None, options: dict | None = None, **_: Any
) -> Callable:
    """torch.compile backend: rewrite the LM head to the active vocabulary, compile the rest."""
    hold_options(options)  # the caller's dict, which torch.compile compares with ==: no tensor left in it
    record_compiled_frame()
    diagnosis.backend_called()
    try:
        return execute(CompilePlan.build(gm, example_inputs, mode, options))
    except HeadSelectionError as exc:  # options['head'] names nothing here: the caller's option, said unwrapped
        raise option_error(exc) from None


# how nanospec_fx.diagnostics.diagnosis recognises the backend behind a compiled function
nanospec_backend.nanospec = True
