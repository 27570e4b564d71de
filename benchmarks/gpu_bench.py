"""GPU benchmark of the nanospec kernels at Llama-3-8B head shape (bf16, H=4096, V=128256).

    python benchmarks/gpu_bench.py                      # CUDA, full shape, writes benchmarks/results/
    python benchmarks/gpu_bench.py --device cpu --small # smoke run of this script on CPU

Variants per row count (1 and 10): dense ``F.linear`` over the full head; a static 32k head
(FR-Spec style: 32768 fixed rows gathered once, matmul, index map after top-k); the nanospec
head (compact logits; + scatter to [rows, V]; fused head_logits; + compact top-k) and the full
nanospec draft step (observe of new ids + head + top-k). Times are medians of CUDA-event
timings with the L2 cache flushed before each call (a drafter's other work evicts the head
between steps), eager and replayed from a CUDA graph. Each is compared to the time to read the
rows it needs at the device bandwidth (--bandwidth, 4.8 TB/s for an H200). The nanospec step
also runs under ``torch.cuda.set_sync_debug_mode("error")``: any host sync raises.

Each draft step observes NEW_PER_STEP ids of which FRESH_PER_STEP were never seen (the rest are
active already), so the step timings include real insertions; the cursor must move. Observe is
also timed alone with 0, 2 and 16 new ids per call, and stress-tested against the reference
(eager and in a CUDA graph; duplicates, out-of-range ids, pinned slots; capacities 64 and the
full one). Every configuration in ``HEAD_CONFIGS`` is timed (``--sweep``) and checked. Wrong
logits, a wrong top-k, a state that differs from the reference or a cursor that did not move
fail the run (exit 1); the JSON is rewritten after every step, so a timeout keeps what ran.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from nanospec_fx.eval.bench.graphs import graphed
from nanospec_fx.eval.bench.kernel_config import (head_config, head_configs, kernels, op_state, state_names,
                                                  triton_op_registration)
from nanospec_fx.eval.bench.timing import Stopwatch, device_timings
from nanospec_fx.testing import count_launches

OPS = torch.ops.nanospec
TOPK = 10
STATIC_ROWS = 32768
NEW_PER_STEP = 16  # token ids observed per draft step (drafted + accepted + target top-3)
FRESH_PER_STEP = 2  # of which never seen before (~30% of next tokens are not covered; a few per step)
STEPS = 4096  # distinct precomputed steps (more than any timing loop runs)
# |compact - dense| allowed at this shape: both round the same fp32 sum to the dtype (+ order).
LOGIT_TOL = {"bfloat16": 0.06, "float16": 0.01, "float32": 1e-3}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--small", action="store_true", help="tiny shapes (smoke test of the script)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--active", type=int, default=3000)
    p.add_argument("--capacity", type=int, default=3072)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 10])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before each timing")
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="device memory bandwidth, bytes/s")
    p.add_argument("--sweep", action="store_true", help="also time every head-kernel configuration (HEAD_CONFIGS)")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failed check (exit 1)")
    p.add_argument("--corrupt", action="store_true",
                   help="add 1.0 to one compact logit before the check (proves the check fails the run)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    if args.small:
        args.hidden, args.vocab, args.active, args.capacity, args.iters = 64, 1000, 300, 320, 5
    return args


# --------------------------------------------------------------------------- timing and setup
class Timer:
    """Median microseconds of a callable (:func:`~nanospec_fx.eval.bench.timing.device_timings`: on CUDA, events
    with the L2 cache flushed before each call)."""

    def __init__(self, device: str, iters: int, warmup: int = 3):
        self.device, self.iters, self.warmup = device, iters, warmup

    def __call__(self, fn, before=None) -> float:
        return 1e6 * statistics.median(device_timings(fn, self.iters, self.warmup, before, self.device))


def new_state(weight, capacity):
    return op_state(weight, capacity)


def step_token_table(seed_ids: torch.Tensor, vocab: int, steps: int, gen) -> torch.Tensor:
    """[steps, NEW_PER_STEP] ids: FRESH_PER_STEP never-seen ids (distinct over all steps), the rest
    drawn from the seeded (active) ids; one device table, copied row by row (no host sync)."""
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[seed_ids.cpu()] = True
    pool = torch.nonzero(~seen).flatten()
    pool = pool[torch.randperm(pool.numel(), generator=gen)]
    fresh = pool[: steps * FRESH_PER_STEP].view(steps, FRESH_PER_STEP) if pool.numel() >= steps * FRESH_PER_STEP \
        else pool[torch.randint(0, pool.numel(), (steps, FRESH_PER_STEP), generator=gen)]
    old = seed_ids.cpu()[torch.randint(0, seed_ids.numel(), (steps, NEW_PER_STEP - FRESH_PER_STEP), generator=gen)]
    return torch.cat([old, fresh], 1)[:, torch.randperm(NEW_PER_STEP, generator=gen)].to(seed_ids.device)


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu --small for a smoke run", file=sys.stderr)
        return 2
    if dev == "cuda":
        os.environ.setdefault("NANOSPEC_KERNELS", "triton")
    dtype = getattr(torch, args.dtype)
    elt = torch.finfo(dtype).bits // 8
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    V, H = args.vocab, args.hidden
    W = (torch.randn(V, H, generator=gen) * H**-0.5).to(device=dev, dtype=dtype)
    timer = Timer(dev, args.iters, args.warmup)
    results: dict = {
        "device": torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "kernels": os.environ.get("NANOSPEC_KERNELS", "auto"),
        "shape": dict(hidden=H, vocab=V, active=args.active, capacity=args.capacity, dtype=args.dtype, topk=TOPK),
        "bandwidth_Bps": args.bandwidth,
        "rows": {},
        "checks": {},
    }
    try:
        import triton

        results["triton"] = triton.__version__
        results["triton_op_registration"] = triton_op_registration()
    except ImportError:
        results["triton"] = None

    # State: seed with `active` ids (like a prompt), then each step observes NEW_PER_STEP ids.
    state = new_state(W, args.capacity)
    ids, _, cursor, cache_w, cache_b = state
    seed_ids = torch.randperm(V, generator=gen)[: args.active].to(dev)
    OPS.observe(seed_ids, W, None, *state, 0)
    table = step_token_table(seed_ids, V, STEPS, gen)
    tok_buf = table[0].clone()
    turn = [0]
    steps_run = [0]

    def next_tokens():
        turn[0] = (turn[0] + 1) % STEPS
        tok_buf.copy_(table[turn[0]])

    static_idx = torch.randperm(V, generator=gen)[:STATIC_ROWS].to(dev)
    W32 = W[static_idx].contiguous()  # gathered once, as FR-Spec does at load time

    bytes_row = H * elt
    floors = {
        "dense": V * bytes_row / args.bandwidth * 1e6,
        "static32k": STATIC_ROWS * bytes_row / args.bandwidth * 1e6,
        "nanospec": min(args.active, args.capacity) * bytes_row / args.bandwidth * 1e6,
    }
    results["floor_us"] = floors
    results["fresh_ids_per_step"] = FRESH_PER_STEP

    def check(name: str, ok: bool, detail: str = "") -> None:
        results["checks"][name] = "pass" if ok else f"FAIL {detail}".strip()
        write(results, args)
        if not ok and args.fail_fast:
            print(f"FAILED check {name}: {detail}", file=sys.stderr)
            raise SystemExit(1)

    # Observe alone against the reference: duplicates, out-of-range ids, pinned slots, a small
    # ring that overflows and the full capacity; eager (and replayed from a CUDA graph).
    check("observe_stress", *observe_stress(W, args.capacity, dev, gen))
    write(results, args)

    # First what a timeout must not lose: the head configurations (at the largest row count)
    # and observe alone with 0, 2 and 16 new ids per call; then the variants per row count.
    if args.sweep:
        x = torch.randn(max(args.rows), H, generator=gen).to(device=dev, dtype=dtype)
        results["head_sweep_us"] = sweep_head_configs(timer, x, W, cache_w, cursor, ids, check, args)
        write(results, args)
    if dev == "cuda":
        results["observe_us"] = observe_timing(W, args.capacity, dev, gen, timer)
        write(results, args)

    for rows in args.rows:
        x = torch.randn(rows, H, generator=gen).to(device=dev, dtype=dtype)

        def dense_head():
            return F.linear(x, W)

        def dense_head_topk():
            return torch.topk(F.linear(x, W), TOPK)

        def static_head():
            return F.linear(x, W32)

        def static_head_topk():
            v, i = torch.topk(F.linear(x, W32), TOPK)
            return v, static_idx[i]

        def ns_head():
            return OPS.compact_logits(x, cache_w, None, cursor)

        def ns_head_scatter():
            return OPS.scatter_logits(OPS.compact_logits(x, cache_w, None, cursor), ids, cursor, V)

        def ns_head_fused():
            return OPS.head_logits(x, cache_w, None, ids, cursor, V)

        def ns_head_topk():
            return OPS.compact_topk(OPS.compact_logits(x, cache_w, None, cursor), ids, cursor, TOPK)

        def ns_step():
            OPS.observe(tok_buf, W, None, *state, 0)
            return OPS.compact_topk(OPS.compact_logits(x, cache_w, None, cursor), ids, cursor, TOPK)

        def step_prep():
            next_tokens()
            steps_run[0] += 1

        r: dict = {"eager_us": {}, "graph_us": {}}
        results["rows"][str(rows)] = r
        variants = {
            "dense_head": dense_head, "dense_head_topk": dense_head_topk,
            "static32k_head": static_head, "static32k_head_topk": static_head_topk,
            "nanospec_head": ns_head, "nanospec_head_scatter": ns_head_scatter, "nanospec_head_fused": ns_head_fused,
            "nanospec_head_topk": ns_head_topk, "nanospec_step": ns_step,
        }
        # Correctness at this shape first: compact logits vs the dense head on the active ids; the
        # top-k equals the reference's on the same compact logits (same tie rule, exact).
        check_head(r, check, f"rows{rows}", ns_head, dense_head, ns_head_topk, ids, cursor, args)
        cursor0, steps0 = int(cursor), steps_run[0]
        for name, fn in variants.items():
            r["eager_us"][name] = timer(fn, before=step_prep if name == "nanospec_step" else None)
        write(results, args)
        if dev == "cuda":
            with kernels("reference"):
                r["eager_us"]["reference_head_topk"] = timer(ns_head_topk)
            for name in ("dense_head_topk", "static32k_head_topk", "nanospec_head", "nanospec_head_topk",
                         "nanospec_step"):
                replay = graphed(variants[name], dev)
                r["graph_us"][name] = timer(replay, before=step_prep if name == "nanospec_step" else None)
            write(results, args)
            # The same step through inductor (read-only ops inlined as triton_op kernels): a
            # regression here (e.g. a copy of the cache per call) shows as a gap to the eager step.
            try:
                with Stopwatch() as watch:
                    compiled = torch.compile(ns_step, fullgraph=True)
                    step_prep()
                    compiled()
                r["compile_s"] = round(watch.seconds, 1)
                r["eager_us"]["nanospec_step_compiled"] = timer(compiled, before=step_prep)
            except Exception as exc:  # noqa: BLE001 - recorded, and a failed check
                r["compiled_error"] = f"{type(exc).__name__}: {exc}"[:300]
            check(f"compiled_step_rows{rows}", "compiled_error" not in r, r.get("compiled_error", ""))
        # The draft steps inserted tokens: the cursor moved (and by at least the fresh ids).
        steps = steps_run[0] - steps0
        r["insertions_per_step"] = (int(cursor) - cursor0) / max(steps, 1)
        check(f"cursor_moved_rows{rows}", r["insertions_per_step"] >= FRESH_PER_STEP,
              f"{r['insertions_per_step']:.2f} insertions per step, expected >= {FRESH_PER_STEP}")


    # A whole EAGLE draft step (body + head + top-k, nanospec's with its observe), eager and in a graph, with launch
    # counts: what a drafter pays per step around the head.
    try:
        results["eagle_step"] = eagle_step(args, W, W32, static_idx, state, tok_buf, step_prep, timer, gen)
    except Exception as exc:  # noqa: BLE001 - recorded, a failed check
        results["eagle_step"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    check("eagle_step_ran", "error" not in results["eagle_step"], results["eagle_step"].get("error", ""))
    write(results, args)

    # Zero host syncs per draft step (observe included), and CUDA-graph observe vs the reference.
    if dev == "cuda":
        try:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            for t in table[:4]:
                OPS.observe(t, W, None, *state, 0)
                OPS.compact_topk(OPS.compact_logits(x, cache_w, None, cursor), ids, cursor, TOPK)
            check("sync_free_step", True)
        except Exception as exc:  # noqa: BLE001 - recorded, a failed check
            check("sync_free_step", False, str(exc)[:300])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref_state = [t.clone() for t in state]
        replay = graphed(lambda: OPS.observe(tok_buf, W, None, *state, 0), dev)
        reference_observe(tok_buf, W, None, *ref_state, 0)
        reference_observe(tok_buf, W, None, *ref_state, 0)  # graphed() ran it 3 times: idempotent
        ok = all(torch.equal(a, b) for a, b in zip(state, ref_state))
        c0 = int(cursor)
        for _ in range(args.capacity // FRESH_PER_STEP + 8):  # around the ring at least once
            next_tokens()
            replay()
            reference_observe(tok_buf, W, None, *ref_state, 0)
        ok = ok and all(torch.equal(a, b) for a, b in zip(state, ref_state))
        check("graph_observe_equals_reference", ok and int(cursor) - c0 >= args.capacity - args.active)

    print(write(results, args))
    failed = {k: v for k, v in results["checks"].items() if not str(v).startswith("pass")}
    if failed:
        print(f"FAILED checks: {failed}", file=sys.stderr)
    return 1 if failed else 0


class EagleBody(torch.nn.Module):
    """An EAGLE drafter's body at the target's width, random weights: ``fc`` over [embedding, feature] (2H -> H),
    then one Llama-3-8B decoder block (RMSNorm, GQA attention with 32 query / 8 KV heads over a fixed KV cache of
    ``context`` positions plus the new rows, SwiGLU MLP of width ``mlp``). Only the time and the bytes matter."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, mlp: int, context: int, dtype, device, gen):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads

        def w(o, i):
            return torch.nn.Parameter((torch.randn(o, i, generator=gen) * i**-0.5).to(device=device, dtype=dtype),
                                      requires_grad=False)
        self.fc, self.q, self.o = w(hidden, 2 * hidden), w(hidden, hidden), w(hidden, hidden)
        self.k, self.v = w(kv_heads * self.head_dim, hidden), w(kv_heads * self.head_dim, hidden)
        self.gate, self.up, self.down = w(mlp, hidden), w(mlp, hidden), w(hidden, mlp)
        cache = torch.randn(2, 1, heads, context, self.head_dim, generator=gen).to(device=device, dtype=dtype)
        self.register_buffer("kv_cache", cache)

    def forward(self, emb: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        rows = emb.shape[0]
        h = F.linear(torch.cat([emb, feature], -1), self.fc)
        a = F.rms_norm(h, (h.shape[-1],))
        q = F.linear(a, self.q).view(1, rows, self.heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k = F.linear(a, self.k).view(1, rows, self.kv_heads, self.head_dim).transpose(1, 2).repeat_interleave(rep, 1)
        v = F.linear(a, self.v).view(1, rows, self.kv_heads, self.head_dim).transpose(1, 2).repeat_interleave(rep, 1)
        k = torch.cat([self.kv_cache[0], k], 2)
        v = torch.cat([self.kv_cache[1], v], 2)
        att = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(rows, -1)
        h = h + F.linear(att, self.o)
        m = F.rms_norm(h, (h.shape[-1],))
        return h + F.linear(F.silu(F.linear(m, self.gate)) * F.linear(m, self.up), self.down)


def eagle_step(args, W, W32, static_idx, state, tok_buf, step_prep, timer, gen) -> dict:
    """One EAGLE draft step at the benchmark's shape (Llama-3-8B: H = 4096, 32 / 8 heads, MLP 14,336; --small:
    tiny) for 1 row: the body, then dense head + top-k, the static 32k head + top-k, or nanospec's observe of the
    step's ids + compact head + compact top-k. Median us eager and replayed from a CUDA graph (CUDA only), and the
    launches each step dispatches eagerly (:func:`nanospec_fx.testing.count_launches`: Triton launches + torch
    compute ops), body and head part apart."""
    dev, dtype = W.device.type, W.dtype
    V, H = W.shape
    small = args.small
    body = EagleBody(H, 4 if small else 32, 2 if small else 8, 4 * H if small else 14336, 16 if small else 64,
                     dtype, dev, gen)
    ids, _, cursor, cache_w, _ = state
    emb_ids = torch.randint(0, V, (1,), generator=gen).to(dev)
    feature = torch.randn(1, H, generator=gen).to(device=dev, dtype=dtype)

    def body_only():
        return body(W[emb_ids], feature)  # the embedding tied to the head (one [V, H] table in memory)

    def dense():
        return torch.topk(F.linear(body_only(), W), TOPK)

    def static32k():
        v, i = torch.topk(F.linear(body_only(), W32), TOPK)
        return v, static_idx[i]

    def nanospec():
        h = body_only()
        OPS.observe(tok_buf, W, None, *state, 0)
        return OPS.compact_topk(OPS.compact_logits(h, cache_w, None, cursor), ids, cursor, TOPK)

    def nanospec_head_part():  # what nanospec adds after the body: observe + compact head + top-k
        OPS.observe(tok_buf, W, None, *state, 0)
        return OPS.compact_topk(OPS.compact_logits(feature, cache_w, None, cursor), ids, cursor, TOPK)

    variants = {"body": body_only, "dense": dense, "static32k": static32k, "nanospec": nanospec}
    out: dict = {"rows": 1, "eager_us": {}, "graph_us": {}, "launches": {}}
    with torch.no_grad():
        for name, fn in variants.items():
            out["eager_us"][name] = timer(fn, before=step_prep if name == "nanospec" else None)
        for name, fn in {**variants, "nanospec_head_part": nanospec_head_part}.items():
            fn()  # compiled and warm: count the steady state
            with count_launches() as seen:
                fn()
            out["launches"][name] = {"triton": len(seen.triton), "torch_ops": len(seen.torch_ops),
                                     "total": seen.launches}
        if dev == "cuda":
            for name, fn in variants.items():
                replay = graphed(fn, dev)
                out["graph_us"][name] = timer(replay, before=step_prep if name == "nanospec" else None)
    return out


def check_head(r, check, tag, ns_head, dense_head, ns_head_topk, ids, cursor, args) -> None:
    """Compact logits match the dense head on the active ids; the top-k is the reference's."""
    compact = ns_head()
    if args.corrupt:
        compact = compact.clone()
        compact[..., 0] += 1.0
    n = int(torch.clamp(cursor, max=ids.numel()))
    dense = dense_head().float()
    err = (compact[:, :n].float() - dense[:, ids[:n]]).abs().max().item()
    vals, toks = ns_head_topk()
    with kernels("reference"):
        ref_vals, ref_toks = OPS.compact_topk(compact, ids, cursor, TOPK)
    r["max_abs_err_vs_dense"] = err
    tol = LOGIT_TOL[args.dtype]
    check(f"logits_match_dense_{tag}", err <= tol, f"max |compact - dense| = {err:.3g} > {tol}")
    same = torch.equal(toks, ref_toks) and torch.equal(vals, ref_vals)
    check(f"topk_equals_reference_{tag}", same, "the kernel top-k differs from the reference on the same logits")


def reference_observe(tok, W, bias, ids, slot_of, cursor, cache_w, cache_b, pinned) -> None:
    """What the observe op does, in plain torch (its reference implementation)."""
    with kernels("reference"):
        OPS.observe(tok, W, bias, ids, slot_of, cursor, cache_w, cache_b, pinned)


def observe_stress(W, capacity: int, dev: str, gen) -> tuple[bool, str]:
    """Triton observe vs the reference on random call sequences; returns (ok, first difference)."""
    V = W.shape[0]
    calls = 24 if dev == "cuda" else 4  # the interpreter is slow
    for cap in sorted({64, capacity}) if dev == "cuda" else [64]:
        for pinned in (0, 5):
            a, b = new_state(W, cap), new_state(W, cap)
            for call in range(calls):
                n = int(torch.randint(1, 3 * cap if call % 6 == 3 else 40, (1,), generator=gen))  # some overflow
                tok = torch.randint(-3, V + 3, (n,), generator=gen)
                tok[torch.rand(n, generator=gen) < 0.3] = tok[0]  # heavy duplicates
                tok = tok.to(dev)
                OPS.observe(tok, W, None, *a, pinned)
                reference_observe(tok, W, None, *b, pinned)
                for name, x, y in zip(state_names(), a, b):
                    if not torch.equal(x, y):
                        return False, f"capacity {cap}, pinned {pinned}, call {call}: {name} differs"
    return True, ""


def observe_timing(W, capacity: int, dev: str, gen, timer) -> dict:
    """Median us of one observe of 16 ids of which 0, 2 or 16 are new (eager and CUDA graph)."""
    V = W.shape[0]
    out = {}
    for fresh in (0, 2, 16):
        state = new_state(W, capacity)
        active = torch.randperm(V, generator=gen)[:capacity].to(dev)
        OPS.observe(active, W, None, *state, 0)
        pool = torch.randperm(V, generator=gen).to(dev)
        pool = pool[state[1][pool] < 0]  # never active
        steps = 256
        calls = torch.cat([active[torch.randint(0, capacity, (steps, 16 - fresh), generator=gen).to(dev)],
                           pool[: steps * fresh].view(steps, fresh)], 1)
        buf = calls[0].clone()
        turn = [0]

        def prep():
            turn[0] = (turn[0] + 1) % steps
            buf.copy_(calls[turn[0]])

        out[f"new{fresh}_eager"] = timer(lambda: OPS.observe(buf, W, None, *state, 0), before=prep)
        replay = graphed(lambda: OPS.observe(buf, W, None, *state, 0), dev)
        out[f"new{fresh}_graph"] = timer(replay, before=prep)
    return out


def sweep_head_configs(timer, x, W, cache_w, cursor, ids, check, args) -> dict:
    """Time (and check) compact_logits under every HEAD_CONFIGS entry, with its GB/s."""
    n = int(torch.clamp(cursor, max=cache_w.shape[0]))
    nbytes = n * cache_w.shape[1] * cache_w.element_size()
    out = {}
    for name, config in head_configs().items():
        try:
            with head_config(name):
                us = timer(lambda: OPS.compact_logits(x, cache_w, None, cursor))
                out[name] = {"us": us, "GBps": nbytes / us / 1e3, **config}
                got = OPS.compact_logits(x, cache_w, None, cursor)[:, :n].float()
            err = (got - F.linear(x, W).float()[:, ids[:n]]).abs().max().item()
            check(f"head_config_{name}", err <= LOGIT_TOL[args.dtype], f"max err {err:.3g}")
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is a failed check
            out[name] = f"error: {type(exc).__name__}: {exc}"[:200]
            check(f"head_config_{name}", False, out[name])
    return out


def write(results: dict, args) -> None:
    """Markdown summary + JSON of everything so far (called after every step)."""
    lines = [f"# nanospec GPU benchmark ({results['device']}, torch {results['torch']}, "
             f"triton {results.get('triton')})", ""]
    s = results["shape"]
    lines.append(f"H={s['hidden']} V={s['vocab']} active={s['active']} capacity={s['capacity']} {s['dtype']} "
                 f"top-{s['topk']}")
    fl = results.get("floor_us")
    if fl:
        lines.append(f"bandwidth floors (us): dense {fl['dense']:.1f}, static32k {fl['static32k']:.1f}, "
                     f"nanospec {fl['nanospec']:.2f}")
    for rows, r in results["rows"].items():
        lines += ["", f"## rows={rows}", "", "| variant | eager us | graph us |", "|---|---|---|"]
        for name, us in r["eager_us"].items():
            g = r["graph_us"].get(name)
            lines.append(f"| {name} | {us:.1f} | {'' if g is None else f'{g:.1f}'} |")
        if "max_abs_err_vs_dense" in r:
            lines += ["", f"max |compact - dense| = {r['max_abs_err_vs_dense']:.3g}; "
                      f"insertions per draft step: {r.get('insertions_per_step', float('nan')):.2f}"]
        if "compile_s" in r or "compiled_error" in r:
            lines.append(f"torch.compile of the step: {r.get('compile_s', '-')} s {r.get('compiled_error', '')}")
    step = results.get("eagle_step")
    if step and "error" not in step:
        lines += ["", "## EAGLE draft step (body + head + top-k; nanospec: + observe), 1 row", "",
                  "| variant | eager us | graph us | launches (triton + torch ops) |", "|---|---|---|---|"]
        for name, n in step["launches"].items():
            e, g = step["eager_us"].get(name), step["graph_us"].get(name)
            lines.append(f"| {name} | {'' if e is None else f'{e:.1f}'} | {'' if g is None else f'{g:.1f}'} | "
                         f"{n['total']} ({n['triton']} + {n['torch_ops']}) |")
    elif step:
        lines += ["", f"EAGLE draft step: {step['error']}"]
    if results.get("observe_us"):
        lines += ["", "observe of 16 ids (us): " + ", ".join(f"{k}={v:.1f}" for k, v in results["observe_us"].items())]
    if "head_sweep_us" in results:
        lines += ["", "| head config | us | GB/s |", "|---|---|---|"]
        for k, v in results["head_sweep_us"].items():
            lines.append(f"| {k} | {v['us']:.1f} | {v['GBps']:.0f} |" if isinstance(v, dict) else f"| {k} | {v} | |")
    if results["checks"]:
        lines += ["", "checks: " + ", ".join(f"{k}={v}" for k, v in results["checks"].items())]
    text = "\n".join(lines) + "\n"
    tag = "small" if args.small else "full"
    targets = [Path(args.out)]
    if os.environ.get("OUT"):
        targets.append(Path(os.environ["OUT"]))
    for d in targets:
        d.mkdir(parents=True, exist_ok=True)
        (d / f"gpu_bench_{args.device}_{tag}.json").write_text(json.dumps(results, indent=1))
        (d / f"gpu_bench_{args.device}_{tag}.md").write_text(text)
    return text


if __name__ == "__main__":
    try:
        code = main()
    except Exception:  # noqa: BLE001 - leave a trace in the results for the next run
        traceback.print_exc()
        code = 1
    sys.exit(code)
