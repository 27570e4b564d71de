"""Options of the ``nanospec`` backend, as given to ``torch.compile(..., options={...})``.

Keys that are not nanospec's and that inductor knows (``"max_autotune"``, ``"triton.cudagraphs"``...)
go to inductor unchanged; any other key is an error, so a typo never passes silently.

``torch.compile`` checks nothing: the backend parses the options at the first call. A bad option raises
:class:`OptionError` (a ``ValueError``) there, which Dynamo passes to the caller as it is; ``nanospec_fx.compile``
(or ``NanoSpecOptions.parse``) checks them at once and raises the same error before any call.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from torch._dynamo.exc import ShortenTraceback

from nanospec_fx.vocab.config import VocabConfig, is_positive_int, require


class OptionError(ValueError, ShortenTraceback):
    """A bad ``options={...}`` key or value of the nanospec backend.

    A ``ValueError``; also a Dynamo ``ShortenTraceback``, the one kind of backend exception Dynamo re-raises
    unchanged (any other becomes ``BackendCompilerFailed``, worded as a compiler crash to report to PyTorch).
    ``str()`` is this message only: Dynamo appends its debugging footer to every exception passing through."""

    def __init__(self, message: str):
        ShortenTraceback.__init__(self, message, first_useful_frame=None)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        return type(self), (self.message,)


def option_error(exc: Exception) -> OptionError:
    """``exc`` (a ValueError or TypeError of an option check) as an :class:`OptionError`."""
    return exc if isinstance(exc, OptionError) else OptionError(str(exc))


@dataclass(frozen=True)
class NanoSpecOptions:
    observe_inputs: bool = True
    """Add every token id the compiled model embeds to the active vocabulary."""
    vocab_size: int | None = None
    """Width of the head, when the graph does not make it clear."""
    head: str | None = None
    """Name of the head's weight or module path (e.g. ``"lm_head"``) when there are several candidates."""
    observe_topk: int | None = None
    """Target-observer role: compile a *target* and feed its top-k predictions at every scored
    position into the active vocabulary given by ``vocab``; the target's outputs are unchanged."""
    vocab: Any = None
    """With ``observe_topk``: the drafter (module) or its ActiveVocab."""
    observe_prompt: bool = False
    """With ``observe_topk``: also observe the positions whose logits the caller did not ask for
    (a ``hidden[:, start:]`` slice, as transformers' ``logits_to_keep``: the prompt at prefill), at the
    cost of one more head pass over them."""
    inductor: bool = True
    """Compile the rewritten graph with inductor; ``False`` runs it eagerly (debugging, fast tests)."""
    vocab_config: VocabConfig = field(default_factory=VocabConfig)
    """The vocabulary options (capacity, num_pinned, policy, frequencies, static_size, pinned_size,
    draft_to_target, target_vocab_size), given as keys of the same names."""
    inductor_options: dict = field(default_factory=dict)
    """The other keys: inductor config patches."""

    @classmethod
    def parse(cls, options: dict | None) -> "NanoSpecOptions":
        """The options checked: an unknown key or a bad value raises :class:`OptionError`."""
        try:
            return cls._parse(options)
        except (ValueError, TypeError) as exc:
            raise option_error(exc) from None

    @classmethod
    def _parse(cls, options: dict | None) -> "NanoSpecOptions":
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"options must be a dict, got {type(options).__name__}")
        options = {k: v.value if isinstance(v, HeldOption) else v for k, v in (options or {}).items()}
        names = option_names()
        ours = {k: options.pop(k) for k in list(options) if k in names}
        unknown = [k for k in options if not _is_inductor_key(k)]
        if unknown:
            raise ValueError(
                f"unknown nanospec option(s) {unknown}; nanospec options are {sorted(names)}, "
                "and inductor config keys are passed through"
            )
        vocab = VocabConfig(**{k: ours.pop(k) for k in list(ours) if k in VocabConfig.names()})
        opts = cls(**ours, vocab_config=vocab, inductor_options=options)
        opts.validate()
        return opts

    def validate(self) -> None:
        """Check the options that are not the vocabulary's (VocabConfig checks those when it is built)."""
        require(isinstance(self.observe_inputs, bool), f"observe_inputs must be a bool, got {self.observe_inputs!r}")
        require(self.vocab_size is None or is_positive_int(self.vocab_size),
                f"vocab_size must be a positive int, got {self.vocab_size!r}")
        require(self.head is None or isinstance(self.head, str), f"head must be a str, got {self.head!r}")
        require(self.observe_topk is None or is_positive_int(self.observe_topk),
                f"observe_topk must be a positive int, got {self.observe_topk!r}")
        require((self.observe_topk is None) == (self.vocab is None),
                "observe_topk and vocab go together: options={'observe_topk': 3, 'vocab': drafter}")
        require(isinstance(self.observe_prompt, bool), f"observe_prompt must be a bool, got {self.observe_prompt!r}")
        require(isinstance(self.inductor, bool), f"inductor must be a bool, got {self.inductor!r}")


