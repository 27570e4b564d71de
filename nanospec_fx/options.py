"""Options of the ``nanospec`` backend, as given to ``torch.compile(..., options={...})``.

Keys that are not nanospec's and that inductor knows (``"max_autotune"``, ``"triton.cudagraphs"``...)
go to inductor unchanged; any other key is an error, so a typo never passes silently.

``torch.compile`` checks nothing: the backend parses the options at the first call, where Dynamo
wraps the ``ValueError`` in its ``BackendCompilerFailed``. ``nanospec_fx.compile`` (or
``NanoSpecOptions.parse``) checks them at once and raises the ``ValueError`` itself.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from typing import Any

from nanospec_fx.policies import POLICIES
from nanospec_fx.state import DEFAULT_CAPACITY


DEPRECATED = {"observe_all_positions": "observe_prompt"}  # old option name -> its name now


@dataclass(frozen=True)
class NanoSpecOptions:
    capacity: int = DEFAULT_CAPACITY
    """Slots of the active vocabulary (the paper's 3072); clamped to V."""
    observe_inputs: bool = True
    """Add every token id the compiled model embeds to the active vocabulary."""
    vocab_size: int | None = None
    """Width of the head, when the graph does not make it clear."""
    head: str | None = None
    """Name of the head's weight or module path (e.g. ``"lm_head"``) when there are several candidates."""
    num_pinned: int = 0
    """Slots at the start of the set that are never evicted (filled by the first observed tokens)."""
    policy: str = "context"
    """``context`` (NanoSpec), ``static`` (FR-Spec top-N) or ``hybrid`` (pinned frequent core + context)."""
    frequencies: Any = None
    """Token frequencies for ``static``/``hybrid``: a FrequencyTable, a path to one, or counts [V]."""
    static_size: int = 32768
    """Tokens of the ``static`` policy (FR-Spec's 32k)."""
    pinned_size: int = 1024
    """Pinned frequent tokens of the ``hybrid`` policy."""
    draft_to_target: Any = None
    """For heads over a draft vocabulary (EAGLE-3): target token id of each head row, int [R]
    (EAGLE-3's offsets ``d2t`` give ``arange(R) + d2t``). Token ids observed are target ids."""
    target_vocab_size: int | None = None
    """Size of the target vocabulary with ``draft_to_target`` (default: its largest id + 1)."""
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
    inductor_options: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, options: dict | None) -> "NanoSpecOptions":
        options = dict(options or {})
        for old, new in DEPRECATED.items():
            if old in options:
                warnings.warn(f"nanospec option {old!r} is now {new!r}", DeprecationWarning, stacklevel=3)
                options.setdefault(new, options.pop(old))
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
        def positive_int(v):
            return isinstance(v, int) and not isinstance(v, bool) and v > 0

        _check(positive_int(self.capacity), f"capacity must be a positive int, got {self.capacity!r}")
        _check(isinstance(self.observe_inputs, bool), f"observe_inputs must be a bool, got {self.observe_inputs!r}")
        _check(self.vocab_size is None or positive_int(self.vocab_size), f"vocab_size must be a positive int, got {self.vocab_size!r}")
        _check(self.head is None or isinstance(self.head, str), f"head must be a str, got {self.head!r}")
        _check(isinstance(self.num_pinned, int) and 0 <= self.num_pinned < self.capacity,
               f"num_pinned must be an int in [0, capacity), got {self.num_pinned!r}")
        _check(self.policy in POLICIES, f"policy must be one of {POLICIES}, got {self.policy!r}")
        _check(positive_int(self.static_size), f"static_size must be a positive int, got {self.static_size!r}")
        _check(positive_int(self.pinned_size), f"pinned_size must be a positive int, got {self.pinned_size!r}")
        _check(self.observe_topk is None or positive_int(self.observe_topk),
               f"observe_topk must be a positive int, got {self.observe_topk!r}")
        _check((self.observe_topk is None) == (self.vocab is None),
               "observe_topk and vocab go together: options={'observe_topk': 3, 'vocab': drafter}")
        _check(isinstance(self.observe_prompt, bool), f"observe_prompt must be a bool, got {self.observe_prompt!r}")
        _check(self.target_vocab_size is None or positive_int(self.target_vocab_size),
               f"target_vocab_size must be a positive int, got {self.target_vocab_size!r}")
        _check(isinstance(self.inductor, bool), f"inductor must be a bool, got {self.inductor!r}")

    def state_config(self) -> dict:
        """Keyword arguments of ``state_for``/``ActiveVocab`` that these options ask for."""
        from nanospec_fx.policies import resolve_policy

        cfg = resolve_policy(self.policy, self.capacity, self.frequencies, self.static_size, self.pinned_size, self.num_pinned)
        return dict(capacity=cfg.capacity, num_pinned=cfg.num_pinned, seed_ids=cfg.seed_ids, observes=cfg.observes,
                    policy=cfg.name, token_to_row=self.token_to_row())

    def token_to_row(self):
        """The token -> head-row map built from ``draft_to_target`` (None without one)."""
        if self.draft_to_target is None:
            return None
        import torch

        d2t = torch.as_tensor(self.draft_to_target, dtype=torch.int64).flatten().cpu()
        if d2t.numel() == 0 or int(d2t.min()) < 0:
            raise ValueError("draft_to_target must hold non-negative target token ids, one per head row")
        size = self.target_vocab_size or int(d2t.max()) + 1
        if int(d2t.max()) >= size:
            raise ValueError(f"draft_to_target has ids >= target_vocab_size={size}")
        t2r = torch.full((size,), -1, dtype=torch.int64)
        t2r[d2t] = torch.arange(d2t.numel())
        return t2r


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


def split_keywords(options: dict | None, keywords: dict) -> tuple[dict | None, dict]:
    """``(options, torch.compile keywords)``: the nanospec options passed as keywords (``capacity=64``, as
    ``attach`` and ``speculative_pair`` take them) joined to ``options``; the other keywords are torch.compile's."""
    names = ({f.name for f in fields(NanoSpecOptions)} - {"inductor_options"}) | set(DEPRECATED)
    keywords = dict(keywords)
    ours = {k: keywords.pop(k) for k in list(keywords) if k in names}
    twice = sorted(set(ours) & set(options or {}))
    if twice:
        raise ValueError(f"nanospec option(s) {twice} given both in options= and as keywords: give each once")
    return ({**(options or {}), **ours} if ours else options), keywords

