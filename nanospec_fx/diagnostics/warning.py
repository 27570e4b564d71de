"""The one warning nanospec gives: something it could not do, with the reason and the remedy."""
from __future__ import annotations

import warnings


class NanoSpecWarning(UserWarning):
    """Something nanospec could not do; the model still runs, unchanged where it says so."""


def warn_once(message: str, stacklevel: int = 3) -> None:
    """Warn at compile time (not per call); Python's default filter shows each message once."""
    warnings.warn(message, NanoSpecWarning, stacklevel=stacklevel)
