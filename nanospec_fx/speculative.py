"""Greedy EAGLE speculative decoding of a transformers causal LM that keeps the target's KV cache.

:func:`nanospec_fx.eagle.speculative_generate` recomputes the target over the whole sequence each
round: simple, obviously lossless, and only fit for tiny targets. This module is the loop a real
target needs, kept apart from ``eagle.py`` because its job is the *target's* side (a cache that
grows by the verified tokens and is cropped back to the accepted ones), while ``eagle.py`` holds
the drafter and its draft loops, which it reuses unchanged.

A round drafts a chain of ``depth`` tokens after the last committed token, runs the target once
over ``[last committed token] + drafts`` on its cache, accepts the longest prefix equal to the
target's greedy choices plus the target's own next token, and crops the cache to the committed
sequence. The drafter is fed the target's features at the accepted positions (EAGLE's feature
input: the input of the target's final norm). With a nanospec drafter, the target's top-k at every
verified position (``observe="verified"``, rejected drafts included, as in the paper) or only at
the accepted ones (``observe="accepted"``) joins the active vocabulary.
"""
from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from nanospec_fx.eagle import KVCache, _state, draft_chain, drafter_cache, feed

OBSERVE = ("verified", "accepted", "none")


class HFTarget:
    """A transformers causal LM with a KV cache: prefill, extend by a few tokens, crop back.

    Each call returns the logits of the positions it ran and their *features*: the input of the
    model's final norm, caught by a forward pre-hook (EAGLE's feature; ``output_hidden_states``
    gives the normed output in recent transformers versions).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.norm = final_norm(model)
        self._features: torch.Tensor | None = None
        self.cache = None
        self.norm.register_forward_pre_hook(self._catch)
        # transformers renames past_key_values to cache (5.x deprecates the old name)
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _catch(self, module, args):
        self._features = args[0]

    def __len__(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Start a request: run ``ids [1, P]`` on a fresh cache. Returns logits ``[P or 1, V]``
        (all positions only if ``all_logits``: the head over a long prompt is costly) and features ``[P, H]``."""
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        for layer in getattr(self.cache, "layers", ()):
            if hasattr(layer, "activate_past_recording"):  # sliding-window layers: keep what a crop may need
                layer.activate_past_recording()
        return self._run(ids, None if all_logits else 1)

    @torch.inference_mode()
    def extend(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``ids [1, T]`` after the cached positions; returns logits ``[T, V]`` and features ``[T, H]``."""
        if self.cache is None:
            raise RuntimeError("HFTarget.extend before prefill")
        return self._run(ids, None)

    def crop(self, length: int) -> None:
        """Drop cached positions from ``length`` on (the rejected drafts); call it after every
        :meth:`extend`, also with nothing to drop: sliding-window layers are trimmed back then."""
        if hasattr(self.cache, "layers"):  # transformers >= 5: crop(-tokens to remove)
            self.cache.crop(length - len(self))
        elif length < len(self):  # 4.x: crop(new length)
            self.cache.crop(length)

    def _run(self, ids, keep):
        kwargs = {} if keep is None else {"logits_to_keep": keep}
        kwargs[self._cache_arg] = self.cache  # updated in place
        out = self.model(input_ids=ids, use_cache=True, **kwargs)
        return out.logits[0], self._features[0]


def final_norm(model: nn.Module) -> nn.Module:
    """The final norm of a transformers causal LM (``model.model.norm`` and its usual spellings)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    for name in ("norm", "final_layernorm", "ln_f", "final_layer_norm"):
        norm = getattr(base, name, None)
        if isinstance(norm, nn.Module):
            return norm
    raise ValueError(f"{type(model).__name__}: no final norm found (looked for norm, final_layernorm, ln_f, "
                     "final_layer_norm on its base model); EAGLE features are the input of that norm")


@dataclass
class DecodeStats:
    """What one request did: rounds, drafts accepted per round, where the time went."""

    rounds: int = 0
    accepted: list[int] = field(default_factory=list)
    drafted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    new_tokens: int = 0
    active_size: int | None = None

    @property
    def mean_accept_length(self) -> float:
        """tau: tokens committed per round (accepted drafts + the target's own token)."""
        return sum(a + 1 for a in self.accepted) / max(self.rounds, 1)


def _clock(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.inference_mode()
def eagle_generate(
    target: HFTarget,
    drafter: Callable | None,
    prompt: torch.Tensor,
    max_new_tokens: int,
    depth: int = 1,
    observe: str = "verified",
    target_topk: int = 3,
    prompt_topk: bool = False,
    cache_len: int | None = None,
) -> tuple[torch.Tensor, DecodeStats]:
    """Greedy decoding of ``prompt [1, P]`` with EAGLE chain drafts; returns ``([1, P + max_new_tokens], stats)``.

    ``drafter=None`` or ``depth=0`` decodes with the target alone on the same cache (the baseline).
    With a nanospec drafter the active set is seeded with the prompt (plus the target's top-k over
    the prompt if ``prompt_topk``: a head over every prompt position, costly on a CPU) and gets the
    target's ``target_topk`` per position named by ``observe`` (see :data:`OBSERVE`). ``cache_len``
    fixes the drafter's cache length (default: the request's length rounded up to 64); one length for
    every request keeps a compiled drafter at one graph per call shape.
    """
    if observe not in OBSERVE:
        raise ValueError(f"observe must be one of {OBSERVE}, got {observe!r}")
    if prompt.dim() != 2 or prompt.shape[0] != 1 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be token ids of shape [1, P] with P >= 1, got {tuple(prompt.shape)}")
    if depth < 0 or max_new_tokens < 1:
        raise ValueError(f"need depth >= 0 and max_new_tokens >= 1, got depth={depth}, max_new_tokens={max_new_tokens}")
    device, p = prompt.device, prompt.shape[1]
    drafting = drafter is not None and depth > 0
    stats = DecodeStats()
    start = _clock(device)
    logits, features = target.prefill(prompt, all_logits=drafting and prompt_topk)
    seq = prompt[0].tolist() + [int(logits[-1].argmax())]
    state = _state(drafter) if drafting else None
    if drafting:
        need = p + max_new_tokens + depth + 2
        if cache_len is not None and cache_len < need:
            raise ValueError(f"cache_len={cache_len} is too short for this request: it needs {need}")
        cache = drafter_cache(drafter, cache_len or -(-need // 64) * 64)
        if state is not None:
            state.observe(prompt, validate=False)
            _observe(state, logits, target_topk)
        root = feed(drafter, cache, torch.tensor(seq[1:], device=device), features, 0)
        if state is None and (state := _state(drafter)) is not None:  # made by this first compiled call
            _observe(state, logits, target_topk)
    n = p  # seq[n] is committed but not yet in the target's cache
    while len(seq) - p < max_new_tokens:
        path: list[int] = []
        if drafting:
            t0 = _clock(device)
            path = _chain(drafter, cache, root, n, depth)
            stats.draft_s += _clock(device) - t0
        t0 = _clock(device)
        logits, features = target.extend(torch.tensor([[seq[n]] + path], device=device))
        greedy = logits.argmax(-1).tolist()
        m = 0
        while m < len(path) and path[m] == greedy[m]:
            m += 1
        seq += path[:m] + [greedy[m]]
        target.crop(n + 1 + m)
        stats.verify_s += _clock(device) - t0
        if drafting:
            t0 = _clock(device)
            if state is not None and observe != "none":
                _observe(state, logits if observe == "verified" else logits[: m + 1], target_topk)
            root = feed(drafter, cache, torch.tensor(seq[n + 1:], device=device), features[: m + 1], n)
            stats.draft_s += _clock(device) - t0
        n += m + 1
        stats.rounds += 1
        stats.accepted.append(m)
        stats.drafted += len(path)
    stats.total_s = _clock(device) - start
    stats.new_tokens = max_new_tokens
    stats.active_size = len(state) if state is not None else None
    return torch.tensor([seq[: p + max_new_tokens]], device=device), stats


def _chain(drafter, cache: KVCache, root, n: int, depth: int) -> list[int]:
    """A chain of ``depth`` drafts; stops before a draft the drafter could not make (score -inf:
    no active token at all)."""
    tree = draft_chain(drafter, cache, *root, n, depth)
    tokens, ok = tree.tokens.tolist(), torch.isfinite(tree.scores).tolist()
    return tokens[: ok.index(False)] if False in ok else tokens


def _observe(state, logits: torch.Tensor, k: int) -> None:
    if k > 0:
        state.observe(logits.topk(k, dim=-1).indices, validate=False)
