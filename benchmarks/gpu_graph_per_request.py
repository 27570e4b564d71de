"""A per-request draft step captured in a CUDA graph, replayed with new request rows, new observed ids and new
hidden states, against eager and against a plain-torch oracle (a Python set per request).

What a serving engine whose draft loop runs in a captured graph (vLLM's model runner V2) needs of
:class:`nanospec_fx.RequestVocabs`, and of the V2 head built on it (``CompactLMHead`` reading its rows from the engine's
slot buffer through ``SlotRows``): observe and the head read no device value on the host, keep their tensors'
addresses, and give on replay exactly what eager gives. Shapes cover one row per request and parallel drafters'
``B*K`` rows per step (K positions per request), odd sizes included.

    python benchmarks/gpu_graph_per_request.py                       # CUDA: capture + replay + oracle
    TRITON_INTERPRET=1 NANOSPEC_KERNELS=triton python benchmarks/gpu_graph_per_request.py --device cpu
                                                                     # rehearsal: eager Triton vs the oracle
Exit status 0 when every check passes; each check prints one line.
"""
from __future__ import annotations

import argparse
import sys

import torch

from nanospec_fx import RequestVocabs
from nanospec_fx.eval.bench.graphs import graphed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--vocab", type=int, default=5003)
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--shapes", default="1x1,3x1,4x7,8x16",
                   help="REQUESTSxK,... (K rows per request per step: 1, or a parallel drafter's positions)")
    return p.parse_args(argv)


def oracle(W: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, sets: list[set]) -> torch.Tensor:
    """Dense logits of each row, -inf outside its request's set (computed in fp32 from the weight)."""
    dense = x.float() @ W.float().T
    out = torch.full_like(dense, float("-inf"))
    for b, r in enumerate(rows.tolist()):
        ids = torch.tensor(sorted(sets[r]), dtype=torch.int64, device=W.device)
        if ids.numel():
            out[b, ids] = dense[b, ids]
    return out


def against_oracle(logits: torch.Tensor, want: torch.Tensor, tol: float) -> tuple[bool, float, float]:
    """(same -inf pattern and finite entries within ``tol`` relative to the row scale, the largest error, that scale)."""
    finite = torch.isfinite(want)
    same_mask = bool((torch.isfinite(logits.float()) == finite).all())
    err = float((logits.float()[finite] - want[finite]).abs().max()) if finite.any() else 0.0
    scale = tol * max(1.0, float(want[finite].abs().max()) if finite.any() else 1.0)
    return same_mask and err <= scale, err, scale


def scenario(dev: str, dtype: torch.dtype, requests: int, k: int, args, check) -> None:
    """``requests`` requests, ``k`` rows each per step (the rows shuffled), capacity that never evicts."""
    gen = torch.Generator().manual_seed(requests * 100 + k)
    V, H, steps, per_row = args.vocab, args.hidden, args.steps, 5
    capacity = per_row * k * (steps + 1) + 8  # every observed id fits: the oracle is the union of the ids
    W = (torch.randn(V, H, generator=gen) / H**0.5).to(dev, dtype)
    rv = RequestVocabs(W, None, max_requests=requests + 1, capacity=capacity)
    for q in range(requests):
        rv.assign(f"req{q}")
    n = requests * k
    x_buf = torch.zeros(n, H, device=dev, dtype=dtype)
    rows_buf = torch.zeros(n, dtype=torch.int64, device=dev)
    tok_buf = torch.full((n, per_row), -1, dtype=torch.int64, device=dev)

    def step():
        rv.observe_rows(rows_buf, tok_buf)
        return rv.logits(x_buf, rows_buf), rv.argmax(x_buf, rows_buf)

    def new_inputs(i: int):
        rows = torch.arange(requests).repeat_interleave(k)[torch.randperm(n, generator=gen)]
        toks = torch.randint(0, V, (n, per_row), generator=gen)
        toks[torch.rand(n, per_row, generator=gen) < 0.2] = -1  # padding
        x = torch.randn(n, H, generator=gen)
        return rows, toks, x

    replay = None
    if dev == "cuda":
        rows, toks, x = new_inputs(-1)
        rows_buf.copy_(rows)
        tok_buf.copy_(toks)
        x_buf.copy_(x)
        outs: list = []
        replay_graph = graphed(lambda: outs.append(step()), dev)  # the last call is the captured one
        static_out = outs[-1]
        # Back to empty sets, in place (the graph keeps these addresses): warm-up and capture observed ids.
        rv.ids.fill_(-1)
        rv.slot_of.fill_(-1)
        rv.cursor.zero_()

        def replay():
            replay_graph()
            return static_out

    eager = RequestVocabs(W, None, max_requests=requests + 1, capacity=capacity)
    for q in range(requests):
        eager.assign(f"req{q}")
    sets: list[set] = [set() for _ in range(requests + 1)]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    tag = f"{dev} {str(dtype).split('.')[-1]} requests={requests} k={k} rows={n}"
    ok_all, worst = True, 0.0
    for i in range(steps):
        rows, toks, x = new_inputs(i)
        for b, r in enumerate(rows.tolist()):
            sets[r].update(t for t in toks[b].tolist() if t >= 0)
        rows, toks, x = rows.to(dev), toks.to(dev), x.to(dev, dtype)
        eager.observe_rows(rows, toks)
        e_logits, e_arg = eager.logits(x, rows), eager.argmax(x, rows)
        want = oracle(W, x, rows, sets)
        ok, err, scale = against_oracle(e_logits, want, tol)
        # argmax: the oracle's value at the chosen id is the row's maximum (within the dtype's tolerance)
        picked = want.gather(1, e_arg[:, None]).squeeze(1)
        ok = ok and bool((picked >= want.max(-1).values - scale).all())
        if replay is not None:
            rows_buf.copy_(rows)
            tok_buf.copy_(toks)
            x_buf.copy_(x)
            g_logits, g_arg = replay()
            same_state = all(torch.equal(a, b) for a, b in zip(rv.tensors()[:3], eager.tensors()[:3]))
            ok = ok and torch.equal(g_logits, e_logits) and torch.equal(g_arg, e_arg) and same_state
        ok_all &= ok
        worst = max(worst, err)
    check(tag, ok_all, f"max |eager - oracle| {worst:.2e}" + (", replay == eager" if replay and ok_all else ""))


