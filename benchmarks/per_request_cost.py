"""What a batch of requests costs: gathered rows per request vs one union of the requests' sets (CPU, indicative).

    python benchmarks/per_request_cost.py                      # the grid of docs/per-request.md
    python benchmarks/per_request_cost.py --vocab 32000 --hidden 1024 --requests 8 --active 1000
    python benchmarks/per_request_cost.py --device cuda --dtype bfloat16 --hidden 4096   # on a GPU (Triton path)

Each of R requests holds |A| tokens: half drawn from one Zipf(1.1) law over the vocabulary (common tokens,
shared between requests), half uniformly (request-specific words); the union U of the sets is what a shared
cache would hold. Batch: ``--rows-per-request`` draft rows per request. Variants, all on the same weight:

* ``dense``: the full head ``x @ W.T`` [B, V] (no masking: the baseline cost);
* ``per_request``: :class:`nanospec_fx.RequestVocabs` (CPU host path: one GEMM per request over its own rows);
* ``union``: one GEMM of all rows over the |U| union rows (cache prebuilt: its upkeep is not timed), then each
  row masked by its request's membership (gathered from the per-request maps) and scattered to [B, V].

Two outputs: the [B, V] logits (what vLLM's ``compute_logits`` returns) and the argmax (a greedy drafter that
never builds [B, V]). Medians of interleaved calls, one thread: the machine is shared, timings are indicative.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import sys
from pathlib import Path

import torch

from nanospec_fx import RequestVocabs
from nanospec_fx.eval.bench.timing import interleaved_medians

NEG = float("-inf")


def request_sets(vocab: int, requests: int, active: int, seed: int) -> list[torch.Tensor]:
    """Token sets of ``active`` distinct ids per request: half Zipf-common (shared), half request-specific."""
    g = torch.Generator().manual_seed(seed)
    rank_to_token = torch.randperm(vocab, generator=g)
    zipf = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
    sets = []
    for _ in range(requests):
        common = rank_to_token[torch.multinomial(zipf, 4 * active, replacement=True, generator=g)]
        own = torch.randint(0, vocab, (4 * active,), generator=g)
        mixed = torch.stack([common, own], 1).reshape(-1)  # alternate: half of each
        sets.append(torch.tensor(list(dict.fromkeys(mixed.tolist()))[:active]))
    return sets


def union_head(x, rows, union_w, union_ids, slot_of, vocab):
    """All rows against the union cache, masked per row by membership, scattered: [B, V]."""
    compact = x @ union_w.T
    member = slot_of.view(-1)[rows[:, None] * vocab + union_ids[None, :]] >= 0
    compact = compact.masked_fill(~member, NEG)
    return compact.new_full((x.shape[0], vocab), NEG).scatter_(1, union_ids.expand(x.shape[0], -1), compact)


def union_argmax(x, rows, union_w, union_ids, slot_of, vocab):
    compact = x @ union_w.T
    member = slot_of.view(-1)[rows[:, None] * vocab + union_ids[None, :]] >= 0
    return union_ids[compact.masked_fill(~member, NEG).argmax(-1)]


def measure(vocab: int, hidden: int, requests: int, active: int, rows_per_request: int, repeats: int,
            device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict:
    torch.manual_seed(0)
    weight = (torch.randn(vocab, hidden) / hidden ** 0.5).to(device, dtype)
    sets = request_sets(vocab, requests, active, seed=1)
    vocabs = RequestVocabs(weight, max_requests=requests, capacity=active)
    for r, s in enumerate(sets):
        vocabs.assign(r)
        vocabs.observe(r, s)
    order = [r for r in range(requests) for _ in range(rows_per_request)]
    rows = vocabs.rows_for(order)
    x = torch.randn(len(order), hidden).to(device, dtype)
    union_ids = torch.unique(torch.cat(sets)).to(device)
    union_w = weight[union_ids].contiguous()
    slot_of = vocabs.slot_of
    with torch.inference_mode():  # the same answer from both, before timing
        a, b = vocabs.logits(x, rows), union_head(x, rows, union_w, union_ids, slot_of, vocab)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert torch.equal(torch.isfinite(a), torch.isfinite(b)) and torch.allclose(a[a.isfinite()], b[b.isfinite()],
                                                                                  rtol=tol, atol=tol)
        if dtype == torch.float32:  # lower precision: near-ties may round apart
            assert torch.equal(vocabs.argmax(x, rows), union_argmax(x, rows, union_w, union_ids, slot_of, vocab))
        seconds = interleaved_medians({
            "dense": lambda: x @ weight.T,
            "per_request_logits": lambda: vocabs.logits(x, rows),
            "union_logits": lambda: union_head(x, rows, union_w, union_ids, slot_of, vocab),
            "per_request_argmax": lambda: vocabs.argmax(x, rows),
            "union_argmax": lambda: union_argmax(x, rows, union_w, union_ids, slot_of, vocab),
        }, repeats)
    row = dict(vocab=vocab, hidden=hidden, requests=requests, active=active, rows=len(order), union=union_ids.numel())
    row.update({k: round(1e3 * v, 3) for k, v in seconds.items()})
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 128256])
    p.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--requests", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--active", type=int, nargs="+", default=[100, 1000, 3000])
    p.add_argument("--rows-per-request", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--csv", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    out = []
    cols = ["vocab", "hidden", "requests", "active", "rows", "union", "dense", "per_request_logits", "union_logits",
            "per_request_argmax", "union_argmax"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for vocab, hidden, requests, active in itertools.product(args.vocab, args.hidden, args.requests, args.active):
        row = measure(vocab, hidden, requests, active, args.rows_per_request, args.repeats, args.device,
                      getattr(torch, args.dtype))
        out.append(row)
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
        sys.stdout.flush()
    if args.csv:
        with args.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(out)


if __name__ == "__main__":
    main()
