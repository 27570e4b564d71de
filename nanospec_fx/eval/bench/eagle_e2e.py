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
from nanospec_fx.eval.bench.timing import PhaseTimer, Stopwatch
from nanospec_fx.eval.stats import median_interval, paired_ratios
from nanospec_fx.speculative import DecodeStats, HFTarget, drafter_state, eagle_generate
from nanospec_fx.vocab_config import DEFAULT_CAPACITY, DEFAULT_PINNED_SIZE

TARGET_ONLY = "target only"
EVERY_ROW = "full head, every fed row"
BODY = "body alone (no head)"
VARIANTS = ("full", "full-every-row", "static", "context", "hybrid", "body")


def _sibling(drafter: EagleDrafter, lm_head: nn.Module, kind: type[EagleDrafter] = EagleDrafter) -> EagleDrafter:
    """A drafter sharing ``drafter``'s trained modules and the target's embedding and norm, with ``lm_head``."""
    d = kind(drafter.config, drafter.embed, lm_head, drafter.norm)
    for name in drafter.trained_modules():
        setattr(d, name, getattr(drafter, name))
    return d.eval()


class EveryRowDrafter(EagleDrafter):
    """The baseline the earlier runs measured: the head scores every position fed to the drafter (the whole prompt
    at prefill, every committed token after), though only the last one's logits are used."""

    def forward(self, *args, logits_to_keep: int = 0):
        return super().forward(*args)


