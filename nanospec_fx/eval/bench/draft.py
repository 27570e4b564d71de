"""One EAGLE-2 draft round at a real drafter shape, with each LM head.

The drafter, its KV cache and the dynamic draft tree are :mod:`nanospec_fx.eagle`'s (the same code
that drafts in :func:`nanospec_fx.eagle.speculative_generate`); only the head changes between
variants, on the same random weights:

* ``full``: ``F.linear`` over the whole vocabulary;
* ``static-N``: FR-Spec, N fixed rows, ``-inf`` elsewhere (:class:`~nanospec_fx.eval.bench.e2e.StaticHead`);
* ``nanospec-ops +scatter``: ``compact_logits`` + ``scatter_logits`` called directly on an ActiveVocab;
* ``nanospec-compiled``: the head through ``torch.compile(backend="nanospec")``.

A round is what EAGLE-2 runs per verification: the root (the last accepted token with the target's
feature) through the drafter, then ``depth - 1`` tree levels of ``topk`` rows; the head runs once per
drafter call. The head's share of the round is timed separately (device synchronised around it).
"""
from __future__ import annotations

import math
import statistics
from typing import Callable

import torch
import torch.nn as nn

import nanospec_fx
from nanospec_fx.eagle import DraftTree, EagleConfig, EagleDrafter, KVCache, draft_tree, feed
from nanospec_fx.eval.bench.e2e import StaticHead
from nanospec_fx.eval.bench.head import Head, active_ids, filled_state
from nanospec_fx.eval.bench.timing import Stopwatch, time_call
from nanospec_fx.kernels import ops
from nanospec_fx.vocab.config import DEFAULT_CAPACITY, DEFAULT_STATIC_SIZE

DRAFTER_SHAPES = {
    "llama3-8b": EagleConfig.llama3_8b,  # EAGLE's drafter of Llama-3.1-8B
    "tiny": lambda: EagleConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2),
}


def head_variants(weight: torch.Tensor, active: int, static_n: int, compiled: bool = True,
                  inductor: bool = True) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """name -> ``head(h) -> logits [..., V]`` for each variant (``-inf`` outside its vocabulary)."""
    vocab = weight.shape[0]
    state = filled_state(weight, active)
    heads: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "full": Head(weight).eval(),
        f"static-{static_n}": StaticHead(weight, active_ids(vocab, static_n, seed=1)).eval(),
        "nanospec-ops +scatter": lambda h: ops.scatter_logits(
            compact=ops.compact_logits(x=h, cache_w=state.cache_w, cache_b=None, cursor=state.cursor),
            ids=state.ids, cursor=state.cursor, vocab_size=vocab),
    }
    if compiled:
        torch._dynamo.reset()
        module = Head(weight).eval()
        cmod = torch.compile(module, backend="nanospec", options={"capacity": active, "inductor": inductor})
        with torch.inference_mode():
            cmod(torch.zeros(1, 1, weight.shape[1], dtype=weight.dtype, device=weight.device))
        nanospec_fx.active_vocab(module).observe(active_ids(vocab, active).to(weight.device))
        heads["nanospec-compiled"] = cmod
    return heads


class TimedHead(nn.Module):
    """The drafter body (an :class:`EagleDrafter` whose ``lm_head`` is the identity) + a head timed apart."""

    def __init__(self, body: EagleDrafter, head: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.body, self.head, self.watch = body, head, Stopwatch()

    def forward(self, *args):
        _, hidden = self.body(*args)
        with self.watch:
            logits = self.head(hidden)
        return logits, hidden


def draft_round(drafter: Callable, cache: KVCache, prefix: int, token: int, feature: torch.Tensor, depth: int,
                topk: int) -> DraftTree:
    """The root at position ``prefix`` (``token`` after the target's ``feature [H]``), then the tree."""
    tokens = torch.tensor([token], device=feature.device)
    root_logits, root_hidden = feed(drafter, cache, tokens, feature[None], prefix)
    return draft_tree(drafter, cache, root_logits, root_hidden, prefix + 1, depth, topk)


def random_drafter(config: EagleConfig, dtype=torch.float32, device: str = "cpu") -> EagleDrafter:
    """An EAGLE drafter body with random weights (scaled by 1/sqrt(fan-in)) and no head."""
    torch.manual_seed(0)
    body = EagleDrafter(config, lm_head=nn.Identity()).to(device=device, dtype=dtype).eval().requires_grad_(False)
    for p in body.parameters():
        p.data.normal_(0, 1 / math.sqrt(p.shape[-1]))
    return body


def bench_draft(config: EagleConfig, active: int = DEFAULT_CAPACITY, static_n: int = DEFAULT_STATIC_SIZE,
                depth: int = 6, topk: int = 10,
                prefix: int = 512, repeats: int = 5, dtype=torch.float32, device: str = "cpu", compiled: bool = True,
                progress=None, inductor: bool = True) -> list[dict]:
    """Draft-round time with each head variant (same drafter body, same random weights)."""
    body = random_drafter(config, dtype, device)
    vocab, hidden = config.vocab_size, config.hidden_size
    weight = torch.randn(vocab, hidden, dtype=dtype, device=device).div_(math.sqrt(hidden))
    heads = head_variants(weight, min(active, vocab), min(static_n, vocab), compiled, inductor)
    cache = body.new_cache(prefix + 1 + (depth - 1) * topk)
    cache.k[:, :, :prefix].normal_()  # the committed prefix the draft attends to
    cache.v[:, :, :prefix].normal_()
    feature = torch.randn(hidden, dtype=dtype, device=device)
    rows = []
    with torch.inference_mode():
        for name, head in heads.items():
            drafter = TimedHead(body, head)
            run = lambda: draft_round(drafter, cache, prefix, 1, feature, depth, topk)  # noqa: E731
            run()  # warm-up
            rounds, head_s = [], []
            for _ in range(repeats):
                drafter.watch = Stopwatch()
                rounds.append(time_call(run))
                head_s.append(drafter.watch.seconds)
            rows.append({"variant": name, "round_ms": 1e3 * statistics.median(rounds),
                         "head_ms": 1e3 * statistics.median(head_s)})
            if progress:
                progress(name)
    full = rows[0]["round_ms"]
    for r in rows:
        r["head_share"] = r["head_ms"] / r["round_ms"]
        r["vs_full"] = r["round_ms"] / full - 1.0
    return rows
