"""End to end with a trained EAGLE drafter: the target alone vs EAGLE with each head, on the target's KV cache.

:func:`drafter_variants` builds the heads from one trained drafter (every variant shares its fc and
layer, and the target's embedding, norm and head): the full head, FR-Spec's static top-N
(:class:`~nanospec_fx.eval.bench.e2e.StaticHead`), and nanospec-compiled drafters (``context`` and
``hybrid``). :func:`run_eagle_e2e` decodes every request with the target alone and with every
variant at every depth (:func:`nanospec_fx.eagle.speculative.eagle_generate`, chain drafts), requests
in the outer loop so that load from other processes falls on all variants alike, and checks every
output against the target-alone output token for token.

Like for like (``compile``): every variant compiled the same way, the dense ones through Dynamo as the nanospec
ones are (``"eager"``: no inductor anywhere; ``"inductor"``: inductor everywhere), so Dynamo's guards and
compiled-region entry are paid by all; the drafters pick their tokens themselves (``draft_topk``: the dense heads
over ``[V]``, the static one over its table, nanospec over its compact logits); the target's top-k is the
target's work (verify time). :class:`Replay` is the body alone given the accepted lengths of the variant it is
compared with, so the two run the same rows. :func:`call_split` times the parts of one drafter call apart.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

from nanospec_fx.eagle import EagleDrafter
from nanospec_fx.eval.bench.e2e import StaticHead
from nanospec_fx.eval.bench.timing import PhaseTimer, Stopwatch
from nanospec_fx.eval.stats import median_interval, paired_ratios
from nanospec_fx.vocab.module_heads import unwrap
from nanospec_fx.eagle.speculative import DecodeStats, HFTarget, drafter_state, eagle_generate
from nanospec_fx.vocab.config import DEFAULT_CAPACITY, DEFAULT_PINNED_SIZE

TARGET_ONLY = "target only"
EVERY_ROW = "full head, every fed row"
BODY = "body alone (no head)"
REPLAYED = "body alone, replayed"  # + " (<variant>)": the accepted lengths it replays
VARIANTS = ("full", "full-every-row", "static", "context", "hybrid", "body", "body-replayed")
COMPILE = ("eager", "inductor")  # like-for-like: every variant through torch.compile, without or with inductor


def _sibling(drafter: EagleDrafter, lm_head: nn.Module, kind: type[EagleDrafter] = EagleDrafter) -> EagleDrafter:
    """A drafter sharing ``drafter``'s trained modules and the target's embedding and norm, with ``lm_head``."""
    d = kind(drafter.config, drafter.embed, lm_head, drafter.norm)
    for name in drafter.trained_modules():
        setattr(d, name, getattr(drafter, name))
    return d.eval()


class EveryRowDrafter(EagleDrafter):
    """The baseline the earlier runs measured: the head scores every position fed to the drafter (the whole prompt
    at prefill, every committed token after), though only the last one's logits are used."""

    def forward(self, *args, logits_to_keep: int = 0, draft_topk: int = 0):
        return super().forward(*args, draft_topk=draft_topk)


