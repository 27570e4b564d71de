"""A centroid-selected head (Gemma-4's assistant) against NanoSpec's set at the same number of rows: coverage.

    python benchmarks/centroid_coverage.py                       # docs/results.md, "Centroid selection"
    python benchmarks/centroid_coverage.py --corpus 'sharegpt[:8]' --centroids 256 --rows 1024   # a quick run

Gemma-4's assistant scores only the rows of the clusters its trained centroids pick (``Gemma4AssistantMaskedEmbedder``:
top-k of ``centroids(h)``, each cluster a fixed block of ``V / C`` tokens of its ``token_ordering``). No trained
Gemma-4 assistant is available offline, so this is a **training-free proxy** on Gemma-3-270M (the same 262,144-token
vocabulary): the tied embedding/head rows are clustered by spherical k-means (a subsample, a few iterations) into C
clusters of exactly ``V / C`` tokens (each token to its nearest centroid with room, the most confident first), and a
cluster's score at a position is the target's final (normed) hidden state times the mean of the cluster's rows (the
cluster's mean logit). Trained centroids read the assistant's own hidden state and were trained for this: they may
do better than this proxy.

On ShareGPT answers, teacher-forced through Gemma-3-270M, at each answer position (the drafter proposing token t from
position t-1) it counts whether the target's greedy next token, and the reference next token, is among the rows of:

* ``centroids``: the top clusters by score, R / (V / C) of them (R rows);
* ``nanospec``: NanoSpec's set of capacity R (prompt + committed tokens + the target's top-3 at every verified
  position, verified every token: ``nanospec_fx.eval.coverage.context(R, topk=3)``, as ``nanospec-fx coverage``);
* ``union``: the top clusters of R // 2 rows (whole clusters: ``(R // 2) // (V / C)``) and a NanoSpec set of the
  rest of the budget, their union (at most R rows);
* ``union_filled``: NanoSpec's set of capacity R // 2 and as many whole top clusters as the rest of R holds beside
  it at that position (``(R - |set|) // (V / C)``: the set is rarely full, so the clusters take the rows it leaves);
* ``nanospec_in_centroids``: NanoSpec's set of capacity R restricted to the R rows of the top clusters (fewer rows).

``mean_rows`` is the mean number of rows scored per position. Only the ids and hidden states matter: no timing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from nanospec_fx.eval import coverage as C
from nanospec_fx.eval import loaders
from nanospec_fx.eval.bench.timing import PhaseTimer
from nanospec_fx.eval.markdown import centroid_coverage
from nanospec_fx.eval.report import machine, set_threads, write_outputs

TOPK = 3


def spherical_kmeans(unit: torch.Tensor, clusters: int, sample: int, iters: int, seed: int) -> torch.Tensor:
    """Unit centroids [clusters, H] of a random subsample of the unit rows ``unit``."""
    g = torch.Generator().manual_seed(seed)
    x = unit[torch.randperm(unit.shape[0], generator=g)[:sample]]
    cent = x[torch.randperm(x.shape[0], generator=g)[:clusters]].clone()
    for _ in range(iters):
        assign = (x @ cent.T).argmax(1)
        sums = torch.zeros_like(cent).index_add_(0, assign, x)
        empty = sums.norm(dim=1) == 0
        sums[empty] = cent[empty]  # a cluster that lost every point keeps its centroid
        cent = F.normalize(sums, dim=1)
    return cent


def balanced_clusters(unit: torch.Tensor, cent: torch.Tensor, chunk: int = 16384, prefs: int = 16) -> torch.Tensor:
    """cluster of each token [V], every cluster exactly V / C tokens (Gemma-4's ``token_ordering.view(C, V // C)``):
    tokens by decreasing similarity to their nearest centroid, each to its most similar centroid with room."""
    vocab, clusters = unit.shape[0], cent.shape[0]
    per = vocab // clusters
    best, order = [], []
    for i in range(0, vocab, chunk):
        s = unit[i: i + chunk] @ cent.T
        top = s.topk(min(prefs, clusters), dim=1)
        best.append(top.values[:, 0])
        order.append(top.indices)
    pref = torch.cat(order).tolist()
    fill, cluster = [0] * clusters, [-1] * vocab
    leftover = []
    for t in torch.cat(best).argsort(descending=True).tolist():
        c = next((c for c in pref[t] if fill[c] < per), None)
        if c is None:
            leftover.append(t)
            continue
        fill[c] += 1
        cluster[t] = c
    for t in leftover:  # its preferred clusters were full: the most similar one with room
        c = next(c for c in (unit[t] @ cent.T).argsort(descending=True).tolist() if fill[c] < per)
        fill[c] += 1
        cluster[t] = c
    return torch.tensor(cluster)


def cluster_ranks(hidden: torch.Tensor, scores_weight: torch.Tensor) -> torch.Tensor:
    """[N, C]: rank (0 = best) of each cluster at each position, by hidden . cluster mean row."""
    order = (hidden @ scores_weight.T).argsort(dim=1, descending=True)
    return torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1]).expand_as(order))


def requests(model, tok, corpus: str, max_prompt: int, max_new: int):
    """The corpus as coverage Requests with the target's top-k, and the hidden states at every answer position."""
    out, hidden = [], []
    for s in loaders.load_corpus(corpus):
        prompt = tok.encode(s.prompt, bos=True)
        if len(prompt) > max_prompt:
            prompt = prompt[:1] + prompt[-(max_prompt - 1):]
        cont = tok.encode(s.continuation)[:max_new]
        if not cont:
            continue
        req = C.Request("sharegpt", prompt, cont)
        req.predicted, h = C.teacher_forced(model, req.ids, TOPK)
        out.append(req)
        hidden.append(h[len(prompt) - 1: len(req.ids) - 1])  # the positions that predict the answer's tokens
    return out, torch.cat(hidden)


def nanospec_sets(reqs, capacities, targets, layouts):
    """NanoSpec's set of each capacity along every request (the project's replay): whether each target token is in
    it, its size, and the cluster rank of each of its tokens under each layout (for the intersection)."""
    n_pos = sum(len(r.continuation) for r in reqs)
    member = {cap: {k: torch.zeros(n_pos, dtype=torch.bool) for k in targets} for cap in capacities}
    size = {cap: torch.zeros(n_pos) for cap in capacities}
    inter_ranks = {(cap, n): [] for cap in capacities for n in layouts}
    for cap in capacities:
        i = 0
        for r in reqs:
            for _, active in C.replay(r, C.context(cap, topk=TOPK)):
                ids = torch.tensor(list(active))
                for k, tokens in targets.items():
                    member[cap][k][i] = int(tokens[i]) in active
                size[cap][i] = len(ids)
                for n, (cluster, ranks) in layouts.items():
                    inter_ranks[(cap, n)].append(ranks[i][cluster[ids]])
                i += 1
    return member, size, inter_ranks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--tokenizer", default="gemma3")
    p.add_argument("--corpus", default="sharegpt[:20]")
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--centroids", default="256,1024,2048", help="numbers of clusters C (comma-separated)")
    p.add_argument("--rows", default="1024,3072,4096", help="row budgets R (comma-separated)")
    p.add_argument("--sample", type=int, default=16384, help="rows k-means is fitted on")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="centroid-coverage-gemma3-270m")
    a = p.parse_args()
    set_threads(a.threads)
    timer = PhaseTimer()
    with timer("load"):
        model = loaders.load_model(a.model)
        tok = loaders.load_tokenizer(a.tokenizer)
    weight = model.get_output_embeddings().weight.detach().float()  # tied to the token embedding
    vocab = weight.shape[0]
    with timer("teacher forcing"):
        reqs, hidden = requests(model, tok, a.corpus, a.max_prompt, a.max_new)
    positions = [(r, t) for r in reqs for t in range(len(r.prompt), len(r.ids))]
    ref = torch.tensor([r.ids[t] for r, t in positions])
    greedy = torch.tensor([r.predicted[t][0] for r, t in positions])
    print(f"{len(reqs)} requests, {len(positions)} answer positions")
    targets = {"greedy": greedy, "reference": ref}

    budgets = sorted(int(x) for x in a.rows.split(","))
    capacities = sorted(set(budgets))
    unit = F.normalize(weight, dim=1)
    layouts = {}
    for n in (int(x) for x in a.centroids.split(",")):
        if vocab % n:
            raise SystemExit(f"--centroids {n} does not divide V = {vocab} (Gemma-4's clusters are V / C tokens)")
        with timer(f"clusters C={n}"):
            cluster = balanced_clusters(unit, spherical_kmeans(unit, n, a.sample, a.iters, a.seed))
            mean_rows = torch.zeros(n, weight.shape[1]).index_add_(0, cluster, weight) / (vocab // n)
            layouts[n] = (cluster, cluster_ranks(hidden, mean_rows))
        for R in budgets:  # the unions' NanoSpec parts
            capacities += [R - (R // 2) // (vocab // n) * (vocab // n), R // 2]
    capacities = sorted(set(capacities))

    with timer("nanospec sets"):
        member, size, inter_ranks = nanospec_sets(reqs, capacities, targets, layouts)

    rows = []
    for n, (cluster, ranks) in layouts.items():
        per = vocab // n
        rank_of = {k: ranks.gather(1, cluster[tokens][:, None])[:, 0] for k, tokens in targets.items()}
        for R in budgets:
            k_all, k_half = R // per, (R // 2) // per
            cap_rest = R - k_half * per
            inter = torch.tensor([float((x < k_all).sum()) for x in inter_ranks[(R, n)]])
            inter_half = torch.tensor([float((x < k_half).sum()) for x in inter_ranks[(cap_rest, n)]])
            k_fill = ((R - size[R // 2]) // per).long()  # clusters the rest of R holds beside the set, per position
            inter_fill = torch.tensor([float((x < k).sum()) for x, k in zip(inter_ranks[(R // 2, n)], k_fill)])
            methods = {
                "centroids": ({k: rank_of[k] < k_all for k in targets}, torch.full((len(positions),), float(k_all * per))),
                "nanospec": (member[R], size[R]),
                "union": ({k: (rank_of[k] < k_half) | member[cap_rest][k] for k in targets},
                          k_half * per + size[cap_rest] - inter_half),
                "union_filled": ({k: (rank_of[k] < k_fill) | member[R // 2][k] for k in targets},
                                 size[R // 2] + k_fill * per - inter_fill),
                "nanospec_in_centroids": ({k: (rank_of[k] < k_all) & member[R][k] for k in targets}, inter),
            }
            for method, (hit, used) in methods.items():
                rows.append({"centroids": n, "tokens_per_cluster": per, "rows": R, "method": method,
                             "clusters": {"union": k_half, "union_filled": float(k_fill.float().mean())}.get(method, k_all),
                             "nanospec_capacity": {"union": cap_rest, "union_filled": R // 2}.get(method, R),
                             "coverage_greedy": float(hit["greedy"].float().mean()),
                             "coverage_reference": float(hit["reference"].float().mean()),
                             "mean_rows": float(used.mean()), "positions": len(positions)})
    print(centroid_coverage({"rows": rows}))
    meta = {"command": "python benchmarks/centroid_coverage.py " + " ".join(sys.argv[1:]),
            "model": a.model, "corpus": a.corpus, "requests": len(reqs), "positions": len(positions),
            "max_prompt": a.max_prompt, "max_new": a.max_new, "topk": TOPK, "kmeans_sample": a.sample,
            "kmeans_iters": a.iters, "seed": a.seed, "machine": machine(),
            "seconds": {phase: round(w.seconds, 1) for phase, w in timer.watches.items()},
            "greedy_equals_reference": float((greedy == ref).float().mean()),
            "proxy": "spherical k-means of Gemma-3-270M's tied head rows, balanced to V/C tokens per cluster; "
                     "cluster score = target's final hidden state . mean row of the cluster (not Gemma-4's "
                     "trained centroids)"}
    write_outputs(a.out, a.name, rows, meta)


if __name__ == "__main__":
    main()
