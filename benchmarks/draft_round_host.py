"""One EAGLE draft round on the CPU host path, nanospec against the body alone: where the extra CPU time goes.

The round of the like-for-like e2e run (docs/results.md section 5), at Gemma-3-270M's drafter shape (H = 640,
V = 262,144, one decoder layer, GQA 4/1, head_dim 256; random weights: the cost does not depend on them), both
drafters through ``torch.compile`` as ``--compile-all eager`` runs them (nanospec's graph without inductor, the body
with Dynamo's ``eager`` backend; :func:`nanospec_fx.eval.bench.eagle_e2e.drafter_variants`), under
``torch.inference_mode`` as the decode loop runs:

* nanospec: the target's top-3 at the ``depth + 1`` verified positions joining the set (one observe), the feed of
  the round's 2 committed tokens (``draft_topk=1``), then ``depth - 1`` chain calls of one row;
* the body alone: the same calls, no head, no observe.

Per round and per part (the observe of the target's top-3; one nanospec op call of each kind on the set as the
round leaves it: ``observe`` of one active id, ``compact_logits`` of one row, ``compact_topk`` k=1 of its
log-softmax), median process CPU time (a busy machine disturbs it less than wall time), variants interleaved.
``--after-verify`` runs the target's verify work of a round before every timed round (untimed: a
``[depth + 1, H] x [H, V]`` product and its top-3, which sweep the caches as the real verify does), so each round
starts as it does in the decode loop; without it the rounds run back to back with warm caches.
Exact counts of the host path's work per op (torch compute ops under a dispatch mode, ``kernels/launch_count.py``,
and the bytes of the tensors they produce) come with it. The machine this runs on is shared: the JSON says so and
its timings are indicative; the counts are exact.

    python benchmarks/draft_round_host.py --label after --out benchmarks/results/draft-round-host-cpu.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn as nn

from nanospec_fx.eagle import EagleConfig, EagleDrafter, draft_chain, drafter_cache, feed
from nanospec_fx.eval import report
from nanospec_fx.eval.bench import eagle_e2e as B
from nanospec_fx.eval.bench.host_counts import host_op_counts
from nanospec_fx.eval.bench.timing import interleaved_medians
from nanospec_fx.eagle.speculative import drafter_state

COMPILE = "eager"
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_heads=4, num_kv_heads=1,
                   head_dim=256)


def build(vocab: int, active: int, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """``({"nanospec": drafter, "body": drafter}, prompt ids)``: a random drafter (embedding tied to its head), its
    nanospec variant (capacity 3,072) and its body alone, compiled alike; the set seeded with ``active`` ids."""
    torch.manual_seed(seed)
    config = EagleConfig(**{**GEMMA3_270M, "vocab_size": vocab})
    embed = nn.Embedding(vocab, config.hidden_size)
    head = nn.Linear(config.hidden_size, vocab, bias=False)
    head.weight = embed.weight
    drafter = EagleDrafter(config, embed=embed, lm_head=head, norm=nn.RMSNorm(config.hidden_size)).eval()
    for p in drafter.parameters():
        p.requires_grad_(False)
    variants = B.drafter_variants(drafter, None, 3072, which=("context", "body"), compile=COMPILE)
    named = {"nanospec": next(d for n, d in variants.items() if B.is_nanospec(n)), "body": variants[B.BODY]}
    prompt = torch.randperm(vocab)[:active]
    return named, prompt


class Round:
    """One drafter's rounds on its own cache: feed the committed tokens, then the chain; nanospec first observes
    the target's top-3 of the verified positions (``seeds``)."""

    def __init__(self, drafter, prompt: torch.Tensor, depth: int, cache_len: int = 512):
        self.drafter, self.depth = drafter, depth
        self.cache = drafter_cache(drafter, cache_len)
        hidden = drafter_config(drafter).hidden_size
        self.features = torch.randn(len(prompt), hidden)
        self.prompt = prompt
        self.gen = torch.Generator().manual_seed(1)
        with torch.inference_mode():  # prefill: the prompt fed once (it seeds the set of the nanospec variant)
            self.root = feed(drafter, self.cache, prompt[1:], self.features[:-1], 0, select=1)
        self.start = len(prompt) - 1
        self.state = drafter_state(drafter)

    def __call__(self) -> None:
        ids = self.prompt
        if self.state is not None:  # the target's top-3 at depth + 1 positions: mostly active, some new
            seeds = ids[torch.randint(0, len(ids), (self.depth + 1, 3), generator=self.gen)]
            seeds[0, 2] = torch.randint(0, self.state.vocab_size, (1,), generator=self.gen)[0]
            self.state.observe(seeds, validate=False)
        tokens = ids[torch.randint(0, len(ids), (2,), generator=self.gen)]
        start = self.start % 300  # a bounded cache: positions wrap, shapes stay
        root = feed(self.drafter, self.cache, tokens, self.features[:2], start, select=1)
        draft_chain(self.drafter, self.cache, root[0], root[1], start + 2, self.depth)
        self.start += 2


