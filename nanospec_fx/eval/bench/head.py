"""Timing: the LM head alone, and a whole EAGLE-2-style draft round, at real model shapes.

Variants of the head (all in one process, on the same weights):

* ``dense``: ``F.linear`` over the whole vocabulary;
* ``static-N``: FR-Spec, ``F.linear`` over a fixed copy of N rows (ids mapped back after top-k);
* ``nanospec-ops``: ``torch.ops.nanospec.compact_logits`` (+ ``scatter_logits`` to [rows, V]
  for the drop-in output) called directly on an :class:`ActiveVocab`;
* ``nanospec-compiled``: the head module through ``torch.compile(backend="nanospec")``.

The nanospec ops run over the whole capacity and mask by the device-side count (no host sync,
static shapes), so their cost follows the capacity: here the capacity is set to the active size.
Times are medians over repeats; the bytes-read limit of a head restricted to N rows is V / N.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import nanospec_fx
from nanospec_fx.kernels import ops

# hidden size H, vocabulary V of the LM heads of real models
SHAPES = {
    "llama3-8b": (4096, 128256),
    "qwen2-7b": (3584, 152064),
    "gemma3-270m": (640, 262144),
    "gemma3-27b": (5376, 262144),
}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timings(fn: Callable[[], object], repeats: int, warmup: int = 2, min_seconds: float = 0.3) -> list[float]:
    """Wall times of ``fn()`` in seconds: at least ``repeats`` calls and ``min_seconds`` in all (fast
    calls are repeated more, up to 200 times, so their median is not one scheduler hiccup)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    while len(times) < repeats or (sum(times) < min_seconds and len(times) < 200):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return times


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` in seconds."""
    return statistics.median(timings(fn, repeats, warmup))


class Head(nn.Module):
    """A bare LM head: what ``torch.compile(backend="nanospec")`` rewrites."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        self.lm_head.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)


def active_ids(vocab: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(vocab, generator=g)[:n]


def filled_state(weight: torch.Tensor, n: int) -> nanospec_fx.ActiveVocab:
    """An ActiveVocab of capacity ``n`` holding ``n`` random tokens."""
    st = nanospec_fx.ActiveVocab(weight, capacity=n)
    st.observe(active_ids(weight.shape[0], n).to(weight.device))
    return st


@dataclass
class HeadTiming:
    shape: str
    hidden: int
    vocab: int
    rows: int
    variant: str
    size: int  # vocabulary rows the head computes
    ms: float  # median
    speedup: float  # dense time / this time
    limit: float  # bytes-read limit of the speedup: V / size
    of_limit: float  # speedup / limit
    min_ms: float = float("nan")  # fastest call: the least disturbed by other processes


def bench_head(shape: str, hidden: int, vocab: int, active: int = 3072, static_n: int = 32768, rows=(1, 10),
               repeats: int = 10, dtype=torch.float32, compiled: bool = True, device: str = "cpu",
               progress: Callable[[str], None] | None = None, inductor: bool = True) -> list[HeadTiming]:
    """Every head variant at one shape; the weight is allocated once."""
    torch.manual_seed(0)
    weight = torch.randn(vocab, hidden, dtype=dtype, device=device).div_(math.sqrt(hidden))  # in place: allocate once
    w_static = weight[active_ids(vocab, static_n, seed=1).to(device)].contiguous()
    state = filled_state(weight, active)
    cmod = None
    if compiled:
        torch._dynamo.reset()  # a fresh cache per shape: the recompile limit must not turn the head eager
        head = Head(weight).eval()
        cmod = torch.compile(head, backend="nanospec", options={"capacity": active, "inductor": inductor}, dynamic=False)
        with torch.no_grad():
            cmod(torch.zeros(1, hidden, dtype=dtype, device=device))
        nanospec_fx.active_vocab(head).observe(active_ids(vocab, active).to(device))
    out = []
    for r in rows:
        x = torch.randn(r, hidden, dtype=dtype, device=device)
        variants: dict[str, tuple[int, Callable]] = {
            "dense": (vocab, lambda: F.linear(x, weight)),
            f"static-{static_n}": (static_n, lambda: F.linear(x, w_static)),
            "nanospec-ops compact": (active, lambda: ops.compact_logits(x, state.cache_w, None, state.cursor)),
            "nanospec-ops +scatter": (active, lambda: ops.scatter_logits(
                ops.compact_logits(x, state.cache_w, None, state.cursor), state.ids, state.cursor, vocab)),
        }
        if cmod is not None:
            with torch.inference_mode():  # it must really be the rewritten head (not an eager fallback)
                if int(torch.isinf(cmod(x)).sum()) != r * (vocab - active):
                    raise RuntimeError("the compiled head does not compute the active vocabulary only")
            variants["nanospec-compiled"] = (active, lambda: cmod(x))
        with torch.inference_mode():
            times = {}
            for name, (size, fn) in variants.items():
                ts = timings(fn, repeats)
                times[name] = (size, statistics.median(ts), min(ts))
                if progress:
                    progress(f"{shape} rows={r} {name}")
        dense = times["dense"][1]
        for name, (size, t, tmin) in times.items():
            sp, lim = dense / t, vocab / size
            out.append(HeadTiming(shape, hidden, vocab, r, name, size, 1e3 * t, sp, lim, sp / lim, 1e3 * tmin))
    return out


def bench_head_sweep(shape: str, hidden: int, vocab: int, sizes, rows=(1, 10), repeats: int = 10,
                     dtype=torch.float32, device: str = "cpu", progress=None) -> list[HeadTiming]:
    """Head time against the active size (nanospec ops, compact logits) next to the dense head."""
    torch.manual_seed(0)
    weight = torch.randn(vocab, hidden, dtype=dtype, device=device).div_(math.sqrt(hidden))  # in place: allocate once
    out = []
    with torch.inference_mode():
        for r in rows:
            x = torch.randn(r, hidden, dtype=dtype, device=device)
            ts = timings(lambda: F.linear(x, weight), repeats)
            dense = statistics.median(ts)
            out.append(HeadTiming(shape, hidden, vocab, r, "dense", vocab, 1e3 * dense, 1.0, 1.0, 1.0, 1e3 * min(ts)))
            for n in sizes:
                st = filled_state(weight, n)
                ts = timings(lambda: ops.compact_logits(x, st.cache_w, None, st.cursor), repeats)
                t = statistics.median(ts)
                out.append(HeadTiming(shape, hidden, vocab, r, "nanospec-ops compact", n, 1e3 * t, dense / t,
                                      vocab / n, dense / t / (vocab / n), 1e3 * min(ts)))
                if progress:
                    progress(f"rows={r} size={n}")
    return out


# ----------------------------------------------------------------------------- draft round
@dataclass
class DrafterConfig:
    """EAGLE-2 drafter of Llama-3.1-8B: one decoder layer over [token embedding ; target feature]."""

    vocab: int = 128256
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    rope_theta: float = 500000.0

    @classmethod
    def tiny(cls, vocab: int = 512) -> "DrafterConfig":
        return cls(vocab=vocab, hidden=64, intermediate=128, heads=4, kv_heads=2)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [n, heads, d] at integer positions pos [n]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = ang.cos()[:, None].to(x.dtype), ang.sin()[:, None].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class DraftLayer(nn.Module):
    """One Llama decoder layer with an explicit KV cache and an arbitrary attention mask (tree attention)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c, hd = c, c.hidden // c.heads
        self.in_norm, self.post_norm = nn.RMSNorm(c.hidden, eps=1e-5), nn.RMSNorm(c.hidden, eps=1e-5)
        self.q = nn.Linear(c.hidden, c.heads * hd, bias=False)
        self.k = nn.Linear(c.hidden, c.kv_heads * hd, bias=False)
        self.v = nn.Linear(c.hidden, c.kv_heads * hd, bias=False)
        self.o = nn.Linear(c.heads * hd, c.hidden, bias=False)
        self.gate = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down = nn.Linear(c.intermediate, c.hidden, bias=False)

    def forward(self, x, pos, cache_k, cache_v, length: int, mask):
        """x [n, H] at positions pos; attends to cache[:length] + itself under mask [n, length + n]."""
        c, n, hd = self.c, x.shape[0], self.c.hidden // self.c.heads
        h = self.in_norm(x)
        q = rope(self.q(h).view(n, c.heads, hd), pos, c.rope_theta)
        cache_k[length: length + n] = rope(self.k(h).view(n, c.kv_heads, hd), pos, c.rope_theta)
        cache_v[length: length + n] = self.v(h).view(n, c.kv_heads, hd)
        k = cache_k[: length + n].repeat_interleave(c.heads // c.kv_heads, dim=1)
        v = cache_v[: length + n].repeat_interleave(c.heads // c.kv_heads, dim=1)
        att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
        x = x + self.o(att.transpose(0, 1).reshape(n, -1))
        h = self.post_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class EagleDrafter(nn.Module):
    """Token embedding + target feature -> fc -> one decoder layer -> final norm (the head is separate)."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.fc = nn.Linear(2 * c.hidden, c.hidden, bias=False)
        self.layer = DraftLayer(c)
        self.norm = nn.RMSNorm(c.hidden, eps=1e-5)

    def forward(self, ids, feats, pos, cache_k, cache_v, length, mask):
        x = self.fc(torch.cat([self.embed(ids), feats], -1))
        h = self.layer(x, pos, cache_k, cache_v, length, mask)
        return h, self.norm(h)  # feature for the children, normed state for the head


class LogProbHead(nn.Module):
    """Shared LM head + log-softmax + top-k: what one draft step needs from the vocabulary."""

    def __init__(self, weight: torch.Tensor, k: int):
        super().__init__()
        self.k = k
        self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        self.lm_head.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, h):
        return torch.log_softmax(self.lm_head(h).float(), -1).topk(self.k, dim=-1)


def make_heads(weight: torch.Tensor, k: int, active: int, static_n: int, compiled: bool = True,
               inductor: bool = True) -> dict[str, Callable]:
    """name -> fn(h) returning (log-prob top-k values, token ids [n, k]) for each head variant."""
    vocab = weight.shape[0]
    table = active_ids(vocab, static_n, seed=1).to(weight.device)
    w_static = weight[table].contiguous()
    state = filled_state(weight, active)
    heads: dict[str, Callable] = {
        "full": lambda h: torch.log_softmax(F.linear(h, weight).float(), -1).topk(k, dim=-1),
    }

    def static_head(h):
        v, i = torch.log_softmax(F.linear(h, w_static).float(), -1).topk(k, dim=-1)
        return v, table[i]

    def compact_head(h):
        v, i = torch.log_softmax(ops.compact_logits(h, state.cache_w, None, state.cursor).float(), -1).topk(k, dim=-1)
        return v, state.ids[i]

    heads[f"static-{static_n}"] = static_head
    heads["nanospec-ops compact"] = compact_head
    if compiled:
        torch._dynamo.reset()
        module = LogProbHead(weight, k).eval()
        cmod = torch.compile(module, backend="nanospec", options={"capacity": active, "inductor": inductor}, dynamic=False)
        with torch.inference_mode():
            cmod(torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device))
        nanospec_fx.active_vocab(module).observe(active_ids(vocab, active).to(weight.device))
        heads["nanospec-compiled"] = cmod
    return heads


def draft_round(drafter: EagleDrafter, head: Callable, cache_k, cache_v, prefix: int, token: int, feat: torch.Tensor,
                depth: int = 6, topk: int = 10, times: dict | None = None) -> list[tuple[int, int, float]]:
    """One EAGLE-2 draft round: ``depth`` drafter steps, each expanding the ``topk`` best nodes.

    Step 0 runs the root (the last accepted token with the target's feature); every later step runs
    the ``topk`` frontier nodes with tree attention (each sees the prefix and its own ancestors)
    and keeps the ``topk`` children with the best cumulative log-probability. Returns the tree as
    (token, parent node or -1, cumulative log-prob). ``times["head"]`` accumulates the head's seconds.
    """
    dev = feat.device
    nodes: list[tuple[int, int, float]] = []
    frontier, anc = [-1], [[]]  # frontier node ids (-1: root) and the cache slots of their ancestors
    length, ids = prefix, torch.tensor([token], device=dev)
    feats, scores = feat[None], torch.zeros(1, device=dev)
    for d in range(depth):
        n = len(frontier)
        mask = torch.zeros(n, length + n, dtype=torch.bool, device=dev)
        mask[:, :prefix] = True
        for row in range(n):
            mask[row, anc[row] + [length + row]] = True
        pos = torch.full((n,), prefix + d, device=dev)
        h, normed = drafter(ids, feats, pos, cache_k, cache_v, length, mask)
        if times is not None:
            _sync()
            t = time.perf_counter()
        logp, top = head(normed)
        if times is not None:
            _sync()
            times["head"] = times.get("head", 0.0) + time.perf_counter() - t
        cand = (scores[:, None] + logp).flatten()
        best = cand.topk(min(topk, cand.numel())).indices
        parents = best // logp.shape[1]
        ids, scores, feats = top.flatten()[best], cand[best], h[parents]
        new_frontier, new_anc = [], []
        for p, tok, s in zip(parents.tolist(), ids.tolist(), scores.tolist()):
            nodes.append((tok, frontier[p], s))
            new_frontier.append(len(nodes) - 1)
            new_anc.append(anc[p] + [length + p])  # the parent was cached at length + p
        frontier, anc, length = new_frontier, new_anc, length + n
    return nodes


def bench_draft(config: DrafterConfig, active: int = 3072, static_n: int = 32768, depth: int = 6, topk: int = 10,
                prefix: int = 512, repeats: int = 5, dtype=torch.float32, device: str = "cpu", compiled: bool = True,
                progress=None, inductor: bool = True) -> list[dict]:
    """Draft-round time with each head variant (same drafter body, same random weights)."""
    torch.manual_seed(0)
    drafter = EagleDrafter(config).to(device=device, dtype=dtype).eval().requires_grad_(False)
    for p in drafter.parameters():
        p.data.normal_(0, 1 / math.sqrt(p.shape[-1]))
    weight = torch.randn(config.vocab, config.hidden, dtype=dtype, device=device).div_(math.sqrt(config.hidden))
    heads = make_heads(weight, topk, min(active, config.vocab), min(static_n, config.vocab), compiled, inductor)
    hd = config.hidden // config.heads
    cache_k = torch.randn(prefix + depth * topk + 1, config.kv_heads, hd, dtype=dtype, device=device)
    cache_v = torch.randn_like(cache_k)
    feat = torch.randn(config.hidden, dtype=dtype, device=device)
    rows = []
    with torch.inference_mode():
        for name, head in heads.items():
            run = lambda times=None: draft_round(drafter, head, cache_k, cache_v, prefix, 1, feat, depth, topk, times)
            run()  # warm-up
            rounds, head_s = [], []
            for _ in range(repeats):
                times = {}
                _sync()
                t = time.perf_counter()
                run(times)
                _sync()
                rounds.append(time.perf_counter() - t)
                head_s.append(times["head"])
            rows.append({"variant": name, "round_ms": 1e3 * statistics.median(rounds),
                         "head_ms": 1e3 * statistics.median(head_s)})
            if progress:
                progress(name)
    full = rows[0]["round_ms"]
    for r in rows:
        r["head_share"] = r["head_ms"] / r["round_ms"]
        r["vs_full"] = r["round_ms"] / full - 1.0
    return rows


# ----------------------------------------------------------------------------- end to end
class StaticHead(nn.Module):
    """FR-Spec as a drop-in head: logits for a fixed table of ids, -inf elsewhere."""

    def __init__(self, weight: torch.Tensor, table: torch.Tensor):
        super().__init__()
        self.vocab = weight.shape[0]
        self.register_buffer("table", table.to(weight.device), persistent=False)
        self.weight_static = nn.Parameter(weight[self.table].clone(), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = h.new_full((*h.shape[:-1], self.vocab), float("-inf"))
        out[..., self.table] = F.linear(h, self.weight_static)
        return out


def truncated_drafter(target: nn.Module, layers: int, head: nn.Module | None = None) -> nn.Module:
    """A self-speculative drafter: the target's first ``layers`` layers, final norm and (shared) head.

    Every parameter is the target's own tensor, so the drafter costs no memory; ``head`` replaces
    the LM head (e.g. a :class:`StaticHead`).
    """
    import copy

    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    with torch.device("meta"):
        drafter = type(target)(cfg)
    base, tbase = getattr(drafter, drafter.base_model_prefix), getattr(target, target.base_model_prefix)
    for name, child in tbase.named_children():
        setattr(base, name, nn.ModuleList(list(child)[:layers]) if name == "layers" else child)
    drafter.lm_head = head if head is not None else target.lm_head
    for name, t in list(drafter.named_parameters()) + list(drafter.named_buffers()):
        if t.is_meta:
            raise RuntimeError(f"truncated drafter: {name} was not taken from the target")
    drafter.generation_config = copy.deepcopy(target.generation_config)
    return drafter.eval()


class DraftTimer:
    """Wraps ``drafter.generate`` (what assisted generation calls each round): rounds and seconds."""

    def __init__(self, drafter: nn.Module):
        self.drafter, self.rounds, self.seconds, self.inside = drafter, 0, 0.0, False
        self._generate = drafter.generate
        drafter.generate = self

    def __call__(self, *args, **kwargs):
        self.inside = True
        t = time.perf_counter()
        try:
            return self._generate(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t
            self.rounds += 1
            self.inside = False

    def reset(self) -> None:
        self.rounds, self.seconds = 0, 0.0


class TargetTopK:
    """LogitsProcessor for the target: its top-k at every position it verifies joins the drafter's set.

    Unlike ``nanospec_fx.speculative_pair`` (which compiles the target in place as the observer and
    also sees the prefill), this keeps the target eager, so every variant runs the same target.
    Assisted generation hands the same processors to the drafter: calls made while it drafts are ignored.
    """

    def __init__(self, drafter: nn.Module, timer: DraftTimer, k: int = 3):
        self.drafter, self.timer, self.k = drafter, timer, k

    def __call__(self, input_ids, scores):
        if not self.timer.inside:
            try:
                state = nanospec_fx.active_vocab(self.drafter)
            except LookupError:
                return scores  # not compiled / not called yet
            state.observe(scores.topk(self.k, dim=-1).indices, validate=False)
        return scores


@dataclass
class E2EResult:
    variant: str
    tokens: int
    seconds: float
    tokens_per_s: float
    rounds: int
    tokens_per_round: float
    draft_share: float
    identical: bool
    active_size: float


def run_e2e(target: nn.Module, prompts: list[list[int]], drafters: dict[str, nn.Module], max_new: int = 64,
            draft_tokens: int = 6, observe_topk: int = 3, progress=None, pair: dict | None = None) -> list[E2EResult]:
    """Target-only greedy decoding, then ``generate(assistant_model=d)`` for each drafter.

    Drafters whose head has an active vocabulary (compiled with nanospec) are reset before each
    request and fed the target's top-``observe_topk`` at every verified position. Each variant's
    output is compared token for token with the target's greedy output.

    With ``pair`` (backend options) the last drafter is set up with ``nanospec_fx.speculative_pair``
    instead: the target is compiled in place as the observer (so it must come last).
    """
    from transformers import LogitsProcessorList

    kw = dict(do_sample=False, max_new_tokens=max_new, pad_token_id=target.generation_config.pad_token_id or 0)
    results, reference = [], []
    with torch.inference_mode():
        for p in prompts[:2]:  # warm-up, as for the drafters
            target.generate(torch.tensor([p]), **kw)
        t0, n = time.perf_counter(), 0
        for p in prompts:
            out = target.generate(torch.tensor([p]), **kw)[0, len(p):]
            reference.append(out)
            n += out.numel()
        secs = time.perf_counter() - t0
        results.append(E2EResult("target only", n, secs, n / secs, n, 1.0, 0.0, True, float("nan")))
        if progress:
            progress("target only")
        for name, drafter in drafters.items():
            g = drafter.generation_config
            g.num_assistant_tokens, g.num_assistant_tokens_schedule, g.assistant_confidence_threshold = draft_tokens, "constant", 0.0
            if pair is not None and name == list(drafters)[-1]:
                nanospec_fx.speculative_pair(target, drafter, observe_topk=observe_topk, **pair)
                procs = LogitsProcessorList()
                timer = DraftTimer(drafter)
            else:
                timer = DraftTimer(drafter)
                procs = LogitsProcessorList([TargetTopK(drafter, timer, observe_topk)] if observe_topk else [])
            run = lambda p, m=max_new: target.generate(torch.tensor([p]), assistant_model=drafter, logits_processor=procs,
                                                       **{**kw, "max_new_tokens": m})[0, len(p):]
            for p in prompts[:2]:  # warm-up: a compiled drafter recompiles once for dynamic lengths, then settles
                run(p)
            timer.reset()
            same, n, secs, sizes = True, 0, 0.0, []
            for p, ref in zip(prompts, reference):
                state = _state_or_none(drafter)
                if state is not None:
                    state.reset()
                t0 = time.perf_counter()
                out = run(p)
                secs += time.perf_counter() - t0
                n += out.numel()
                same &= torch.equal(out, ref)
                state = _state_or_none(drafter)
                if state is not None:
                    sizes.append(len(state))
            results.append(E2EResult(name, n, secs, n / secs, timer.rounds, n / max(timer.rounds, 1),
                                     timer.seconds / secs, bool(same), statistics.mean(sizes) if sizes else float("nan")))
            drafter.generate = timer._generate
            if progress:
                progress(name)
    return results


def _state_or_none(drafter: nn.Module):
    try:
        return nanospec_fx.active_vocab(drafter)
    except LookupError:
        return None