class NoHead(nn.Module):
    """The drafter body alone: zero logits (uniform; its drafts are token 0) from no weight at all. Its draft time
    per round is the limit a head restriction can approach (it still writes ``[.., V]`` logits, as every variant's
    draft loop reads a full row)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.new_zeros(*h.shape[:-1], self.vocab)


def drafter_variants(drafter: EagleDrafter, static_table: torch.Tensor | None, capacity: int = DEFAULT_CAPACITY,
                     frequencies=None, pinned: int = DEFAULT_PINNED_SIZE, inductor: bool = False,
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
        elif kind == "full-every-row":
            out[EVERY_ROW] = _sibling(drafter, drafter.lm_head, EveryRowDrafter)
        elif kind == "body":
            out[BODY] = _sibling(drafter, NoHead(weight.shape[0]))
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
            raise ValueError(f"unknown variant {kind!r}: use one of {', '.join(VARIANTS)}")
    return out


@dataclass
class Run:
    """One request decoded by one variant at one depth, in one repeat (``order``: its place in that request's
    rotated plan; ``head``/``setting``: the variant's head and how the target fed its active set; seconds:
    the whole request and its rounds' draft and verify phases, timed by the benchmark around the loop)."""

    variant: str
    depth: int
    category: str
    stats: DecodeStats
    identical: bool
    request: int = 0
    repeat: int = 0
    order: int = 0
    head: str = ""
    setting: str = ""
    total_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    head_rows: int = 0  # positions the drafter's head scored (all calls of the request)
    body_rows: int = 0  # positions the drafter's body ran


@dataclass
class Summary:
    variant: str
    depth: int
    category: str
    requests: int
    tokens: int
    seconds: float
    tokens_per_s: float
    speedup: float  # median over requests of (this variant's tokens/s) / (the target alone's), same request
    tau: float
    draft_share: float
    verify_share: float
    active_size: float
    identical: bool
    draft_ms_per_round: float
    verify_ms_per_round: float
    tau_per_request: list[float] = field(default_factory=list)
    speedup_low: float = float("nan")  # the 95% bootstrap interval of that median
    speedup_high: float = float("nan")
    repeats: int = 1
    mismatches: int = 0  # runs whose output differed from the target alone's
    head_rows_per_round: float = float("nan")  # positions the drafter's head scored, per round (prefill included)
    body_rows_per_round: float = float("nan")  # positions its body ran, per round (prefill included)


def reset_drafter(drafter: nn.Module) -> None:
    """Empty a nanospec drafter's active vocabulary (a new request starts from its seed); others are left alone."""
    state = drafter_state(drafter)
    if state is not None:
        state.reset()


def setting_name(observe: str, prompt_topk: bool) -> str:
    return f"observe {observe}" + (", prompt top-k" if prompt_topk else "")


def run_eagle_e2e(target: nn.Module, drafters: dict[str, nn.Module], requests: list[tuple[str, list[int]]],
                  depths: list[int], max_new: int, observe: str = "verified", target_topk: int = 3,
                  warmup: int = 1, progress: Callable[[str], None] | None = None, prompt_topk: bool = False,
                  repeats: int = 1, settings: list[tuple[str, bool]] | None = None,
                  shard: tuple[int, int] = (0, 1)) -> list[Run]:
    """Decode each ``(category, prompt ids)`` with the target alone and each drafter at each depth, ``repeats``
    times. ``settings`` (default ``[(observe, prompt_topk)]``): the ways the target feeds a nanospec drafter's
    active set (``prompt_topk``: its top-k at every prompt position too); with more than one, each nanospec
    drafter runs under each, as its own variant, so settings are compared on the same requests in one run.
    The order of the variants is rotated per request and repeat, so neither load drift nor a warm cache
    favours one of them. Every output is checked against the target alone's, token for token.

    ``shard=(k, n)`` decodes only the requests whose index in ``requests`` is ``k`` mod ``n``; everything else
    (the rotation, the warm-up, the cache length) is keyed on the whole list, so the ``n`` shards' runs together
    are the unsharded run's, request for request (:func:`in_shard`)."""
    runner = HFTarget(target)
    runs: list[Run] = []
    settings = list(settings or [(observe, prompt_topk)])
    # One drafter cache length for every request and depth: a compiled drafter then keeps one graph per
    # call shape instead of recompiling per request (and hitting Dynamo's recompile limit: dense head).
    cache_len = -(-(max(len(ids) for _, ids in requests) + max_new + max(depths, default=0) + 2) // 64) * 64
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    plan = [(TARGET_ONLY, TARGET_ONLY, None, 0, settings[0])]
    for k in depths:
        for name, d in drafters.items():
            stateful = isinstance(d, torch._dynamo.eval_frame.OptimizedModule)  # the nanospec variants
            for s in settings if stateful else settings[:1]:
                label = name + (f" [{setting_name(*s)}]" if stateful and len(settings) > 1 else "")
                plan.append((label, name, d, k, s))

    rows = {id(d): RowCount(d) for d in drafters.values()}

    def decode(d, ids, k, s, n):
        """``(ids, stats, (total, draft, verify) seconds, (head, body) rows)``: the benchmark's clock and row
        counts, outside the loop's code."""
        if d is not None:
            reset_drafter(d)
            rows[id(d)].head = rows[id(d)].body = 0
        phases, watch = PhaseTimer(), Stopwatch()
        with watch:
            out, stats = eagle_generate(runner, d, torch.tensor([ids]), n, depth=k, observe=s[0],
                                        target_topk=target_topk, prompt_topk=s[1], cache_len=cache_len, timer=phases)
        counted = (rows[id(d)].head, rows[id(d)].body) if d is not None else (0, 0)
        return out, stats, (watch.seconds, phases.seconds("draft"), phases.seconds("verify")), counted

    for _, ids in requests[:warmup]:  # compile the nanospec drafters, warm the caches
        for _, _, d, k, s in plan:
            decode(d, ids, k, s, min(16, max_new))
    reference: dict[int, torch.Tensor] = {}
    for r in range(repeats):
        for i, (category, ids) in enumerate(requests):
            if not in_shard(i, shard):
                continue
            shift = (r * len(requests) + i) % len(plan)
            done = {}
            for pos, (label, head, d, k, s) in enumerate(plan[shift:] + plan[:shift]):
                done[(label, k)] = (*decode(d, ids, k, s, max_new), pos)
                if progress:
                    progress(f"{category}: {label}" + (f" depth {k}" if k else "")
                             + (f" (repeat {r + 1})" if repeats > 1 else ""))
            reference.setdefault(i, done[(TARGET_ONLY, 0)][0])  # the target's greedy output, first repeat
            for label, head, d, k, s in plan:
                out, stats, seconds, counted, pos = done[(label, k)]
                runs.append(Run(label, k, category, stats, bool(torch.equal(out, reference[i])), i, r, pos, head,
                                setting_name(*s), *seconds, *counted))
    for count in rows.values():
        count.remove()
    return runs


class RowCount:
    """Counts the positions a drafter's body ran (``input_ids``) and its head scored (the logits' rows), by a
    forward hook on the module called (a ``torch.compile`` wrapper's hook sees its compiled call too)."""

    def __init__(self, drafter: nn.Module):
        self.head = self.body = 0
        self._handle = drafter.register_forward_hook(self)

    def __call__(self, module, args, output) -> None:
        self.body += args[0].numel()
        self.head += output[0].shape[:-1].numel()

    def remove(self) -> None:
        self._handle.remove()


def in_shard(index: int, shard: tuple[int, int]) -> bool:
    """Whether the request at ``index`` of the whole list is in shard ``(k, n)``: every n-th request from the k-th,
    so each shard mixes the categories (the list is grouped by category)."""
    k, n = shard
    return index % n == k


def _per_request(runs: list[Run], metric: str) -> dict[int, float]:
    """``metric`` per request, summed over its repeats: tokens_per_s or draft_ms_per_round."""
    out = {}
    for i in dict.fromkeys(r.request for r in runs):
        rs = [r for r in runs if r.request == i]
        if metric == "tokens_per_s":
            secs = sum(r.total_s for r in rs)
            out[i] = sum(r.stats.new_tokens for r in rs) / secs if secs else float("nan")
        else:
            rounds = sum(r.stats.rounds for r in rs)
            out[i] = 1e3 * sum(r.draft_s for r in rs) / rounds if rounds else float("nan")
    return out


def paired(runs: list[Run], a: tuple[str, int], b: tuple[str, int], metric: str = "tokens_per_s",
           category: str = "all") -> dict:
    """``metric`` of variant ``a`` over variant ``b`` ((variant, depth) each), request by request in this run:
    the median ratio and its 95% bootstrap interval over requests."""
    def pick(key):
        return [r for r in runs if (r.variant, r.depth) == key and category in (r.category, "all")]

    ratios = paired_ratios(_per_request(pick(a), metric), _per_request(pick(b), metric))
    median, low, high = median_interval(ratios)
    return {"a": a[0], "a_depth": a[1], "b": b[0], "b_depth": b[1], "metric": metric, "category": category,
            "median": median, "low": low, "high": high, "requests": len(ratios)}


def comparisons(runs: list[Run]) -> list[dict]:
    """The paired comparisons the docs make, each inside this one run: every variant against the target alone
    and the full head (same depth); nanospec against FR-Spec's static head (tokens/s and draft ms per round);
    a non-default setting against the same head's default; each depth against the first; every variant's draft
    ms per round against the body alone's (same depth), where the run has it."""
    keys = list(dict.fromkeys((r.variant, r.depth) for r in runs if r.depth))
    info = {(r.variant, r.depth): (r.head, r.setting) for r in runs}
    first_setting = next((r.setting for r in runs), "")
    out = []
    for v, d in keys:
        head, setting = info[(v, d)]
        out.append(paired(runs, (v, d), (TARGET_ONLY, 0)))
        if head != "full head" and ("full head", d) in info:
            out.append(paired(runs, (v, d), ("full head", d)))
        if head.startswith("nanospec"):
            for s in (k for k in keys if k[1] == d and k[0].startswith("static-")):
                out += [paired(runs, (v, d), s), paired(runs, (v, d), s, "draft_ms_per_round")]
            if (EVERY_ROW, d) in info:  # the ratio the earlier runs' baseline gave, in this run
                out.append(paired(runs, (v, d), (EVERY_ROW, d)))
        if setting != first_setting:
            base = next(k for k in keys if k[1] == d and info[k] == (head, first_setting))
            out.append(paired(runs, (v, d), base))
        if d != keys[0][1] and (v, keys[0][1]) in info:
            out.append(paired(runs, (v, d), (v, keys[0][1])))
        if head != BODY and (BODY, d) in info:  # the draft time as a multiple of the body alone's
            out.append(paired(runs, (v, d), (BODY, d), "draft_ms_per_round"))
    return out


def summarise(runs: list[Run]) -> list[Summary]:
    """Per (variant, depth) and category, and pooled over categories ("all"), over every repeat; the speedup
    over the target alone is the median of the per-request ratios, with its 95% interval."""
    out = []
    keys = list(dict.fromkeys((r.variant, r.depth) for r in runs))
    categories = list(dict.fromkeys(r.category for r in runs)) + ["all"]
    for variant, depth in keys:
        for c in categories:
            rs = [r for r in runs if (r.variant, r.depth) == (variant, depth) and c in (r.category, "all")]
            if not rs:
                continue
            tokens = sum(r.stats.new_tokens for r in rs)
            secs = sum(r.total_s for r in rs)
            rounds = sum(r.stats.rounds for r in rs)
            sizes = [r.stats.active_size for r in rs if r.stats.active_size is not None]
            speed = paired(runs, (variant, depth), (TARGET_ONLY, 0), category=c)
            out.append(Summary(
                variant, depth, c, len({r.request for r in rs}), tokens, secs, tokens / secs, speed["median"],
                sum(a + 1 for r in rs for a in r.stats.accepted) / max(rounds, 1),
                sum(r.draft_s for r in rs) / secs, sum(r.verify_s for r in rs) / secs,
                statistics.mean(sizes) if sizes else float("nan"), all(r.identical for r in rs),
                1e3 * sum(r.draft_s for r in rs) / max(rounds, 1), 1e3 * sum(r.verify_s for r in rs) / max(rounds, 1),
                [round(r.stats.mean_accept_length, 3) for r in rs], speed["low"], speed["high"],
                len({r.repeat for r in rs}), sum(not r.identical for r in rs),
                sum(r.head_rows for r in rs) / max(rounds, 1), sum(r.body_rows for r in rs) / max(rounds, 1)))
    return out


def request_rows(runs: list[Run]) -> list[dict]:
    """One row per decoded request (variant, depth, repeat): what the JSON keeps besides the summaries, and all
    that :func:`runs_from_rows` needs to rebuild the runs (``request``: the index in the whole request list)."""
    return [{"variant": r.variant, "depth": r.depth, "category": r.category, "request": r.request, "repeat": r.repeat,
             "order": r.order, "head": r.head, "setting": r.setting, "identical": r.identical,
             "new_tokens": r.stats.new_tokens, "rounds": r.stats.rounds, "accepted": list(r.stats.accepted),
             "drafted": r.stats.drafted, "total_s": round(r.total_s, 6), "draft_s": round(r.draft_s, 6),
             "verify_s": round(r.verify_s, 6), "active_size": r.stats.active_size, "head_rows": r.head_rows,
             "body_rows": r.body_rows} for r in runs]


def runs_from_rows(rows: list[dict]) -> list[Run]:
    """The runs behind :func:`request_rows` (from one JSON or several shards' together), in the order an unsharded
    run makes them: repeat, then request, then the variants' plan order (kept from the rows). The summaries and
    comparisons of merged shards are then computed by the same code, on the same sequence, as a whole run's."""
    runs = [Run(r["variant"], r["depth"], r["category"],
                DecodeStats(rounds=r["rounds"], accepted=list(r["accepted"]), drafted=r["drafted"],
                            new_tokens=r["new_tokens"], active_size=r["active_size"]),
                r["identical"], r["request"], r["repeat"], r["order"], r["head"], r["setting"], r["total_s"],
                r["draft_s"], r["verify_s"], r.get("head_rows", 0), r.get("body_rows", 0)) for r in rows]
    return sorted(runs, key=lambda r: (r.repeat, r.request))  # stable: each block keeps its plan order