def drafter_config(drafter) -> EagleConfig:
    from nanospec_fx.vocab.module_heads import unwrap

    module = unwrap(drafter.body if isinstance(drafter, B.Replay) else drafter)
    return module.config


def after_verify(depth: int, vocab: int, hidden: int = GEMMA3_270M["hidden_size"]):
    """The target's verify work that precedes a round, as far as the caches see it: its LM head over the
    ``depth + 1`` verified rows and the top-3 taken over them (a random ``[V, H]`` head: the bytes, not the values,
    matter here)."""
    head = torch.randn(vocab, hidden)
    rows = torch.randn(depth + 1, hidden)

    def verify() -> None:
        with torch.inference_mode():
            (rows @ head.t()).topk(3, dim=-1)
    return verify


def medians(fns: dict, repeats: int, warmup: int = 5, before=None) -> dict[str, float]:
    """Median process CPU time of each function, in us, calls interleaved (``before``: untimed, before each)."""
    seconds = interleaved_medians(fns, repeats, warmup, clock=time.process_time, before=before)
    return {k: round(1e6 * v, 2) for k, v in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=GEMMA3_270M["vocab_size"])
    parser.add_argument("--active", type=int, default=105, help="ids in the set (the e2e run's mean |A|: 105)")
    parser.add_argument("--depths", default="1,2")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--after-verify", action="store_true",
                        help="run the target's verify-sized head product before each timed round (cold caches)")
    parser.add_argument("--label", default="run")
    parser.add_argument("--note", default="")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report.set_threads(1)
    drafters, prompt = build(args.vocab, args.active)
    result: dict = {"shape": {**GEMMA3_270M, "vocab_size": args.vocab, "capacity": 3072, "active": args.active},
                    "repeats": args.repeats, "after_verify": args.after_verify, "note": args.note, "rounds": {}}
    for depth in (int(d) for d in args.depths.split(",")):
        rounds = {name: Round(d, prompt, depth) for name, d in drafters.items()}
        verify = after_verify(depth, args.vocab) if args.after_verify else None
        with torch.inference_mode():
            us = medians(rounds, args.repeats, before=verify)
        result["rounds"][depth] = {"nanospec_us": us["nanospec"], "body_us": us["body"],
                                   "ratio": round(us["nanospec"] / us["body"], 3)}
        print(f"{args.label}: depth {depth}: round nanospec {us['nanospec']:.0f} us, body alone {us['body']:.0f} us, "
              f"ratio {us['nanospec'] / us['body']:.3f} (median process CPU time)")
    state = drafter_state(drafters["nanospec"])
    ids, slot_of, cursor, cache_w, cache_b = state.tensors()
    x = torch.randn(1, 1, cache_w.shape[1])
    compact = torch.ops.nanospec.compact_logits(x, cache_w, None, cursor)
    scores = torch.log_softmax(compact.float(), -1)
    seeds = ids[:9].reshape(3, 3).clone()
    with torch.inference_mode():
        parts = medians({
            "observe of the target's top-3 (3 positions, all active)": lambda: state.observe(seeds, validate=False),
            "observe op (1 active id)": lambda: torch.ops.nanospec.observe(ids[:1], state.head_rows, None, ids,
                                                                            slot_of, cursor, cache_w, cache_b,
                                                                            state.num_pinned),
            "compact_logits op (1 row)": lambda: torch.ops.nanospec.compact_logits(x, cache_w, None, cursor),
            "compact_topk op (k=1)": lambda: torch.ops.nanospec.compact_topk(scores, ids, cursor, 1),
        }, args.repeats * 5)
    result["parts_us"] = parts
    for name, us in parts.items():
        print(f"{args.label}: {name}: {us:.1f} us")
    result["counts"] = {**host_op_counts(state), **host_op_counts(state, rows=10, k=10)}
    for name, c in result["counts"].items():
        print(f"{args.label}: host {name}: {c['torch_ops']} torch ops, {c['bytes_produced']} bytes produced")
    result["provenance"] = {**report.provenance(), "shared_machine": True}
    if args.out:
        data = json.loads(args.out.read_text()) if args.out.exists() else {}
        data[args.label] = result
        args.out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
