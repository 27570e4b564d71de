"""NanoSpec in transformers' assisted generation, with no change to the drafter's code.

A small random Llama drafter drives ``target.generate(..., assistant_model=drafter)`` twice:

1. the drafter alone compiled in place with the nanospec backend (its active vocabulary holds
   every token fed to it), and
2. ``nanospec_fx.speculative_pair(target, drafter)``: the target is compiled as an observer too,
   so the target's top-3 at every position it scores joins the drafter's vocabulary.

Both outputs are token for token the target's greedy output, while the drafter's head computes
logits for a few dozen tokens instead of V.

    python examples/assisted_generation.py                 # tiny random models, a few minutes on a CPU
    python examples/assisted_generation.py --no-inductor   # the rewritten graphs run eagerly: starts faster

Measured: 2.6 min on 2 CPU cores (a newcomer's run); 6.0 min wall and 1.7 min of CPU time on 2 cores
shared with heavy other jobs. Nearly all of it is compiling (Dynamo + inductor, once per new input
shape, on the first generate calls of each part); each step prints what it is doing and when.
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import nanospec_fx

START = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {message}", flush=True)


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

    say(f"building a random 2-layer target and 1-layer drafter (V={args.vocab})")
    target, drafter = tiny_llama(args.vocab, 2, seed=0), tiny_llama(args.vocab, 1, seed=1)
    prompt = torch.randint(0, args.vocab, (1, 16), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False)
    options = {"capacity": args.capacity, "inductor": not args.no_inductor}
    say("the target alone, greedy (the reference output)")
    with torch.inference_mode():
        greedy = target.generate(prompt, **kwargs)

    # 1. generate() calls drafter.generate(), so compile the drafter in place, not through a wrapper.
    drafter.compile(backend="nanospec", options=options)
    say("assisted generation, drafter compiled with nanospec (its first calls compile it" +
        (")" if args.no_inductor else " with inductor: the slow part)"))
    run("drafter inputs only", target, drafter, prompt, greedy, kwargs)

    # 2. The full NanoSpec context: the target observes its top-3 into the drafter's vocabulary.
    nanospec_fx.speculative_pair(target, drafter, observe_topk=3, **options)
    say("assisted generation with the target compiled as an observer (compiling the target now)")
    run("with the target observer", target, drafter, prompt, greedy, kwargs)
    nanospec_fx.explain(drafter)  # prints the report
    say("done")


def run(label: str, target, drafter, prompt, greedy, kwargs) -> None:
    with torch.inference_mode():
        start = time.perf_counter()
        if _has_state(drafter):
            nanospec_fx.active_vocab(drafter).reset()  # a new request starts with an empty set
        assisted = target.generate(prompt, assistant_model=drafter, **kwargs)
        seconds = time.perf_counter() - start
    state = nanospec_fx.active_vocab(drafter)
    same = torch.equal(greedy, assisted)
    say(f"[{label}] assisted output == greedy target output: {same}; "
          f"the drafter head computes {len(state)} of {state.vocab_size} tokens; {seconds:.1f} s (includes compiling)")
    if not same:
        raise SystemExit("outputs differ")


def _has_state(drafter) -> bool:
    try:
        nanospec_fx.active_vocab(drafter)
        return True
    except LookupError:
        return False


if __name__ == "__main__":
    main()