class NoHead(nn.Module):
    """The drafter body alone: zero logits (uniform; its drafts are token 0) from no weight at all. Asked for
    ``[V]`` logits (the earlier runs' loop) it writes a ``[.., V]`` row of zeros; asked to pick (``draft_topk``,
    :class:`BodyDrafter`) it writes nothing ``[V]``-wide."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.new_zeros(*h.shape[:-1], self.vocab)


class BodyDrafter(EagleDrafter):
    """The drafter with no head: fc and the decoder layer, then zero log-probs for token 0 (``draft_topk``), no
    norm, no weight, no ``[V]`` row. Its draft time per round is the limit a head restriction can approach."""

    def forward(self, input_ids, features, positions, slots, mask, cache_k, cache_v, logits_to_keep: int = 0,
                draft_topk: int = 0):
        if not draft_topk:
            return super().forward(input_ids, features, positions, slots, mask, cache_k, cache_v, logits_to_keep)
        h = self.body(input_ids, features, positions, slots, mask, cache_k, cache_v)
        kept = h[:, -logits_to_keep:] if logits_to_keep else h
        scores = kept.new_zeros(*kept.shape[:-1], draft_topk)
        return (scores, scores.long()), h


class Replay(nn.Module):
    """The body alone (a :class:`BodyDrafter`, compiled as the others), drafting what another variant had
    accepted: in each round its first ``a`` drafts are the target's own tokens and the rest are wrong, ``a`` being
    the compared variant's accepted length in that round (:meth:`replay`). The target then accepts exactly those
    lengths, so the body runs the rows the compared variant ran, round for round. Its picks are set on the host
    (the position of the last fed row, one read per call), the one cost it has that a real head would not."""

    def __init__(self, body: nn.Module, vocab: int):
        super().__init__()
        self.body, self.vocab = body, vocab
        self.reference: list[int] = []
        self.accepted_at: dict[int, int] = {}
        self.round_start = 0

    def replay(self, reference: list[int], prompt_length: int, accepted: list[int]) -> None:
        """Replay ``accepted`` (drafts accepted per round) on the request whose target output is ``reference``."""
        self.reference, self.accepted_at, n = reference, {}, prompt_length
        for a in accepted:
            self.accepted_at[n] = a
            n += a + 1

    def forward(self, input_ids, features, positions, slots, mask, cache_k, cache_v, logits_to_keep: int = 0,
                draft_topk: int = 0):
        (scores, tokens), h = self.body(input_ids, features, positions, slots, mask, cache_k, cache_v,
                                        logits_to_keep=logits_to_keep, draft_topk=max(draft_topk, 1))
        last = int(positions[0, -1])
        if logits_to_keep:  # a feed: its last position roots the round that starts after it
            self.round_start = last + 1
        n = self.round_start
        i = last + 1 - n  # which draft of the round this call picks
        t = n + 1 + i
        token = self.reference[t] if t < len(self.reference) else 0
        if i >= self.accepted_at.get(n, 0):
            token = (token + 1) % self.vocab  # not the target's: rejected
        return (scores, torch.full_like(tokens, token)), h

    def new_cache(self, max_len: int, batch: int = 1):
        return unwrap(self.body).new_cache(max_len, batch)

    def target_features(self, features: torch.Tensor) -> torch.Tensor:
        return unwrap(self.body).target_features(features)


def is_nanospec(name: str) -> bool:
    """Whether a variant (by its name in :func:`drafter_variants`) is a nanospec-compiled drafter."""
    return name.startswith("nanospec")


class StaticDrafter(EagleDrafter):
    """FR-Spec's static head picking its tokens itself (``draft_topk``): log-softmax and top-k over the table's
    logits, ids mapped back through the table; no ``[V]`` row, as nanospec's compact selection."""

    def forward(self, input_ids, features, positions, slots, mask, cache_k, cache_v, logits_to_keep: int = 0,
                draft_topk: int = 0):
        if not draft_topk:
            return super().forward(input_ids, features, positions, slots, mask, cache_k, cache_v, logits_to_keep)
        h = self.body(input_ids, features, positions, slots, mask, cache_k, cache_v)
        x = self.head_input(h[:, -logits_to_keep:] if logits_to_keep else h)
        scores, rows = torch.log_softmax(F.linear(x, self.lm_head.weight_static).float(), -1).topk(draft_topk, -1)
        return (scores, self.lm_head.table[rows]), h


