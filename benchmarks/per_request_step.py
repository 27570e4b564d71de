"""What a serving engine's draft step costs with per-request sets on a CPU, against the dense head.

    python benchmarks/per_request_step.py                                   # the grid of docs/per-request.md
    python benchmarks/per_request_step.py --vocab 5003 --hidden 256 --requests 8 --active 300

One step, as the vLLM plugin runs it per draft token: the logits of R rows (one per request, each over its own
request's set, ``RequestVocabs.logits``), then ``observe_rows`` of 5 ids per request (the target's top-k) and of 1
(the sampled token). ``dense`` is the full head ``x @ W.T`` alone. Times are medians of **CPU time**
(``time.process_time``, one thread), which a busy machine disturbs far less than wall time; still indicative.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from nanospec_fx import RequestVocabs
from nanospec_fx.eval.bench.timing import timings


def cpu_median(fn, repeats: int) -> float:
    """Median CPU seconds of ``repeats`` calls after one untimed call."""
    return statistics.median(timings(fn, repeats, warmup=1, min_seconds=0, clock=time.process_time))


def measure(vocab: int, hidden: int, requests: int, active: int, repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=g) / hidden ** 0.5
    vocabs = RequestVocabs(weight, max_requests=requests, capacity=active)
    for r in range(requests):
        vocabs.assign(r)
        vocabs.observe(r, torch.randint(0, vocab, (active // 2,), generator=g))
    rows = vocabs.rows_for(list(range(requests)))
    x = torch.randn(requests, hidden, generator=g)
    fed = torch.randint(0, vocab, (repeats + 1, requests, 5), generator=g)
    calls = iter(range(10 ** 9))

    def step():
        logits = vocabs.logits(x, rows)
        top = fed[next(calls) % fed.shape[0]]
        vocabs.observe_rows(rows, top)
        vocabs.observe_rows(rows, top[:, :1])
        return logits

    with torch.inference_mode():
        ms = {"step": cpu_median(step, repeats), "dense": cpu_median(lambda: x @ weight.T, repeats)}
    return dict(vocab=vocab, hidden=hidden, requests=requests, active=active,
                **{k: round(1e3 * v, 3) for k, v in ms.items()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[5003, 128256, 262144])
    p.add_argument("--hidden", type=int, nargs="+", default=None, help="default: 256, 1024, 640 for the vocabs")
    p.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--active", type=int, nargs="+", default=None, help="default: 300 for V < 10k, else 3000")
    p.add_argument("--repeats", type=int, default=21)
    args = p.parse_args()
    torch.set_num_threads(1)
    hiddens = args.hidden or [{5003: 256, 128256: 1024, 262144: 640}.get(v, 1024) for v in args.vocab]
    print("| V | H | requests | |A| | step ms (logits + 2 observe_rows) | dense head ms | step / dense |")
    print("|---|---|---|---|---|---|---|")
    for (vocab, hidden), requests in itertools.product(zip(args.vocab, hiddens), args.requests):
        for active in args.active or [300 if vocab < 10_000 else 3000]:
            r = measure(vocab, hidden, requests, active, args.repeats)
            print(f"| {vocab} | {hidden} | {requests} | {active} | {r['step']} | {r['dense']} | "
                  f"{r['step'] / max(r['dense'], 1e-9):.2f}x |", flush=True)


if __name__ == "__main__":
    main()
