"""Say so when Dynamo stops handing a nanospec-compiled function to the backend.

When a function reaches Dynamo's recompile limit (``torch._dynamo.config.recompile_limit``, 8 by
default: a growing Python cache, many shapes with ``dynamic=False``), Dynamo runs its later
variants as plain Python: the drafter then runs with a dense head and nanospec never sees the call.
Dynamo logs that once, as a ``logging`` warning; this module turns it into one ``NanoSpecWarning``
for the functions nanospec compiled, so a dense head never goes unannounced.
"""
from __future__ import annotations

import logging
import threading
from types import CodeType

from nanospec_fx.diagnostics.warning import warn_once

_LOGGER = "torch._dynamo.convert_frame"
_compiled: set[str] = set()  # "'name' (file:first line)" of every frame nanospec compiled
_installed = threading.Event()


def record_compiled_frame() -> None:
    """Remember the frame Dynamo is compiling now (called from the backend); install the watcher once."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        code = InstructionTranslator.current_tx().f_code
    except Exception:  # noqa: BLE001 - not called by Dynamo
        return
    _compiled.add(_describe(code))
    if not _installed.is_set():
        _installed.set()
        logging.getLogger(_LOGGER).addHandler(_LimitHandler(logging.WARNING))


def _describe(code: CodeType) -> str:
    # The same text Dynamo's recompile-limit message uses for the function.
    return f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno})"


class _LimitHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if not str(record.msg).startswith("torch._dynamo hit config.") or not isinstance(record.args, tuple):
            return
        function = next((a for a in record.args if isinstance(a, str) and a in _compiled), None)
        if function is None:
            return
        limit = record.args[0] if record.args else "recompile_limit"
        warn_once(
            f"nanospec: Dynamo reached torch._dynamo.config.{limit} for {function}, so it runs that function's later "
            "calls as plain Python: the LM head there is dense and nanospec does not see them (no ids are observed). "
            "Call torch._dynamo.reset() between unrelated models, mark changing sizes dynamic, keep Python values that "
            f"change every call out of forward, or raise torch._dynamo.config.{limit}.", stacklevel=2)