def drafter_variants(drafter: EagleDrafter, static_table: torch.Tensor | None, capacity: int = DEFAULT_CAPACITY,
                     frequencies=None, pinned: int = DEFAULT_PINNED_SIZE, inductor: bool = False,
                     which: tuple[str, ...] = ("full", "static", "context", "hybrid"),
                     compile: str | None = None) -> dict[str, nn.Module]:
    """``{name: drafter}`` for the heads in ``which``. Each nanospec variant gets its own copy of the
    head weight: an active vocabulary hangs on its weight tensor, and the full-head drafter (and the
    target) share the original one.

    ``compile`` (like for like): ``"eager"`` runs every variant through ``torch.compile`` without inductor (the
    dense ones with Dynamo's ``eager`` backend, nanospec with ``inductor: False``), ``"inductor"`` every one with
    inductor; None (the earlier runs): only the nanospec variants are compiled (with ``inductor``). The
    ``body-replayed`` variant replays the first nanospec variant of ``which`` (:class:`Replay`)."""
    import nanospec_fx

    if compile is not None and compile not in COMPILE:
        raise ValueError(f"compile must be one of {COMPILE} or None, got {compile!r}")
    if compile is not None:
        inductor = compile == "inductor"

    def dense(module: nn.Module) -> nn.Module:
        return module if compile is None else torch.compile(module, backend=compile)

    weight = drafter.lm_head.weight
    pinned = min(pinned, capacity // 3)  # a small capacity (tests) keeps room for the context
    out: dict[str, nn.Module] = {}
    for kind in which:
        if kind == "full":
            out["full head"] = dense(drafter)
        elif kind == "full-every-row":
            out[EVERY_ROW] = dense(_sibling(drafter, drafter.lm_head, EveryRowDrafter))
        elif kind == "body":
            out[BODY] = dense(_sibling(drafter, NoHead(weight.shape[0]), BodyDrafter))
        elif kind == "body-replayed":
            continue  # after the variant it replays
        elif kind == "static":
            if static_table is None:
                raise ValueError("the static variant needs a frequency table (static_table)")
            out[f"static-{static_table.numel()}"] = dense(_sibling(drafter, StaticHead(weight, static_table),
                                                                   StaticDrafter))
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
    if "body-replayed" in which:
        compared = next((n for n in out if is_nanospec(n)), None)
        if compared is None:
            raise ValueError("the body-replayed variant replays a nanospec variant: add context or hybrid")
        body = dense(_sibling(drafter, NoHead(weight.shape[0]), BodyDrafter))
        out[f"{REPLAYED} ({compared})"] = Replay(body, weight.shape[0])
    return out


def replayed_variant(name: str) -> str | None:
    """The variant a replayed body's name says it replays (None: not a replayed body)."""
    return name[len(REPLAYED) + 2:-1] if name.startswith(REPLAYED + " (") else None


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
    observe_s: float = 0.0  # part of draft_s: the target's top-k joining the active set (the loop's observe phase)
    calls_s: float = 0.0  # part of draft_s: inside the drafter's calls (the prefill's feed excluded)
    calls: int = 0  # drafter calls in the rounds (the prefill's feed excluded)


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
    observe_ms_per_round: float = float("nan")  # the draft ms split: the target's top-k joining the set
    calls_ms_per_round: float = float("nan")  # inside the drafter's calls (body, head, selection, Dynamo entry)
    loop_ms_per_round: float = float("nan")  # the rest: the loop around the calls (Python, inputs, selection)
    calls_per_round: float = float("nan")


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
    # Room for the replay's look-ahead decode too (max_new + depth + 1 tokens).
    deepest = max(depths, default=0)
    cache_len = -(-(max(len(ids) for _, ids in requests) + max_new + 2 * deepest + 3) // 64) * 64
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    plan = [(TARGET_ONLY, TARGET_ONLY, None, 0, settings[0])]
    for k in depths:
        for name, d in drafters.items():
            stateful = is_nanospec(name)
            for s in settings if stateful else settings[:1]:
                label = name + (f" [{setting_name(*s)}]" if stateful and len(settings) > 1 else "")
                plan.append((label, name, d, k, s))

    rows = {id(d): RowCount(d) for d in drafters.values()}
    replays: dict[tuple[int, int], tuple[list[int], list[int]]] = {}  # (request, depth) -> (reference, accepted)

    def decode(d, ids, k, s, n):
        """``(ids, stats, (total, draft, verify) seconds, (head, body) rows, observe and calls seconds, calls)``:
        the benchmark's clock and row counts, outside the loop's code."""
        if d is not None:
            reset_drafter(d)
            rows[id(d)].reset()
        phases, watch = PhaseTimer(), Stopwatch()
        with watch:
            out, stats = eagle_generate(runner, d, torch.tensor([ids]), n, depth=k, observe=s[0],
                                        target_topk=target_topk, prompt_topk=s[1], cache_len=cache_len, timer=phases)
        count = rows[id(d)] if d is not None else RowCount(None)
        observed = phases.seconds("observe")
        seconds = (watch.seconds, phases.seconds("draft") + observed, phases.seconds("verify"))
        return out, stats, seconds, (count.head, count.body), (observed, count.round_seconds, count.round_calls)

    def replayed(i, ids, k):
        """The compared variant's accepted lengths on request ``i`` at depth ``k`` and the target's output a few
        tokens past ``max_new`` (the last round's drafts may reach there), from one untimed decode."""
        if (i, k) not in replays:
            name = next(n for n in drafters if n.startswith(REPLAYED))
            compared = drafters[replayed_variant(name)]
            out, stats, *_ = decode(compared, ids, k, settings[0], max_new + k + 1)
            accepted, made = [], 1
            for a in stats.accepted:  # the rounds of a max_new decode: the same as the longer one's first ones
                if made >= max_new:
                    break
                accepted.append(a)
                made += a + 1
            replays[(i, k)] = (out[0].tolist(), accepted)
        return replays[(i, k)]

    def run_one(i, ids, d, k, s, n):
        if isinstance(d, Replay):
            reference, accepted = replayed(i, ids, k)
            d.replay(reference, len(ids), accepted)
        return decode(d, ids, k, s, n)

    for _, ids in requests[:warmup]:  # compile the drafters, warm the caches
        for _, _, d, k, s in plan:
            run_one(-1, ids, d, k, s, min(16, max_new))
        replays.clear()
    reference: dict[int, torch.Tensor] = {}
    for r in range(repeats):
        for i, (category, ids) in enumerate(requests):
            if not in_shard(i, shard):
                continue
            shift = (r * len(requests) + i) % len(plan)
            done = {}
            for label, head, d, k, s in plan:  # the replays' untimed decodes first, outside the timed order
                if isinstance(d, Replay):
                    replayed(i, ids, k)
            for pos, (label, head, d, k, s) in enumerate(plan[shift:] + plan[:shift]):
                done[(label, k)] = (*run_one(i, ids, d, k, s, max_new), pos)
                if progress:
                    progress(f"{category}: {label}" + (f" depth {k}" if k else "")
                             + (f" (repeat {r + 1})" if repeats > 1 else ""))
            reference.setdefault(i, done[(TARGET_ONLY, 0)][0])  # the target's greedy output, first repeat
            for label, head, d, k, s in plan:
                out, stats, seconds, counted, split, pos = done[(label, k)]
                runs.append(Run(label, k, category, stats, bool(torch.equal(out, reference[i])), i, r, pos, head,
                                setting_name(*s), *seconds, *counted, *split))
    for count in rows.values():
        count.remove()
    return runs


class RowCount:
    """Counts the positions a drafter's body ran (``input_ids``) and its head scored (the logits' or the choice's
    rows), and times its calls, by forward hooks on the module called (a ``torch.compile`` wrapper's hooks see its
    compiled call too). The first call of a request is the prefill's feed: kept out of the rounds' figures."""

    def __init__(self, drafter: nn.Module | None):
        self.reset()
        self._handles = [] if drafter is None else [drafter.register_forward_pre_hook(self.start),
                                                    drafter.register_forward_hook(self)]

    def reset(self) -> None:
        self.head = self.body = 0
        self.durations: list[float] = []
        self._start = 0.0

    def start(self, module, args) -> None:
        self._start = time.perf_counter()

    def __call__(self, module, args, output) -> None:
        self.durations.append(time.perf_counter() - self._start)
        self.body += args[0].numel()
        scored = output[0][0] if isinstance(output[0], tuple) else output[0]
        self.head += scored.shape[:-1].numel()

    @property
    def round_seconds(self) -> float:
        return sum(self.durations[1:])

    @property
    def round_calls(self) -> int:
        return max(len(self.durations) - 1, 0)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


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
        body = next((k for k in keys if k[1] == d and replayed_variant(info[k][0]) == head), None)
        if body is not None and body != (v, d):  # ... and of the body alone on the same rows (replayed)
            out.append(paired(runs, (v, d), body, "draft_ms_per_round"))
    return out


def replay_checks(runs: list[Run]) -> list[dict]:
    """Per replayed body and depth: on how many (request, repeat) it ran the compared variant's rounds exactly
    (the same accepted lengths, so the same rows through the body) out of how many."""
    out = []
    by = {(r.variant, r.depth, r.request, r.repeat): r for r in runs}
    for key in dict.fromkeys((r.variant, r.depth, r.head) for r in runs):
        compared = replayed_variant(key[2])
        if compared is None:
            continue
        pairs = [(r, by.get((compared, r.depth, r.request, r.repeat))) for r in runs if (r.variant, r.depth) == key[:2]]
        same = sum(c is not None and r.stats.accepted == c.stats.accepted and r.body_rows == c.body_rows
                   for r, c in pairs)
        out.append({"variant": key[0], "depth": key[1], "replays": compared, "runs": len(pairs), "same_rows": same})
    return out


def call_split(drafters: dict[str, nn.Module], cache_len: int, start: int, repeats: int = 30) -> list[dict]:
    """The parts of one draft call (one row, the loop's ``draft_topk=1``), timed apart on this machine, in ms:
    ``call`` (the variant's call as the loop makes it), ``body`` (fc + decoder layer, eager), ``head`` (the
    variant's head alone on one row, eager: the dense or static GEMM, nanospec's compact head over its set as the
    run left it), ``topk`` (log-softmax and top-1 over that head's output, ids mapped back), ``observe`` (nanospec:
    the call's token joining the set) and ``overhead``: what the call costs beyond them (Dynamo's guards and
    compiled-region entry, net of what the compiler saves); calls interleaved, medians. An estimate from parts,
    beside the run's own per-round figures (draft, observe, calls, loop), which are measured."""
    from nanospec_fx.eval.bench.timing import interleaved_medians
    from nanospec_fx.kernels import ops

    out = []
    for name, d in drafters.items():
        module = unwrap(d.body if isinstance(d, Replay) else d)
        config = module.config
        gen = torch.Generator().manual_seed(0)
        cache = module.new_cache(cache_len)
        slot = torch.tensor([start])
        args = (torch.tensor([[1]]), torch.randn(1, 1, config.hidden_size, generator=gen), slot.view(1, 1), slot,
                (torch.arange(cache_len) <= slot)[None], cache.k, cache.v)
        x = module.head_input(module.body(*args)).detach()
        state = drafter_state(d) if is_nanospec(name) else None
        head, topk = _head_parts(module, x, state, ops)
        fns = {"call": lambda d=d: d(*args, draft_topk=1), "body": lambda m=module: m.body(*args)}
        if head is not None:
            fns.update(head=head, topk=topk)
        if state is not None:
            fns["observe"] = lambda st=state: st.observe(args[0], validate=False)
        with torch.inference_mode():
            ms = {k: 1e3 * v for k, v in interleaved_medians(fns, repeats).items()}
        parts = {"head": 0.0, "topk": 0.0, "observe": 0.0, **ms}
        parts["overhead"] = ms["call"] - sum(parts[k] for k in ("body", "head", "topk", "observe"))
        out.append({"variant": name, "active": len(state) if state is not None else None,
                    **{k: round(v, 4) for k, v in parts.items()}})
    return out


def round_split(summaries: list[Summary], parts: list[dict]) -> list[dict]:
    """Each (variant, depth)'s draft ms per round split into body, head, top-k, observe and overhead: the run's
    measured figures (the target's top-k joining the set; the loop around the calls) and its drafter calls' time
    apportioned by one call's parts (:func:`call_split`), scaled so that they add up to the calls' measured time."""
    by = {c["variant"]: c for c in parts}
    out = []
    for s in summaries:
        c = by.get(s.variant)
        if s.category != "all" or not s.depth or c is None or s.calls_per_round != s.calls_per_round:
            continue
        named = {k: max(c[k], 0.0) for k in ("body", "head", "topk", "observe", "overhead")}
        scale = s.calls_ms_per_round / max(sum(named.values()), 1e-9)
        row = {"variant": s.variant, "depth": s.depth, "draft": s.draft_ms_per_round}
        row.update({k: v * scale for k, v in named.items()})
        row["observe"] += s.observe_ms_per_round
        row["loop"] = s.loop_ms_per_round
        out.append({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    return out


def _head_parts(module: nn.Module, x: torch.Tensor, state, ops) -> tuple:
    """``(head(), topk())`` of one drafter's head on ``x`` (None, None: the body alone has no head)."""
    head = module.lm_head
    if isinstance(head, NoHead):
        return None, None
    if state is not None:
        compact = ops.compact_logits(x=x, cache_w=state.cache_w, cache_b=None, cursor=state.cursor)
        return (lambda: ops.compact_logits(x=x, cache_w=state.cache_w, cache_b=None, cursor=state.cursor),
                lambda: ops.compact_topk(compact=torch.log_softmax(compact.float(), -1), ids=state.ids,
                                         cursor=state.cursor, k=1, largest=True))
    if isinstance(head, StaticHead):
        z = F.linear(x, head.weight_static)
        return (lambda: F.linear(x, head.weight_static),
                lambda: head.table[torch.log_softmax(z.float(), -1).topk(1, -1).indices])
    z = head(x)
    return lambda: head(x), lambda: torch.log_softmax(z.float(), -1).topk(1, -1)


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
                sum(r.head_rows for r in rs) / max(rounds, 1), sum(r.body_rows for r in rs) / max(rounds, 1),
                *_draft_split(rs, rounds)))
    return out


def _draft_split(rs: list[Run], rounds: int) -> tuple[float, float, float, float]:
    """ms per round: the target's top-k joining the set, the drafter's calls, the loop around them; calls per
    round (NaN where the runs did not time them: older JSONs)."""
    if not rounds or not any(r.calls for r in rs):
        return (float("nan"),) * 4
    draft, observe, calls = (1e3 * sum(getattr(r, f) for r in rs) / rounds for f in ("draft_s", "observe_s", "calls_s"))
    return observe, calls, draft - observe - calls, sum(r.calls for r in rs) / rounds


def request_rows(runs: list[Run]) -> list[dict]:
    """One row per decoded request (variant, depth, repeat): what the JSON keeps besides the summaries, and all
    that :func:`runs_from_rows` needs to rebuild the runs (``request``: the index in the whole request list)."""
    return [{"variant": r.variant, "depth": r.depth, "category": r.category, "request": r.request, "repeat": r.repeat,
             "order": r.order, "head": r.head, "setting": r.setting, "identical": r.identical,
             "new_tokens": r.stats.new_tokens, "rounds": r.stats.rounds, "accepted": list(r.stats.accepted),
             "drafted": r.stats.drafted, "total_s": round(r.total_s, 6), "draft_s": round(r.draft_s, 6),
             "verify_s": round(r.verify_s, 6), "active_size": r.stats.active_size, "head_rows": r.head_rows,
             "body_rows": r.body_rows, "observe_s": round(r.observe_s, 6), "calls_s": round(r.calls_s, 6),
             "calls": r.calls} for r in runs]


def runs_from_rows(rows: list[dict]) -> list[Run]:
    """The runs behind :func:`request_rows` (from one JSON or several shards' together), in the order an unsharded
    run makes them: repeat, then request, then the variants' plan order (kept from the rows). The summaries and
    comparisons of merged shards are then computed by the same code, on the same sequence, as a whole run's."""
    runs = [Run(r["variant"], r["depth"], r["category"],
                DecodeStats(rounds=r["rounds"], accepted=list(r["accepted"]), drafted=r["drafted"],
                            new_tokens=r["new_tokens"], active_size=r["active_size"]),
                r["identical"], r["request"], r["repeat"], r["order"], r["head"], r["setting"], r["total_s"],
                r["draft_s"], r["verify_s"], r.get("head_rows", 0), r.get("body_rows", 0), r.get("observe_s", 0.0),
                r.get("calls_s", 0.0), r.get("calls", 0)) for r in rows]
    return sorted(runs, key=lambda r: (r.repeat, r.request))  # stable: each block keeps its plan order
