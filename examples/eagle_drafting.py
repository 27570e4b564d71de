"""EAGLE speculative decoding with a nanospec drafter: lossless, and the head computes a few hundred rows.

With a trained drafter cached (``nanospec-fx train-eagle``, ~33 min on 2 idle CPU cores), this decodes a
few real requests with Gemma-3-270M (V = 262,144) and its trained EAGLE drafter on the target's KV
cache (nanospec_fx/eagle/speculative.py), once with the drafter's full head and once compiled with
nanospec; both outputs must equal the target's greedy output. The table shows tau (tokens per
round), speed and how many head rows each drafter computes.

Without one (or with ``--tiny``) it falls back to a tiny random Llama target whose drafter copies
the target's layer (a stand-in for training, so that drafts are often accepted); a random target
seldom repeats tokens, so the active set covers fewer next tokens there than on real text.

    nanospec-fx train-eagle                            # once: features + training, cached
    python examples/eagle_drafting.py                  # the trained drafter if cached, else the tiny fallback
    python examples/eagle_drafting.py --tiny           # ~20 s on 2 CPU cores
"""
from __future__ import annotations

import argparse
import time

import torch

import nanospec_fx
from nanospec_fx.eagle import EagleConfig, EagleDrafter
from nanospec_fx.eagle.speculative import HFTarget, eagle_generate, final_norm, greedy_generate, hf_target_forward

PROMPTS = [
    "User: Explain what a hash table is and when to use one.\nAssistant: ",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "User: Write a short note to a colleague asking to move our meeting to Friday.\nAssistant: ",
]


def trained(model: str):
    """Gemma-3-270M and its trained drafter, or None if either is not cached."""
    from nanospec_fx.eval import loaders
    from nanospec_fx.eval.train_eagle import eagle_dir
    from nanospec_fx.eval.train_eagle import WEIGHTS, load_drafter

    folder = eagle_dir(model)
    if not (folder / WEIGHTS).exists():
        return None
    target = loaders.load_model(model)
    tok = loaders.load_tokenizer(model)
    prompts = [torch.tensor([tok.encode(p, bos=True)]) for p in PROMPTS]
    return target, load_drafter(target, folder), prompts, folder


def tiny(vocab: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval().requires_grad_(False)
    drafter = EagleDrafter(EagleConfig.from_target(config), target.model.embed_tokens, target.lm_head,
                           final_norm(target))
    drafter.copy_target_layer(target.model.layers[0], 0.1).eval()
    g = torch.Generator().manual_seed(2)
    return target, drafter, [torch.randint(0, vocab, (1, 16), generator=g) for _ in range(2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m", help="target whose trained drafter to use, if cached")
    parser.add_argument("--tiny", action="store_true", help="use the tiny random fallback even if a drafter is cached")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 64 (trained), 24 (tiny)")
    parser.add_argument("--depth", type=int, default=None, help="drafts per round (default: 2 trained, 3 tiny)")
    parser.add_argument("--capacity", type=int, default=3072)
    parser.add_argument("--vocab", type=int, default=32000, help="tiny fallback: vocabulary")
    parser.add_argument("--hidden", type=int, default=64, help="tiny fallback: hidden size")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))

    found = None if args.tiny else trained(args.model)
    if found is not None:
        target, drafter, prompts, folder = found
        print(f"target {args.model}, trained EAGLE drafter from {folder}")
        new, depth = args.new_tokens or 64, args.depth or 2
    else:
        target, drafter, prompts = tiny(args.vocab, args.hidden)
        print(f"no trained drafter cached (or --tiny): tiny random Llama target, V={args.vocab}, "
              "drafter copying its layer")
        new, depth = args.new_tokens or 24, args.depth or 3
    vocab = target.get_output_embeddings().weight.shape[0]
    head = next(n for n, p in drafter.named_parameters() if p is drafter.lm_head.weight)
    state = nanospec_fx.attach(drafter, head=head, capacity=args.capacity)
    compiled = torch.compile(drafter, backend="nanospec", options={"capacity": args.capacity, "inductor": False})
    runner = HFTarget(target)

    eagle_generate(runner, compiled, prompts[0], min(new, 8), depth=depth)  # compile once, untimed
    state.reset()
    print(f"{new} new tokens per request, chain drafts of depth {depth}, greedy")
    print("note: nanospec runs its graph eagerly here (inductor off: quick to start). "
          f"It computes {min(args.capacity, vocab):,} head rows at most instead of {vocab:,}, but keeps its set up "
          "to date at every step (observe); where the "
          "full head is cheap (a small vocabulary, a CPU) that upkeep can cost more than the rows it saves, so "
          "its tok/s can be below the full head's; a random drafter's guesses also fall outside the set more often "
          "(a lower tau). `nanospec-fx e2e --drafter eagle` measures it properly.")
    print(f"{'drafter':<18}{'request':>8}{'lossless':>10}{'tau':>7}{'tok/s':>8}{'head rows':>11}")
    expected = [greedy_generate(hf_target_forward(target), p, new) if found is None else None for p in prompts]
    for name, model in (("target alone", None), ("full head", drafter), ("nanospec", compiled)):
        for i, prompt in enumerate(prompts):
            if model is compiled:
                state.reset()  # a new request
            start = time.perf_counter()
            out, stats = eagle_generate(runner, model, prompt, new, depth=depth if model is not None else 0)
            seconds = time.perf_counter() - start
            if expected[i] is None:  # the target alone on its cache is the reference for a real model
                expected[i] = out
            same = torch.equal(out, expected[i])
            rows = "" if model is None else f"{len(state) if model is compiled else vocab:,}"
            print(f"{name:<18}{i:>8}{str(same):>10}{stats.mean_accept_length:>7.2f}{new / seconds:>8.1f}{rows:>11}")
            if not same:
                raise SystemExit("speculative output differs from the target's greedy output")
    print(f"nanospec head: {len(state):,} of {vocab:,} rows on the last request.")


if __name__ == "__main__":
    main()
