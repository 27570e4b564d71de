"""Speculative decoding with an EAGLE drafter: the one decode loop, for greedy decoding and for sampling.

:func:`decode` is the loop; what differs between uses is passed in, never copied:

* the *target* (how the drafts are verified): :class:`HFTarget` keeps a transformers model's KV cache,
  grown by the verified tokens and cropped back to the accepted ones (one path per round: chain drafts);
  :class:`RecomputeTarget` reruns a plain ``ids -> (logits, features)`` function over the whole sequence
  and every root-to-leaf path of a tree (simple and obviously lossless: tiny targets and tests);
* the *rule* (what is drafted and what is accepted): :class:`Greedy` (chain or EAGLE-2 tree, the longest
  prefix equal to the target's greedy choices) or :class:`Sampling` (drafts drawn from the pruned ``q``,
  speculative / recursive rejection sampling: the output follows the target's distribution);
* timing: an optional ``timer(phase)`` context manager owned by the caller (a benchmark); the loop itself
  never synchronises the device to time itself.

A round drafts after the last committed token, verifies, commits the accepted drafts plus one token of the
target's, and feeds the drafter the target's features at the accepted positions (EAGLE's feature: the input
of the target's final norm). With a nanospec drafter the active set is seeded with the prompt (and the
target's top-k at the prompt positions it returned logits for) and gets the target's top-k at every
verified position (``observe="verified"``, rejected drafts included, as in the paper) or only at the
accepted ones (``observe="accepted"``). :func:`eagle_generate`, :func:`speculative_generate` and
:func:`speculative_sample` are the loop with one target and one rule each.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from nanospec_fx.eagle import (
    DraftTree, SampledDraft, draft_chain, draft_sampled, draft_tree, drafter_cache, feed, verify_sampled,
)
from nanospec_fx.sampling import SpeculativeSampler
from nanospec_fx.diagnostics.lookup import active_vocab
from nanospec_fx.vocab.state import ActiveVocab

OBSERVE = ("verified", "accepted", "none")
TargetForward = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Timer = Callable[[str], AbstractContextManager]


# ----------------------------------------------------------------------------- targets
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
        self.cache, self.cache_device = None, None
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

        self.cache, self.cache_device = DynamicCache(config=self.model.config), ids.device
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

    def verify(self, seq: list[int], paths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``[seq[-1]] + path`` on the cache (one path: a cache holds one continuation); returns logits
        ``[1, 1 + len(path), V]`` and features ``[1, 1 + len(path), H]``."""
        if len(paths) != 1:
            raise ValueError(f"a KV-cache target verifies one path per round (chain drafts), got {len(paths)}: "
                             "draft a chain (top_k=1), or verify a tree with a RecomputeTarget")
        logits, features = self.extend(torch.tensor([[seq[-1]] + paths[0]], device=self.cache_device))
        return logits[None], features[None]

    def commit(self, length: int) -> None:
        """Keep the first ``length`` positions (the committed sequence but its last token)."""
        self.crop(length)

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


