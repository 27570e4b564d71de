"""vLLM with tensor_parallel_size=2 on CPU, the tiny random pair of the tests: the target alone vs vLLM's
``draft_model`` with its full head vs with NanoSpec (the replicated per-request cache, no logits collective).

    python benchmarks/vllm_tp_tiny.py [--tokens 64] [--spec 3] [--tp 2]

The pair is tests/integrations/vllm_checkpoints.py's (V=1024, H=64, a 3-layer target, a 1-layer draft model):
it checks the path and gives an order of magnitude, not a real-model speed-up. Each variant runs in its own
process (the plugin is process-wide), vLLM's engine in process, its ``--tp`` workers forked by the ``mp`` executor
(one core each: ``VLLM_CPU_OMP_THREADS_BIND``). Draft time: ``GPUModelRunner.propose_draft_token_ids`` (with the
plugin's observes: its hooks are installed when a worker starts, the timer after, through ``collective_rpc``) is
timed in each worker, mean over ranks. 3 concurrent requests (the tests' prompts), greedy; tokens/s over the whole batch.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("target", "full", "nanospec")


def time_drafts(worker) -> None:
    """In each worker (vLLM spawns them on CPU): time the draft step, the plugin's observes included."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from nanospec_fx.eval.bench.timing import Stopwatch

    propose, watch, spent = GPUModelRunner.propose_draft_token_ids, Stopwatch(), {"seconds": 0.0, "calls": 0}

    def timed(self, *args, **kwargs):
        spent["calls"] += 1
        try:
            with watch:
                return propose(self, *args, **kwargs)
        finally:
            spent["seconds"] = watch.seconds

    GPUModelRunner.propose_draft_token_ids = timed
    GPUModelRunner.nanospec_bench_draft_time = spent


def draft_time(worker) -> dict:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return dict(GPUModelRunner.nanospec_bench_draft_time)


def run_variant(variant: str, root: Path, tokens: int, spec_tokens: int, tp: int) -> dict:
    sys.path.insert(0, str(ROOT / "tests/integrations"))
    from vllm_worker import PROMPTS

    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
                      VLLM_CPU_OMP_THREADS_BIND="|".join(str(i) for i in range(tp)))
    if variant == "nanospec":
        os.environ["NANOSPEC_VLLM"] = "1"
        os.environ.setdefault("NANOSPEC_VLLM_HEAD", "compact")  # a tiny head: the cost model would keep it dense
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from nanospec_fx.eval.bench.timing import Stopwatch

    spec = None if variant == "target" else {"method": "draft_model", "model": str(root / "draft_model"),
                                              "num_speculative_tokens": spec_tokens}
    llm = LLM(model=str(root / "target"), skip_tokenizer_init=True, speculative_config=spec, dtype="float32",
              enforce_eager=True, seed=0, tensor_parallel_size=tp, distributed_executor_backend="mp",
              disable_log_stats=False, max_model_len=256, max_num_seqs=4)
    llm.collective_rpc(time_drafts)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, detokenize=False), use_tqdm=False)
    before = llm.collective_rpc(draft_time)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    with Stopwatch() as whole:
        outs = llm.generate(prompts, params, use_tqdm=False)
    wall = whole.seconds
    after = llm.collective_rpc(draft_time)
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    llm.llm_engine.engine_core.shutdown()
    ids = [list(o.outputs[0].token_ids) for o in outs]
    steps = [(a["seconds"] - b["seconds"], a["calls"] - b["calls"]) for a, b in zip(after, before)]
    drafts, accepted = metrics.get("vllm:spec_decode_num_drafts") or 0, metrics.get(
        "vllm:spec_decode_num_accepted_tokens") or 0
    return {"tok_s": sum(map(len, ids)) / wall, "wall_s": wall, "outputs": ids,
            "tau": 1 + accepted / drafts if drafts else 1.0,
            "draft_ms_per_step": (1000 * sum(s for s, _ in steps) / sum(c for _, c in steps)) if spec else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--spec", type=int, default=3)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args.variant, args.root, args.tokens, args.spec, args.tp)))
        return
    sys.path.insert(0, str(ROOT / "tests/integrations"))
    import vllm_checkpoints

    root = Path(tempfile.mkdtemp(prefix="vllm-tp-tiny-"))
    vllm_checkpoints.build(root)
    results = {}
    for variant in VARIANTS:
        done = subprocess.run([sys.executable, __file__, "--variant", variant, "--root", str(root), "--tokens",
                               str(args.tokens), "--spec", str(args.spec), "--tp", str(args.tp)],
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if done.returncode or not line:
            sys.exit(f"{variant} failed:\n{done.stderr[-4000:]}")
        results[variant] = json.loads(line[0][7:])
    print(f"| variant (tp={args.tp}) | tau | tok/s | draft ms/step | outputs = target |")
    print("|---|---|---|---|---|")
    for variant, r in results.items():
        draft = "-" if r["draft_ms_per_step"] is None else f"{r['draft_ms_per_step']:.2f}"
        print(f"| {variant} | {r['tau']:.2f} | {r['tok_s']:.1f} | {draft} | "
              f"{r['outputs'] == results['target']['outputs']} |")


if __name__ == "__main__":
    main()
