"""The plugin's settings from the environment of vLLM's processes, as the core's :class:`VocabConfig`.

vLLM starts the plugin in processes the user does not construct, so its options are environment variables; they map
onto the same :class:`~nanospec_fx.vocab.config.VocabConfig` the backend's ``options`` build, with the core's policy
names (``context``, ``static``, ``hybrid``). No vLLM here: the settings are engine-agnostic.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from nanospec_fx.vocab.config import DEFAULT_CAPACITY, DEFAULT_PINNED_SIZE, POLICIES, VocabConfig

ENV_SWITCH = "NANOSPEC_VLLM"
ENV_CAPACITY = "NANOSPEC_VLLM_CAPACITY"
ENV_TOPK = "NANOSPEC_VLLM_TOPK"
ENV_RECORD = "NANOSPEC_VLLM_RECORD"
ENV_RECORD_DIR = "NANOSPEC_VLLM_RECORD_DIR"
ENV_MAX_REQUESTS = "NANOSPEC_VLLM_MAX_REQUESTS"
ENV_POLICY = "NANOSPEC_VLLM_POLICY"
ENV_STATIC = "NANOSPEC_VLLM_STATIC"
ENV_STATIC_SIZE = "NANOSPEC_VLLM_STATIC_SIZE"
ENV_ACTIVE_AFTER = "NANOSPEC_VLLM_ACTIVE_AFTER"
ENV_HEAD = "NANOSPEC_VLLM_HEAD"
#: which of vLLM's model runners the hooks go on, where a release has both (0.33: ``1`` = Model Runner V2)
ENV_V2 = "NANOSPEC_VLLM_V2"
DEFAULT_TOPK = 3
#: model steps after which a plugin whose drafter hooks never ran says it is inactive (warm-up steps included)
DEFAULT_ACTIVE_AFTER = 8


def enabled() -> bool:
    """Whether the switch is on (``NANOSPEC_VLLM`` set to 1/true/yes/on)."""
    return os.environ.get(ENV_SWITCH, "").strip().lower() in ("1", "true", "yes", "on")


def v2_requested() -> bool:
    """Whether ``NANOSPEC_VLLM_V2`` asks for the Model Runner V2 hooks (1/true/yes/on)."""
    return os.environ.get(ENV_V2, "").strip().lower() in ("1", "true", "yes", "on")


def v2_setting() -> str | None:
    """``NANOSPEC_VLLM_V2`` as set (None: unset or empty), for the adapters that say when it is ignored."""
    return os.environ.get(ENV_V2, "").strip() or None


def policy() -> str:
    """``NANOSPEC_VLLM_POLICY`` as one of the core's policy names (default ``context``); ``ValueError`` if unknown."""
    name = os.environ.get(ENV_POLICY, "").strip().lower() or "context"
    if name not in POLICIES:
        raise ValueError(f"nanospec: {ENV_POLICY}={name!r}; expected one of {', '.join(POLICIES)}")
    return name


@dataclass(frozen=True)
class Settings:
    """Everything the environment asks of one drafter head."""

    vocab: VocabConfig
    max_requests: int
    topk: int
    record: bool
    record_dir: str | None


def settings(vocab_size: int, max_num_seqs: int, draft_to_target=None) -> Settings:
    """The settings for a head over ``vocab_size`` token ids (a draft vocabulary's head: ``draft_to_target``, the
    target id of each head row). ``ValueError`` for a bad value: a misconfigured server must not start."""
    name = policy()
    vocab = {"capacity": capacity(), "policy": name}
    if name != "context":  # static / hybrid: the frequency ranking is the listed file
        ids = static_tokens(vocab_size, name)
        counts = [0] * vocab_size
        for rank, t in enumerate(ids):  # most frequent first
            counts[t] = len(ids) - rank
        vocab.update(frequencies=counts, static_size=len(ids),
                     pinned_size=min(len(ids), _int(ENV_STATIC_SIZE, DEFAULT_PINNED_SIZE)))
    if draft_to_target is not None:
        vocab.update(draft_to_target=draft_to_target, target_vocab_size=vocab_size)
    record_dir = os.environ.get(ENV_RECORD_DIR) or None
    return Settings(VocabConfig(**vocab), max_requests=_int(ENV_MAX_REQUESTS, max_num_seqs),
                    topk=0 if name == "static" else _int(ENV_TOPK, DEFAULT_TOPK, minimum=0),
                    record=os.environ.get(ENV_RECORD, "") == "1" or record_dir is not None, record_dir=record_dir)


def capacity() -> int:
    """``NANOSPEC_VLLM_CAPACITY``: active tokens per request."""
    return _int(ENV_CAPACITY, DEFAULT_CAPACITY)


def head_mode() -> str:
    """``NANOSPEC_VLLM_HEAD``: ``auto`` (default: the compact head only where the cost model predicts it beats the full
    head on this device) or ``compact`` (always, e.g. to test the plugin on a tiny model)."""
    mode = os.environ.get(ENV_HEAD, "").strip().lower() or "auto"
    if mode not in ("auto", "compact"):
        raise ValueError(f"nanospec: {ENV_HEAD}={mode!r}; expected auto or compact")
    return mode


def active_after() -> int:
    """Model steps after which hooks that never ran make the plugin say it is inactive."""
    return _int(ENV_ACTIVE_AFTER, DEFAULT_ACTIVE_AFTER)


def static_tokens(vocab_size: int, name: str | None = None) -> list[int] | None:
    """The listed tokens of the ``static``/``hybrid`` policies, most frequent first (None: the ``context`` policy).
    ``ValueError`` for a missing or bad file or an id outside ``[0, vocab_size)``."""
    name = name or policy()
    if name == "context":
        return None
    path = os.environ.get(ENV_STATIC)
    if not path:
        raise ValueError(f"nanospec: {ENV_POLICY}={name} needs {ENV_STATIC}=FILE (token ids, most frequent first)")
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"nanospec: {ENV_STATIC}={path!r} cannot be read: {e}") from None
    try:
        ids = [int(t) for t in re.split(r"[\s,\[\]]+", text) if t]
    except ValueError:
        raise ValueError(f"nanospec: {ENV_STATIC}={path!r} must hold integer token ids (whitespace, commas or a "
                         "JSON list)") from None
    ids = list(dict.fromkeys(ids))  # first occurrence keeps its rank
    if name == "static":
        ids = ids[:_int(ENV_STATIC_SIZE, max(1, len(ids)))]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if not ids or bad:
        raise ValueError(f"nanospec: {ENV_STATIC}={path!r} has no ids or ids outside [0, {vocab_size}): {bad[:5]}")
    return ids


def _int(name: str, default: int, minimum: int = 1) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return int(default)
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"nanospec: {name}={raw!r} must be an integer") from None
    if value < minimum:
        raise ValueError(f"nanospec: {name}={value} must be >= {minimum}")
    return value
