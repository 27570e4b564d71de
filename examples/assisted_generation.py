"""NanoSpec in transformers' assisted generation, with no change to the drafter's code.

A small random Llama drafter is compiled in place with the nanospec backend and drives
``target.generate(..., assistant_model=drafter)``. The output is token for token the target's
greedy output, while the drafter's head computes logits for a few dozen tokens instead of V.

    python examples/assisted_generation.py            # tiny random models, ~30 s on 2 CPU cores
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import nanospec_fx


def tiny_llama(vocab: int, layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--no-inductor", action="store_true", help="run the rewritten graph eagerly (faster start)")
    args = parser.parse_args()

    target, drafter = tiny_llama(args.vocab, 2, seed=0), tiny_llama(args.vocab, 1, seed=1)
    # generate() calls drafter.generate(), so compile the drafter in place, not through a wrapper.
    drafter.compile(backend="nanospec", options={"capacity": args.capacity, "inductor": not args.no_inductor})

    prompt = torch.randint(0, args.vocab, (1, 16), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False)
    with torch.inference_mode():
        greedy = target.generate(prompt, **kwargs)
        start = time.perf_counter()
        assisted = target.generate(prompt, assistant_model=drafter, **kwargs)
        seconds = time.perf_counter() - start

    state = nanospec_fx.active_vocab(drafter)
    same = torch.equal(greedy, assisted)
    print(f"assisted output == greedy target output: {same}")
    print(f"drafter head computes {len(state)} of {state.vocab_size} tokens ({state!r})")
    print(f"assisted generation took {seconds:.1f} s (first call includes compilation)")
    if not same:
        raise SystemExit("outputs differ")


if __name__ == "__main__":
    main()