def v2_head_scenario(dev: str, dtype: torch.dtype, slots_n: int, k: int, args, check) -> None:
    """The vLLM Model Runner V2 head (``CompactLMHead`` in the drafter's ``lm_head`` slot, rows read through
    ``SlotRows`` from the engine's slot buffer at call time), as V2 would run it: observe the step's tokens by slot,
    then ``LogitsProcessor``'s ``lm_head.quant_method.apply(lm_head, hidden)``, captured once and replayed with new
    slot buffers (shuffled, a padded -1 slot some steps), new tokens and new hidden states."""
    from nanospec_fx.integrations.vllm.head import CompactLMHead, SlotRows

    gen = torch.Generator().manual_seed(slots_n * 1000 + k)
    V, H, steps, per_row = args.vocab, args.hidden, args.steps, 5
    capacity = per_row * k * (steps + 1) + 8
    W = (torch.randn(V, H, generator=gen) / H**0.5).to(dev, dtype)
    source = torch.nn.Linear(H, V, bias=False, device=dev, dtype=dtype)
    with torch.no_grad():
        source.weight.copy_(W)

    def build():
        rv = RequestVocabs(W, None, max_requests=slots_n + 1, capacity=capacity)
        slot_rows = SlotRows(rv, num_slots=slots_n)
        for s in range(slots_n):
            slot_rows.add(s, f"req{s}")
        slots = torch.zeros(slots_n, dtype=torch.int32, device=dev)  # V2's idx_mapping: a device buffer
        return rv, slot_rows, slots, CompactLMHead(source, rv, slot_rows, slots, positions_per_request=k)

    n = slots_n * k
    x_buf = torch.zeros(n, H, device=dev, dtype=dtype)
    tok_buf = torch.full((n, per_row), -1, dtype=torch.int64, device=dev)
    graph_state = build()

    def step(state):
        _, slot_rows, slots, head = state
        slot_rows.observe(slots.long().repeat_interleave(k), tok_buf)
        return head.quant_method.apply(head, x_buf)

    def new_slots(i: int) -> torch.Tensor:
        slots = torch.randperm(slots_n, generator=gen)
        if i % 2 and slots_n > 1:
            slots[-1] = -1  # a padded batch row: reads the empty row, observes nothing
        return slots.to(torch.int32)

    replay = None
    if dev == "cuda":
        graph_state[2].copy_(new_slots(0))
        tok_buf.copy_(torch.randint(0, V, (n, per_row), generator=gen))
        x_buf.copy_(torch.randn(n, H, generator=gen))
        outs: list = []
        replay_graph = graphed(lambda: outs.append(step(graph_state)), dev)
        static_out = outs[-1]
        rv = graph_state[0]
        rv.ids.fill_(-1)  # back to empty sets, in place (the graph keeps these addresses)
        rv.slot_of.fill_(-1)
        rv.cursor.zero_()

        def replay():
            replay_graph()
            return static_out

    eager = build()
    sets: list[set] = [set() for _ in range(slots_n + 1)]  # the last one, empty, is what a padded slot (-1) reads
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    tag = f"V2 head {dev} {str(dtype).split('.')[-1]} slots={slots_n} k={k} rows={n}"
    ok_all, worst = True, 0.0
    for i in range(steps):
        slots = new_slots(i)
        toks = torch.randint(0, V, (n, per_row), generator=gen)
        toks[torch.rand(n, per_row, generator=gen) < 0.2] = -1
        x = torch.randn(n, H, generator=gen)
        per_row_slot = slots.long().repeat_interleave(k)
        for b, s in enumerate(per_row_slot.tolist()):
            if s >= 0:
                sets[s].update(t for t in toks[b].tolist() if t >= 0)
        eager[2].copy_(slots)
        tok_buf.copy_(toks)
        x_buf.copy_(x.to(dev, dtype))
        e_logits = step(eager).clone()
        want = oracle(W, x_buf, per_row_slot, sets)
        ok, err, _ = against_oracle(e_logits, want, tol)
        if replay is not None:
            graph_state[2].copy_(slots)
            g_logits = replay()
            same_state = all(torch.equal(a, b) for a, b in zip(graph_state[0].tensors()[:3], eager[0].tensors()[:3]))
            ok = ok and torch.equal(g_logits, e_logits) and same_state
        ok_all &= ok
        worst = max(worst, err)
    ok_all &= eager[3].dense_calls == 0
    check(tag, ok_all, f"max |eager - oracle| {worst:.2e}" + (", replay == eager" if replay and ok_all else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    failures = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        print(f"{'PASS' if ok else 'FAIL'} per-request step {name}: {detail}")
        if not ok:
            failures.append(name)

    dtypes = (torch.float32, torch.bfloat16) if dev == "cuda" else (torch.float32,)
    for dtype in dtypes:
        for shape in args.shapes.split(","):
            requests, k = (int(v) for v in shape.split("x"))
            scenario(dev, dtype, requests, k, args, check)
            v2_head_scenario(dev, dtype, requests, k, args, check)
    print(f"{'PASS' if not failures else 'FAIL'}: {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
