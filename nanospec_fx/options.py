"""Options of the ``nanospec`` backend, as given to ``torch.compile(..., options={...})``.

Keys that are not nanospec's and that inductor knows (``"max_autotune"``, ``"triton.cudagraphs"``...)
go to inductor unchanged; any other key is an error, so a typo never passes silently.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from nanospec_fx.state import DEFAULT_CAPACITY


@dataclass(frozen=True)
class NanoSpecOptions:
    capacity: int = DEFAULT_CAPACITY
    """Slots of the active vocabulary (the paper's 3072); clamped to V."""
    observe_inputs: bool = True
    """Add every token id the drafter embeds to the active vocabulary."""
    vocab_size: int | None = None
    """Width of the head, when the graph does not make it clear."""
    head: str | None = None
    """Name of the head's weight or module path (e.g. ``"lm_head"``) when there are several candidates."""
    num_pinned: int = 0
    """Slots at the start of the set that are never evicted (filled by the first observed tokens)."""
    inductor: bool = True
    """Compile the rewritten graph with inductor; ``False`` runs it eagerly (debugging, fast tests)."""
    inductor_options: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, options: dict | None) -> "NanoSpecOptions":
        options = dict(options or {})
        names = {f.name for f in fields(cls)} - {"inductor_options"}
        ours = {k: options.pop(k) for k in list(options) if k in names}
        unknown = [k for k in options if not _is_inductor_key(k)]
        if unknown:
            raise ValueError(
                f"unknown nanospec option(s) {unknown}; nanospec options are {sorted(names)}, "
                "and inductor config keys are passed through"
            )
        opts = cls(**ours, inductor_options=options)
        opts.validate()
        return opts

    def validate(self) -> None:
        _check(isinstance(self.capacity, int) and not isinstance(self.capacity, bool) and self.capacity > 0,
               f"capacity must be a positive int, got {self.capacity!r}")
        _check(isinstance(self.observe_inputs, bool), f"observe_inputs must be a bool, got {self.observe_inputs!r}")
        _check(self.vocab_size is None or (isinstance(self.vocab_size, int) and self.vocab_size > 0),
               f"vocab_size must be a positive int, got {self.vocab_size!r}")
        _check(self.head is None or isinstance(self.head, str), f"head must be a str, got {self.head!r}")
        _check(isinstance(self.num_pinned, int) and 0 <= self.num_pinned < self.capacity,
               f"num_pinned must be an int in [0, capacity), got {self.num_pinned!r}")
        _check(isinstance(self.inductor, bool), f"inductor must be a bool, got {self.inductor!r}")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_inductor_key(key: str) -> bool:
    from torch._inductor import config

    return key in config.get_config_copy()


def mode_config(mode: str | None) -> dict[str, Any]:
    """Inductor config patches for a ``torch.compile`` mode (``"max-autotune"``...)."""
    if mode in (None, "default"):
        return {}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))
