"""Mean accepted length (tau) under speculative *sampling*: full-vocabulary, static (FR-Spec) and nanospec drafters.

The EAGLE loop of nanospec_fx/eagle/__init__.py (speculative_sample) on a tiny random Llama target and an
EAGLE drafter copying its layer (plus noise), at several temperatures, chain and tree drafting.
Every variant is lossless (tested in tests/eagle/test_eagle_sampling.py); what pruning costs is
acceptance: a drafter restricted to its active set never proposes the other tokens, so the target's
mass there is always a rejection. tau = tokens committed per round (accepted drafts + 1).

    python benchmarks/sampling_tau.py                      # ~3 min on 2 loaded CPU cores
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch._dynamo
from transformers import LlamaConfig, LlamaForCausalLM

import nanospec_fx
from nanospec_fx import FrequencyTable
from nanospec_fx.eagle import EagleConfig, EagleDrafter
from nanospec_fx.eval.bench.timing import Stopwatch
from nanospec_fx.eagle.speculative import hf_target_forward, speculative_sample
from nanospec_fx.sampling import SpeculativeSampler


def sample_corpus(forward, vocab: int, requests: int, length: int, seed: int) -> list[list[int]]:
    """Text sampled from the target alone (T = 1), to count token frequencies for the static policy."""
    g = torch.Generator().manual_seed(seed)
    sampler, out = SpeculativeSampler(), []
    with torch.inference_mode():
        for _ in range(requests):
            ids = torch.randint(0, vocab, (1, 8), generator=g)
            for _ in range(length):
                token = sampler.sample(sampler.probs(forward(ids)[0][0, -1]), g)
                ids = torch.cat([ids, token.view(1, 1)], 1)
            out.append(ids[0].tolist())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--init", type=float, default=0.15,
                        help="weight scale of the random target (the drafter, lacking the final norm, drifts from "
                             "larger targets in scale; 0.02 gives near-uniform targets)")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--prompt-len", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--tree-top-k", type=int, default=3)
    parser.add_argument("--capacity", type=int, default=256, help="nanospec active-set slots")
    parser.add_argument("--static-size", type=int, default=256, help="FR-Spec: the most frequent tokens")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    args = parser.parse_args()
    torch.set_num_threads(1)

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         initializer_range=args.init)
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    forward = hf_target_forward(target)

    def drafter_copy():  # its own head weight: one active vocabulary per variant
        d = EagleDrafter(EagleConfig.from_target(config), target.model.embed_tokens, copy.deepcopy(target.lm_head))
        return d.copy_target_layer(target.model.layers[0], args.noise).eval()

    torch.manual_seed(1)
    full = drafter_copy()
    static_module, nanospec_module = copy.deepcopy(full), copy.deepcopy(full)
    frequencies = FrequencyTable.from_token_ids(sample_corpus(forward, args.vocab, 16, 48, seed=5), args.vocab)
    torch._dynamo.config.recompile_limit = 64
    variants = {
        "full vocabulary": (full, full),
        f"static top-{args.static_size}": (static_module, torch.compile(static_module, backend="nanospec", options={
            "policy": "static", "frequencies": frequencies, "static_size": args.static_size, "inductor": False})),
        f"nanospec (capacity {args.capacity})": (nanospec_module, torch.compile(nanospec_module, backend="nanospec",
                                                                                options={"capacity": args.capacity,
                                                                                         "inductor": False})),
    }
    prompts = torch.randint(0, args.vocab, (args.requests, args.prompt_len), generator=torch.Generator().manual_seed(2))

    print(f"target: Llama 1 layer, H={args.hidden}, V={args.vocab}, init {args.init}; "
          f"drafter: its layer + {args.noise} noise; "
          f"{args.requests} requests x {args.new_tokens} tokens; chain depth {args.depth}, "
          f"tree depth {args.depth} x {args.tree_top_k} children per node")
    print(f"{'temperature':<13}{'drafting':<10}{'drafter':<26}{'tau':>6}{'accept/draft':>14}{'mean |A|':>10}"
          f"{'time':>8}")
    for temperature in args.temperatures:
        sampler = SpeculativeSampler(temperature=temperature)
        for top_k, mode in ((1, "chain"), (args.tree_top_k, "tree")):
            for name, (module, drafter) in variants.items():
                g = torch.Generator().manual_seed(0)
                committed = rounds = accepted = 0
                sizes = []
                watch = Stopwatch()
                for prompt in prompts:
                    state = None if drafter is module else _state(module)
                    if state is not None:
                        state.reset()
                    with watch:
                        _, stats = speculative_sample(forward, drafter, prompt[None], args.new_tokens, sampler, g,
                                                      depth=args.depth, top_k=top_k)
                    committed += sum(a + 1 for a in stats.accepted)
                    accepted += sum(stats.accepted)
                    rounds += stats.rounds
                    state = None if drafter is module else _state(module)
                    sizes.append(len(state) if state is not None else args.vocab)
                seconds = watch.seconds
                per_draft = accepted / (rounds * args.depth)  # chain: accepted share of the drafted positions
                print(f"{temperature:<13}{mode:<10}{name:<26}{committed / rounds:>6.2f}{per_draft:>14.2f}"
                      f"{sum(sizes) / len(sizes):>10.0f}{seconds:>7.1f}s")


def _state(module):
    try:
        return nanospec_fx.active_vocab(module)
    except LookupError:
        return None


if __name__ == "__main__":
    main()
