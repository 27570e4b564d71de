"""Where an EAGLE round's draft time goes, per drafter head (Gemma-3-270M + the trained drafter).

`nanospec-fx e2e --drafter eagle` reports draft ms per round; this splits it with torch.profiler over
one request (chain drafts, the target's top-3 at verified positions): the active-set updates
(`nanospec::observe`: the drafter's fed ids and the target's top-3), the target's top-k over its
262k logits that feeds them (the target's work: the decode loop books it in verify, and so does this table),
and the rest (the drafter's fc + layer + head and its top-1). `e2e --compile-all` measures the same split in
the run itself, every variant compiled alike.

    python benchmarks/eagle_round_profile.py                 # ~2 min on 2 CPU cores; needs train-eagle's drafter
"""
from __future__ import annotations

import argparse

import torch
import torch._dynamo

from nanospec_fx import FrequencyTable
from nanospec_fx.eval import loaders
from nanospec_fx.eval import train_eagle as T
from nanospec_fx.eval.bench import eagle_e2e as B
from nanospec_fx.eval.bench.timing import PhaseTimer
from nanospec_fx.eval.train_eagle import eagle_dir
from nanospec_fx.eagle.speculative import HFTarget, eagle_generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="sharegpt[:1]")
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, tok = loaders.load_model("gemma3-270m"), loaders.load_tokenizer("gemma3-270m")
    ids = tok.encode(loaders.load_corpus(args.corpus)[0].prompt, bos=True)[-256:]
    drafter = T.load_drafter(target, eagle_dir("gemma3-270m"))
    vocab = target.get_output_embeddings().weight.shape[0]
    table = FrequencyTable.from_token_ids([ids], vocab)
    torch._dynamo.reset()
    drafters = B.drafter_variants(drafter, table.top(32768), 3072, table, which=("full", "static", "context"))
    runner = HFTarget(target)
    print(f"{args.corpus}, depth {args.depth}, {args.max_new} new tokens, {torch.get_num_threads()} threads; "
          "ms per round")
    print(f"{'variant':<24}{'rounds':>7}{'draft':>8}{'verify':>8}{'observe':>9}{'top-k':>7}{'rest':>7}")
    for name, d in drafters.items():
        B.reset_drafter(d)
        eagle_generate(runner, d, torch.tensor([ids]), 16, depth=args.depth, cache_len=512)  # compile, warm up
        B.reset_drafter(d)
        phases = PhaseTimer()
        with torch.profiler.profile() as prof:
            _, stats = eagle_generate(runner, d, torch.tensor([ids]), args.max_new, depth=args.depth, cache_len=512,
                                      timer=phases)
        events = {e.key: e for e in prof.key_averages()}
        n = stats.rounds

        def ms(key, events=events, n=n):
            e = events.get(key)
            return e.cpu_time_total / 1e3 / n if e else 0.0

        observe, topk = ms("nanospec::observe"), ms("aten::topk")
        draft = 1e3 * (phases.seconds("draft") + phases.seconds("observe")) / n
        print(f"{name:<24}{n:>7}{draft:>8.1f}{1e3 * phases.seconds('verify') / n:>8.1f}{observe:>9.1f}{topk:>7.1f}"
              f"{draft - observe:>7.1f}")
    print("(profiler on: every figure is somewhat above the unprofiled e2e run's; top-k: every aten::topk, the "
          "target's (in verify) and the prefill's included; rest = draft - observe)")


if __name__ == "__main__":
    main()
