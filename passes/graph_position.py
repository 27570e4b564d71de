"""Where a Dynamo graph sits in the call it came from: the whole call, or one piece of it.

A graph break splits one call of the drafter into several graphs (Dynamo runs the code between
them in Python): the graph before the break, a *resume* graph after it, and, for a break inside a
function called from the compiled frame, graphs of that function's own frame. A piece cannot prove
the contract for the whole call: the ids the call embeds in another piece are not observed before
its head reads the set (a head scored before the break, the ids embedded after it, or the other
way round), and post-ops applied to its logits in a later piece would give inactive tokens finite
values. So the backend rewrites a head only in a graph that is the whole call
(:attr:`GraphPosition.whole_call`), and says which break stopped it otherwise.

Nothing here is remembered between graphs or calls: the position is read from Dynamo's frame of
this compile (no process-global state, nothing to link, nothing that ``torch._dynamo.reset()``
would have to clear).
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

import torch
import torch.fx as fx

from . import patterns

_RESUME = re.compile(r"^torch_dynamo_resume_in_(?P<fn>.+)_at_(?P<line>\d+)$")


@dataclass(frozen=True)
class GraphPosition:
    """How this graph relates to the rest of the call (each field: where, as ``file:line (function)``)."""

    resumes_after: str | None = None  # the graph break this graph resumes after
    ends_at: str | None = None  # the graph break this graph ends at (the call goes on in Python)
    called_from: str | None = None  # compiled code that called this frame (it broke at that call)
    eager_caller: str | None = None  # user code running eager inside the compiled call that called this frame

    @property
    def whole_call(self) -> bool:
        return not (self.resumes_after or self.ends_at or self.called_from or self.eager_caller)

    def describe(self) -> str:
        """The break(s) that make this graph a piece of a call, for warnings."""
        parts = []
        if self.resumes_after:
            parts.append(f"it resumes after a graph break at {self.resumes_after}")
        if self.ends_at:
            parts.append(f"it ends at a graph break at {self.ends_at}")
        if self.called_from:
            parts.append(f"its function was called from compiled code that broke at that call ({self.called_from})")
        if self.eager_caller:
            parts.append(f"its function was called from {self.eager_caller}, whose own lookups and ops nanospec "
                         "never sees")
        return "; ".join(parts) or "it is the whole call"


def graph_position(gm: fx.GraphModule) -> GraphPosition:
    """The position of the graph Dynamo is compiling now (a whole call when not called by Dynamo)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # noqa: BLE001 - not called by Dynamo (a test calling the backend on a traced graph)
        tx = None
    if tx is None:
        return GraphPosition(resumes_after=_resumed_from_placeholders(gm))
    code = tx.f_code
    resumed = _RESUME.match(code.co_name)
    resumes_after = None
    if resumed:
        resumes_after = f"{code.co_filename}:{resumed['line']} ({resumed['fn']})"
    else:
        resumes_after = _resumed_from_placeholders(gm)
    reason = getattr(tx.output, "compile_subgraph_reason", None)
    ends_at = None
    if reason is not None and getattr(reason, "graph_break", False):
        stack = list(getattr(reason, "user_stack", None) or [])
        if stack:
            frame = stack[-1]
            ends_at = f"{frame.filename}:{frame.lineno} ({frame.name})"
        else:
            ends_at = f"{code.co_filename} ({code.co_name})"
        why = str(getattr(reason, "reason", "") or "").strip().splitlines()
        if why:
            ends_at += f": {why[0][:120]}"
    called_from = _compiled_caller(resumed["fn"] if resumed else None)
    return GraphPosition(resumes_after, ends_at, called_from, None if called_from else _eager_caller())


def _resumed_from_placeholders(gm: fx.GraphModule) -> str | None:
    """Dynamo passes a resumed frame's stack values as ``L['___stack0']`` inputs."""
    for node in gm.graph.nodes:
        if node.op == "placeholder" and "___stack" in patterns.source_name(node):
            return f"an earlier graph (input {patterns.source_name(node)})"
    return None


def _compiled_caller(resumed_fn: str | None) -> str | None:
    """The nearest frame on the Python stack that runs Dynamo-compiled code and is not an earlier
    piece of this frame's own function, if any.

    While Dynamo compiles a frame, that frame has not started: the frames above Dynamo's own are
    its callers. A resume function (the rest of ``fn`` after a break) is called by the previous
    piece of ``fn``: resume functions of ``fn``, then ``fn``'s own frame. Any compiled frame above
    those broke at the call of ``fn``, so its graphs before and after are pieces of the same call.
    """
    try:
        from torch._dynamo.convert_frame import output_codes
    except ImportError:  # pragma: no cover - older Dynamo
        return None
    frame = sys._getframe(1)
    own_pieces = resumed_fn is not None
    while frame is not None:
        code = frame.f_code
        if code in output_codes:
            if own_pieces and _RESUME.match(code.co_name) and _RESUME.match(code.co_name)["fn"] == resumed_fn:
                pass  # an earlier resume piece of the same function
            elif own_pieces and code.co_name == resumed_fn:
                own_pieces = False  # the function's own frame: anything compiled above it is a caller
            else:
                return f"{code.co_filename}:{frame.f_lineno} ({code.co_name})"
        frame = frame.f_back
    return None


_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_DYNAMO = os.path.join(_TORCH, "_dynamo") + os.sep
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OWN = tuple(os.path.join(_ROOT, d) + os.sep for d in ("nanospec_fx", "passes", "kernels"))  # nanospec's own files


def _eager_caller() -> str | None:
    """The nearest frame of user code that runs eager inside the compiled call and calls the frame Dynamo compiles
    now, if any: a caller Dynamo skipped (a graph break in a loop of ``forward`` skips the whole function, once for
    every instance of its class) runs in Python, and its own lookups and heads are invisible to nanospec; a function
    it calls is then compiled as a frame of its own, one piece of the call. The callers are the frames between the
    compiled call's entry (Dynamo's wrapper in ``eval_frame.py``) and Dynamo's own frames compiling now; torch's
    frames among them (``nn.Module`` call plumbing) are not user code, and compiled frames are
    :func:`_compiled_caller`'s."""
    try:
        from torch._dynamo.convert_frame import output_codes
    except ImportError:  # pragma: no cover - older Dynamo
        return None
    chain, frame = [], sys._getframe(1)
    while frame is not None and not _entry(frame.f_code):
        chain.append(frame)
        frame = frame.f_back
    if frame is None:
        return None  # not inside a compiled call's entry (Dynamo called another way): nothing known
    compiling = max((i for i, f in enumerate(chain) if f.f_code.co_filename.startswith(_DYNAMO)), default=-1)
    for caller in chain[compiling + 1:]:
        code = caller.f_code
        if code not in output_codes and not code.co_filename.startswith((_TORCH, *_OWN)):
            return f"{code.co_filename}:{caller.f_lineno} ({code.co_name}), which runs eager (a frame Dynamo skipped)"
    return None


def _entry(code) -> bool:
    """Dynamo's wrapper that runs a compiled function or module (``compile_wrapper``; ``_fn`` in older torch)."""
    return code.co_name in ("compile_wrapper", "_fn") and code.co_filename.startswith(_DYNAMO) \
        and code.co_filename.endswith("eval_frame.py")