class RecomputeTarget:
    """A target without a cache: ``forward(ids [R, T]) -> (logits [R, T, V], features [R, T, H])`` over the
    whole sequence, every round, one row per root-to-leaf path (so it verifies trees)."""

    def __init__(self, forward: TargetForward):
        self.forward, self.device = forward, None

    def prefill(self, ids: torch.Tensor, all_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        self.device = ids.device
        logits, features = self.forward(ids)
        return logits[0] if all_logits else logits[0, -1:], features[0]

    def verify(self, seq: list[int], paths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and features from position ``len(seq) - 1`` on, one row per path (padded to the longest)."""
        n, longest = len(seq) - 1, max(len(path) for path in paths)
        batch = [seq + path + [0] * (longest - len(path)) for path in paths]
        logits, features = self.forward(torch.tensor(batch, device=self.device))
        return logits[:, n:], features[:, n:]

    def commit(self, length: int) -> None:
        """Nothing is kept between rounds."""


def hf_target_forward(model) -> TargetForward:
    """``ids [P, T] -> (logits, features)`` for a transformers causal LM (features: the final-norm output)."""
    def forward(ids):
        features = model.model(input_ids=ids).last_hidden_state
        return model.lm_head(features), features
    return forward


@torch.inference_mode()
def greedy_generate(target: TargetForward, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The target alone, greedy, recomputing the whole sequence each step: the reference output that tests
    and examples compare :func:`decode` with (written apart from it, so that it can judge it)."""
    ids = prompt
    for _ in range(max_new_tokens):
        next_id = target(ids)[0][:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_id], dim=-1)
    return ids


# ----------------------------------------------------------------------------- rules
class Greedy:
    """Greedy decoding: draft a chain (``chain``) or EAGLE-2's tree and keep its best ``num_nodes`` candidates
    (all: None); accept the longest path prefix equal to the target's greedy choices."""

    generator = None

    def __init__(self, depth: int, top_k: int = 1, num_nodes: int | None = None, chain: bool = True):
        if not (isinstance(depth, int) and depth >= 0 and isinstance(top_k, int) and top_k >= 1):
            raise ValueError(f"need depth >= 0 and top_k >= 1, got depth={depth!r}, top_k={top_k!r}")
        self.depth, self.top_k, self.num_nodes, self.chain = depth, top_k, num_nodes, chain
        self.width = 1 if chain else top_k  # cache slots a draft level takes
        self.select = self.width  # tokens the drafter picks per row itself (eagle.Choice): no [V] row needed

    def first(self, logits: torch.Tensor) -> int:
        return int(logits.argmax())

    def draft(self, drafter, cache, root, n: int) -> tuple[DraftTree, list[list[int]]]:
        if self.chain:
            tree = draft_chain(drafter, cache, *root, n, self.depth)
        else:
            tree = draft_tree(drafter, cache, *root, n, self.depth, self.top_k)
        return tree, tree.paths(self.num_nodes) or [[]]  # no candidate at all: the target adds one token

    def accept(self, draft: DraftTree, paths: list[list[int]], logits: torch.Tensor) -> tuple[int, int, list[int]]:
        """``(row, accepted drafts, committed tokens)`` from the target's ``logits [R, T, V]``."""
        greedy = logits.argmax(-1).tolist()  # the target's choice after seq + path[:j]
        row, accepted = 0, -1
        for i, path in enumerate(paths):
            m = 0
            while m < len(path) and path[m] == greedy[i][m]:
                m += 1
            if m > accepted:
                row, accepted = i, m
        return row, accepted, paths[row][:accepted] + [greedy[row][accepted]]


class Sampling:
    """Speculative sampling (temperature / top-k / top-p of ``sampler``): ``top_k = 1`` drafts a chain,
    ``top_k > 1`` a tree, every candidate verified by recursive rejection sampling (no ``num_nodes``
    reranking, which would bias the output); every random draw uses ``generator``."""

    def __init__(self, sampler: SpeculativeSampler, generator: torch.Generator | None, depth: int, top_k: int = 1):
        if not (isinstance(depth, int) and depth >= 1 and isinstance(top_k, int) and top_k >= 1):
            raise ValueError(f"depth and top_k must be ints >= 1, got depth={depth!r}, top_k={top_k!r}")
        if not isinstance(sampler, SpeculativeSampler):
            raise TypeError(f"sampler must be a nanospec_fx.sampling.SpeculativeSampler (e.g. SpeculativeSampler("
                            f"temperature=0.7, top_p=0.9)), got {type(sampler).__name__}")
        self.sampler, self.generator, self.depth, self.top_k, self.width = sampler, generator, depth, top_k, top_k
        self.select = 0  # drafts are drawn from the whole [V] distribution q: the drafter hands its logits

    def first(self, logits: torch.Tensor) -> int:
        return int(self.sampler.sample(self.sampler.probs(logits), self.generator))

    def draft(self, drafter, cache, root, n: int) -> tuple[SampledDraft, list[list[int]]]:
        draft = draft_sampled(drafter, cache, *root, n, self.depth, self.top_k, self.sampler, self.generator)
        tokens = draft.tokens.tolist()
        return draft, [[tokens[c] for c in path] for path in draft.leaf_paths]

    def accept(self, draft: SampledDraft, paths: list[list[int]], logits: torch.Tensor) -> tuple[int, int, list[int]]:
        row_of = {tuple(path[:j]): i for i, path in enumerate(draft.leaf_paths) for j in range(len(path) + 1)}
        accepted, committed = verify_sampled(
            draft, lambda nodes: self.sampler.probs(logits[row_of[tuple(nodes)], len(nodes)]), self.sampler,
            self.generator)
        return row_of[tuple(accepted)], len(accepted), committed


# ----------------------------------------------------------------------------- the loop
@dataclass
class DecodeStats:
    """What one request did: rounds, drafts accepted per round, drafts verified, the active set at the end."""

    rounds: int = 0
    accepted: list[int] = field(default_factory=list)  # drafted tokens accepted per round
    drafted: int = 0  # path tokens the target verified (summed over rounds)
    new_tokens: int = 0
    active_size: int | None = None

    @property
    def mean_accept_length(self) -> float:
        """tau: tokens committed per round (accepted drafts + the target's own token)."""
        return sum(a + 1 for a in self.accepted) / max(self.rounds, 1)


def _untimed(phase: str) -> AbstractContextManager:
    return nullcontext()


@torch.inference_mode()
def decode(
    target: HFTarget | RecomputeTarget,
    drafter: Callable | None,
    prompt: torch.Tensor,
    max_new_tokens: int,
    rule: Greedy | Sampling,
    observe: str = "verified",
    target_topk: int = 3,
    prompt_topk: bool = False,
    cache_len: int | None = None,
    on_draft: Callable[[DraftTree | SampledDraft], None] | None = None,
    timer: Timer | None = None,
) -> tuple[torch.Tensor, DecodeStats]:
    """Decode ``prompt [1, P]`` with ``rule``; returns ``([1, P + max_new_tokens], stats)``.

    ``drafter=None`` or ``rule.depth = 0`` decodes with the target alone (the baseline). ``observe``: where the
    target's top-k joins the active set (``"verified"``: every position of the verified row the round kept, which
    with one path per round is every verified position; ``"accepted"``: the accepted ones). ``prompt_topk``:
    the target's top-k at every prompt position seeds the active set (a head over the whole prompt on a
    cached target). ``cache_len`` fixes the drafter's cache length (default: the request's length rounded
    up to 64); one length for every request keeps a compiled drafter at one graph per call shape.
    ``on_draft`` sees each round's draft before it is verified; ``timer(phase)`` wraps each phase of a round (a
    benchmark's clock; the loop itself never waits for the device to time it): "draft" (the drafter's calls and
    the loop around them), "observe" (the target's top-k joining the active set) and "verify" (the target's
    forward, acceptance, and its top-k over the verified rows: the target's work, whichever drafter reads it).
    """
    if observe not in OBSERVE:
        raise ValueError(f"observe must be one of {OBSERVE}, got {observe!r}")
    if prompt.dim() != 2 or prompt.shape[0] != 1 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be token ids of shape [1, P] with P >= 1, got {tuple(prompt.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"need max_new_tokens >= 1, got {max_new_tokens}")
    if rule.generator is not None and rule.generator.device.type != prompt.device.type:
        raise ValueError(f"generator is on {rule.generator.device}, the prompt on {prompt.device}: "
                         "create it on the models' device, torch.Generator(device=...)")
    phase = timer or _untimed
    device, p = prompt.device, prompt.shape[1]
    drafting = drafter is not None and rule.depth > 0
    stats = DecodeStats()
    logits, features = target.prefill(prompt, all_logits=drafting and prompt_topk)
    seq = prompt[0].tolist() + [rule.first(logits[-1])]
    state = drafter_state(drafter) if drafting else None
    if drafting:
        need = p + max_new_tokens + rule.depth * rule.width + 2
        if cache_len is not None and cache_len < need:
            raise ValueError(f"cache_len={cache_len} is too short for this request: it needs {need}")
        cache = drafter_cache(drafter, cache_len or -(-need // 64) * 64)
        if state is not None:
            _seed(state, prompt, logits, target_topk)
        # The drafter reads (x[j+1], f[j]) at position j: positions 0..P-1 now, then n = len(seq) - 1.
        root = feed(drafter, cache, torch.tensor(seq[1:], device=device), features, 0, rule.select)
        if state is None and (state := drafter_state(drafter)) is not None:  # made by this first compiled call
            _seed(state, prompt, logits, target_topk)
    while len(seq) - p < max_new_tokens:
        n, draft, paths = len(seq) - 1, None, [[]]  # seq[n] is committed but not yet verified by the target
        if drafting:
            with phase("draft"):
                draft, paths = rule.draft(drafter, cache, root, n)
            if on_draft is not None:
                on_draft(draft)
        with phase("verify"):
            logits, features = target.verify(seq, paths)
            row, m, committed = (rule.accept(draft, paths, logits) if draft is not None
                                 else (0, 0, [rule.first(logits[0, 0])]))
            seq += committed
            target.commit(len(seq) - 1)
            seeds = (_target_topk(logits[row] if observe == "verified" else logits[row, : m + 1], target_topk)
                     if state is not None and observe != "none" else None)  # the target's work: booked as verify
        if drafting:
            if seeds is not None:
                with phase("observe"):
                    state.observe(seeds, validate=False)
            with phase("draft"):
                root = feed(drafter, cache, torch.tensor(seq[n + 1:], device=device), features[row, : m + 1], n,
                            rule.select)
        stats.rounds += 1
        stats.accepted.append(m)
        stats.drafted += sum(len(path) for path in paths)
    stats.new_tokens = max_new_tokens
    stats.active_size = len(state) if state is not None else None
    return torch.tensor([seq[: p + max_new_tokens]], device=device), stats


def drafter_state(drafter) -> ActiveVocab | None:
    """The drafter's active vocabulary, or None where it has none (not compiled with nanospec, or not called
    yet): it then drafts over the full vocabulary."""
    try:
        return active_vocab(drafter)
    except (LookupError, TypeError):
        return None


def _seed(state: ActiveVocab, prompt: torch.Tensor, logits: torch.Tensor, k: int) -> None:
    state.observe(prompt, validate=False)
    if (seeds := _target_topk(logits, k)) is not None:
        state.observe(seeds, validate=False)


def _target_topk(logits: torch.Tensor, k: int) -> torch.Tensor | None:
    """The target's top-``k`` token ids at each of its scored rows (None for ``k = 0``): what joins the drafter's
    active set. Taken over the logits the verification already holds, as part of the target's work."""
    return logits.topk(k, dim=-1).indices if k > 0 else None


# ----------------------------------------------------------------------------- the loop, ready to call
def eagle_generate(target: HFTarget, drafter: Callable | None, prompt: torch.Tensor, max_new_tokens: int,
                   depth: int = 1, observe: str = "verified", target_topk: int = 3, prompt_topk: bool = False,
                   cache_len: int | None = None, sampler: SpeculativeSampler | None = None,
                   generator: torch.Generator | None = None, timer: Timer | None = None):
    """A transformers target on its KV cache with chain drafts of ``depth``: greedy, or sampled with
    ``sampler``; see :func:`decode`. Returns ``(ids [1, P + max_new_tokens], stats)``."""
    rule = Greedy(depth) if sampler is None else Sampling(sampler, generator, depth)
    return decode(target, drafter, prompt, max_new_tokens, rule, observe, target_topk, prompt_topk, cache_len,
                  timer=timer)


def speculative_generate(target: TargetForward, drafter: Callable, prompt: torch.Tensor, max_new_tokens: int,
                         depth: int = 4, top_k: int = 4, num_nodes: int | None = 16, chain: bool = False,
                         target_topk: int = 3, on_draft: Callable[[DraftTree], None] | None = None):
    """Greedy decoding with EAGLE-2 trees (or chains), the target recomputed each round: ``target(ids [R, T])
    -> (logits, features)``. The active set gets the target's top-k over the prompt and at every accepted
    position. Returns ``(ids [1, P + max_new_tokens], stats)``."""
    return decode(RecomputeTarget(target), drafter, prompt, max_new_tokens, Greedy(depth, top_k, num_nodes, chain),
                  "accepted", target_topk, prompt_topk=True, on_draft=on_draft)


def speculative_sample(target: TargetForward, drafter: Callable, prompt: torch.Tensor, max_new_tokens: int,
                       sampler: SpeculativeSampler, generator: torch.Generator | None = None, depth: int = 4,
                       top_k: int = 1, target_topk: int = 3, on_draft: Callable[[SampledDraft], None] | None = None):
    """Speculative sampling of ``prompt [1, P]`` (see :class:`Sampling`), the target recomputed each round; the
    output follows the target's sampling distribution. Returns ``(ids [1, P + max_new_tokens], stats)``."""
    return decode(RecomputeTarget(target), drafter, prompt, max_new_tokens, Sampling(sampler, generator, depth, top_k),
                  "accepted", target_topk, prompt_topk=True, on_draft=on_draft)
