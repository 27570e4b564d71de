"""End to end with a trained EAGLE drafter: the target alone vs EAGLE with each head, on the target's KV cache.

:func:`drafter_variants` builds the heads from one trained drafter (every variant shares its fc and
layer, and the target's embedding, norm and head): the full head, FR-Spec's static top-N
(:class:`~nanospec_fx.eval.bench.e2e.StaticHead`), and nanospec-compiled drafters (``context`` and
``hybrid``). :func:`run_eagle_e2e` decodes every request with the target alone and with every
variant at every depth (:func:`nanospec_fx.speculative.eagle_generate`, chain drafts), requests
in the outer loop so that load from other processes falls on all variants alike, and checks every
output against the target-alone output token for token.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch._dynamo
from torch import nn

from nanospec_fx.eagle import EagleDrafter
from nanospec_fx.eval.bench.e2e import StaticHead
from nanospec_fx.speculative import DecodeStats, HFTarget, eagle_generate

TARGET_ONLY = "target only"


def _sibling(drafter: EagleDrafter, lm_head: nn.Module) -> EagleDrafter:
    """A drafter sharing ``drafter``'s trained modules and the target's embedding and norm, with ``lm_head``."""
    d = EagleDrafter(drafter.config, drafter.embed, lm_head, drafter.norm)
    d.fc, d.layer = drafter.fc, drafter.layer
    return d.eval()


def drafter_variants(drafter: EagleDrafter, static_table: torch.Tensor | None, capacity: int = 3072,
                     frequencies=None, pinned: int = 1024, inductor: bool = False,
                     which: tuple[str, ...] = ("full", "static", "context", "hybrid")) -> dict[str, nn.Module]:
    """``{name: drafter}`` for the heads in ``which``. Each nanospec variant gets its own copy of the
    head weight: an active vocabulary hangs on its weight tensor, and the full-head drafter (and the
    target) share the original one."""
    import nanospec_fx

    weight = drafter.lm_head.weight
    pinned = min(pinned, capacity // 3)  # a small capacity (tests) keeps room for the context
    out: dict[str, nn.Module] = {}
    for kind in which:
        if kind == "full":
            out["full head"] = drafter
        elif kind == "static":
            if static_table is None:
                raise ValueError("the static variant needs a frequency table (static_table)")
            out[f"static-{static_table.numel()}"] = _sibling(drafter, StaticHead(weight, static_table))
        elif kind in ("context", "hybrid"):
            head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            head.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
            options = {"capacity": capacity, "inductor": inductor}
            if kind == "hybrid":
                if frequencies is None:
                    raise ValueError("the hybrid variant needs token frequencies")
                options.update(policy="hybrid", frequencies=frequencies, pinned_size=pinned)
            d = _sibling(drafter, head)
            head_name = next(n for n, p in d.named_parameters() if p is d.lm_head.weight)  # tied: maybe "embed.weight"
            nanospec_fx.attach(d, head=head_name, **{k: v for k, v in options.items() if k != "inductor"})
            name = f"nanospec {kind}@{capacity}" + (f" (pinned {pinned})" if kind == "hybrid" else "")
            out[name] = torch.compile(d, backend="nanospec", options=options)
        else:
            raise ValueError(f"unknown variant {kind!r}: use full, static, context, hybrid")
    return out


@dataclass
class Run:
    """One request decoded by one variant at one depth."""

    variant: str
    depth: int
    category: str
    stats: DecodeStats
    identical: bool


@dataclass
class Summary:
    variant: str
    depth: int
    category: str
    requests: int
    tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float
    tau: float
    draft_share: float
    verify_share: float
    active_size: float
    identical: bool
    draft_ms_per_round: float
    verify_ms_per_round: float
    tau_per_request: list[float] = field(default_factory=list)


def _reset(drafter: nn.Module) -> None:
    from nanospec_fx.eagle import _state

    state = _state(drafter)
    if state is not None:
        state.reset()


def run_eagle_e2e(target: nn.Module, drafters: dict[str, nn.Module], requests: list[tuple[str, list[int]]],
                  depths: list[int], max_new: int, observe: str = "verified", target_topk: int = 3,
                  warmup: int = 1, progress: Callable[[str], None] | None = None, prompt_topk: bool = False) -> list[Run]:
    """Decode each ``(category, prompt ids)`` with the target alone and each drafter at each depth
    (``prompt_topk``: seed the active set with the target's top-k at every prompt position too)."""
    runner = HFTarget(target)
    runs: list[Run] = []
    # One drafter cache length for every request and depth: a compiled drafter then keeps one graph per
    # call shape instead of recompiling per request (and hitting Dynamo's recompile limit: dense head).
    cache_len = -(-(max(len(ids) for _, ids in requests) + max_new + max(depths, default=0) + 2) // 64) * 64
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    plan = [(TARGET_ONLY, None, 0)] + [(n, d, k) for k in depths for n, d in drafters.items()]
    for _, ids in requests[:warmup]:  # compile the nanospec drafters, warm the caches
        for name, d, k in plan:
            if d is not None:
                _reset(d)
            eagle_generate(runner, d, torch.tensor([ids]), min(16, max_new), depth=k, observe=observe, target_topk=target_topk,
                           prompt_topk=prompt_topk, cache_len=cache_len)
    for category, ids in requests:
        prompt = torch.tensor([ids])
        reference = None
        for name, d, k in plan:
            if d is not None:
                _reset(d)
            out, stats = eagle_generate(runner, d, prompt, max_new, depth=k, observe=observe, target_topk=target_topk,
                                        prompt_topk=prompt_topk, cache_len=cache_len)
            if reference is None:
                reference = out
            runs.append(Run(name, k, category, stats, bool(torch.equal(out, reference))))
            if progress:
                progress(f"{category}: {name}" + (f" depth {k}" if k else ""))
    return runs


def summarise(runs: list[Run]) -> list[Summary]:
    """Per (variant, depth) and category, and pooled over categories ("all"); speedup vs the target alone."""
    out = []
    keys = list(dict.fromkeys((r.variant, r.depth) for r in runs))
    categories = list(dict.fromkeys(r.category for r in runs)) + ["all"]
    base = {c: _rate([r for r in runs if r.variant == TARGET_ONLY and c in (r.category, "all")]) for c in categories}
    for variant, depth in keys:
        for c in categories:
            rs = [r for r in runs if (r.variant, r.depth) == (variant, depth) and c in (r.category, "all")]
            if not rs:
                continue
            tokens = sum(r.stats.new_tokens for r in rs)
            secs = sum(r.stats.total_s for r in rs)
            rounds = sum(r.stats.rounds for r in rs)
            sizes = [r.stats.active_size for r in rs if r.stats.active_size is not None]
            out.append(Summary(
                variant, depth, c, len(rs), tokens, secs, tokens / secs, (tokens / secs) / base[c] if base[c] else float("nan"),
                sum(a + 1 for r in rs for a in r.stats.accepted) / max(rounds, 1),
                sum(r.stats.draft_s for r in rs) / secs, sum(r.stats.verify_s for r in rs) / secs,
                statistics.mean(sizes) if sizes else float("nan"), all(r.identical for r in rs),
                1e3 * sum(r.stats.draft_s for r in rs) / max(rounds, 1), 1e3 * sum(r.stats.verify_s for r in rs) / max(rounds, 1),
                [round(r.stats.mean_accept_length, 3) for r in rs]))
    return out


def _rate(runs: list[Run]) -> float:
    secs = sum(r.stats.total_s for r in runs)
    return sum(r.stats.new_tokens for r in runs) / secs if secs else 0.0