class HeldOption:
    """An option value that is not a plain scalar (a tensor, a FrequencyTable, a list of ids), as the backend leaves
    it in the caller's ``options`` dict: compared by identity.

    ``torch.compile`` keeps that dict and Dynamo compares two compiled functions' options with ``==`` when it picks a
    cache entry (a second drafter of the same class compiled with its own ``draft_to_target``): a tensor answers
    elementwise, and the comparison raised "Boolean value of Tensor with more than one value is ambiguous" at that
    drafter's first call. Held, two options are equal only when they are the same object (otherwise Dynamo compiles
    again, which is always right)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HeldOption) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)

    def __repr__(self) -> str:
        return f"HeldOption({self.value!r})"


_SCALARS = (str, int, float, bool, type(None))


def hold_options(options: dict | None) -> None:
    """Replace, in place, every value of ``options`` that is not a plain scalar by a :class:`HeldOption` (the parse
    unwraps them): the dict is the one ``torch.compile`` compares (see :class:`HeldOption`)."""
    if isinstance(options, dict):
        for key, value in list(options.items()):
            if not isinstance(value, (_SCALARS, HeldOption)):
                options[key] = HeldOption(value)


def option_names() -> set[str]:
    """Every key the backend's options take as nanospec's own (the vocabulary options included)."""
    return ({f.name for f in fields(NanoSpecOptions)} - {"vocab_config", "inductor_options"}) | VocabConfig.names()


def _is_inductor_key(key: str) -> bool:
    from torch._inductor import config

    return key in config.get_config_copy()


def mode_config(mode: str | None) -> dict[str, Any]:
    """Inductor config patches for a ``torch.compile`` mode (``"max-autotune"``...)."""
    if mode in (None, "default"):
        return {}
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def with_mode(options: dict | None, mode: str | None) -> dict | None:
    """``options`` with the inductor config of the ``torch.compile`` mode ``mode`` merged under them: what
    ``nanospec_fx.compile(m, capacity=16, mode="max-autotune")`` passes to ``torch.compile``, which refuses ``mode=``
    beside ``options=``. Keys ``options`` gives win over the mode's. An unknown mode: :class:`OptionError` saying
    what to write instead."""
    if mode is None:
        return options
    try:
        patches = mode_config(mode)
    except (RuntimeError, TypeError) as exc:
        raise OptionError(
            f"{exc}; or leave mode out and give its inductor config as options, e.g. "
            "nanospec_fx.compile(model, capacity=..., max_autotune=True)") from None
    merged = {**patches, **(options or {})}
    return merged or None


def split_keywords(options: dict | None, keywords: dict) -> tuple[dict | None, dict]:
    """``(options, torch.compile keywords)``: the nanospec options passed as keywords (``capacity=64``, as
    ``attach`` and ``speculative_pair`` take them) joined to ``options``; the other keywords are torch.compile's."""
    names = option_names()
    keywords = dict(keywords)
    ours = {k: keywords.pop(k) for k in list(keywords) if k in names}
    twice = sorted(set(ours) & set(options or {}))
    if twice:
        raise ValueError(f"nanospec option(s) {twice} given both in options= and as keywords: give each once")
    return ({**(options or {}), **ours} if ours else options), keywords

