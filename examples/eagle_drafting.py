"""EAGLE-2-style drafting with a nanospec drafter: lossless, and the head computes a few tokens.

A tiny random Llama target and an EAGLE drafter sharing its embedding and LM head run greedy
speculative decoding (nanospec_fx/eagle.py), once with the drafter over the full vocabulary and
once compiled with nanospec. Both outputs equal the target's greedy output; the table shows
acceptance (tokens per round) and how many head rows the nanospec drafter computes.

The drafter is not trained: it copies the target's layer (plus noise), a stand-in that makes
drafts agree with a one-layer target often enough for the numbers to mean something. A random
target repeats few tokens, so the active vocabulary covers fewer next tokens than on real text.

    python examples/eagle_drafting.py                 # ~30 s on 2 CPU cores
    python examples/eagle_drafting.py --vocab 128256 --depth 6 --top-k 10 --num-nodes 60
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import nanospec_fx
from nanospec_fx.eagle import EagleConfig, EagleDrafter, greedy_generate, hf_target_forward, speculative_generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--target-layers", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--num-nodes", type=int, default=16, help="candidates verified per round (EAGLE-2's total tokens)")
    parser.add_argument("--capacity", type=int, default=512)
    parser.add_argument("--noise", type=float, default=0.1, help="relative noise on the drafter's copied layer")
    parser.add_argument("--inductor", action="store_true", help="compile the drafter with inductor (slower start)")
    args = parser.parse_args()

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.target_layers, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    drafter = EagleDrafter(EagleConfig.from_target(config), target.model.embed_tokens, target.lm_head)
    drafter.copy_target_layer(target.model.layers[0], args.noise).eval()
    compiled = torch.compile(drafter, backend="nanospec", options={"capacity": args.capacity, "inductor": args.inductor})

    forward = hf_target_forward(target)
    prompt = torch.randint(0, args.vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(2))
    expected = greedy_generate(forward, prompt, args.new_tokens)
    tree = dict(depth=args.depth, top_k=args.top_k, num_nodes=args.num_nodes)

    print(f"target: Llama, {args.target_layers} layer(s), H={args.hidden}, V={args.vocab}; "
          f"tree: depth {args.depth} x top-k {args.top_k}, {args.num_nodes} nodes verified")
    print(f"{'drafter':<22}{'draft':<7}{'lossless':<10}{'rounds':>7}{'tokens/round':>14}{'head rows':>11}{'time':>8}")
    for name, model in (("full vocabulary", drafter), ("nanospec", compiled)):
        for chain in (False, True):
            if model is compiled and chain:
                nanospec_fx.active_vocab(drafter).reset()  # a new request: the tree run created and filled the set
            start = time.perf_counter()
            out, stats = speculative_generate(forward, model, prompt, args.new_tokens, chain=chain, **tree)
            seconds = time.perf_counter() - start
            rows = len(nanospec_fx.active_vocab(drafter)) if model is compiled else args.vocab
            same = torch.equal(out, expected)
            print(f"{name:<22}{'chain' if chain else 'tree':<7}{str(same):<10}{stats.rounds:>7}"
                  f"{stats.mean_accept_length:>14.2f}{rows:>11}{seconds:>7.1f}s")
            if not same:
                raise SystemExit("speculative output differs from the target's greedy output")
    state = nanospec_fx.active_vocab(drafter)
    print(f"nanospec head: {len(state)} of {state.vocab_size} rows ({state.vocab_size / max(len(state), 1):.0f}x fewer); "
          "the first nanospec time includes compiling.")
    print("A random target seldom repeats a token, so its next token is seldom active yet and nanospec drafts are "
          "rarely accepted here; with --vocab 1000 its output loops and they are. Real text repeats far more.")


if __name__ == "__main__":
    main()
