"""Speculative *sampling* with a nanospec drafter, checked at the distribution level.

1. transformers' assisted generation with ``do_sample=True`` through ``speculative_pair``;
2. the EAGLE loop of nanospec_fx/eagle/__init__.py in sampling mode (chain and tree);

and for each, a chi-square test (nanospec_fx.testing) of the generated tokens against the target's
exact sampling distribution, computed by enumerating every prefix of a tiny target (V = 12). The
drafter's active set holds at most 4 of the 12 tokens, yet the output keeps the target's distribution.

    python examples/speculative_sampling.py              # ~1 min on 2 CPU cores
    python examples/speculative_sampling.py --samples 2000
"""
from __future__ import annotations

import argparse

import torch
import torch._dynamo
from transformers import LlamaConfig, LlamaForCausalLM

import nanospec_fx
from nanospec_fx.eagle import EagleConfig, EagleDrafter
from nanospec_fx.eagle.speculative import hf_target_forward, speculative_sample
from nanospec_fx.sampling import SpeculativeSampler
from nanospec_fx.testing import chi_square_test, sequence_distribution

V, PROMPT = 12, torch.tensor([[1, 2, 3]])


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, initializer_range=0.3, pad_token_id=0, eos_token_id=None,
                         bos_token_id=None)
    return LlamaForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--temperature", type=float, default=1.5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sampler = SpeculativeSampler(temperature=args.temperature)

    # 1. transformers: compile the pair in place, then sample as usual.
    target, drafter = tiny_llama(0), tiny_llama(0)  # a drafter with the target's weights: most drafts accepted
    exact = sequence_distribution(lambda ids: sampler.probs(target(ids).logits[:, -1]), PROMPT, 2)
    state = nanospec_fx.speculative_pair(target, drafter, capacity=4, inductor=False)
    torch.manual_seed(0)
    samples = []
    with torch.inference_mode():
        for _ in range(args.samples):
            with state.request():
                out = target.generate(PROMPT, max_new_tokens=2, do_sample=True, temperature=args.temperature,
                                      assistant_model=drafter)
            samples.append(out[0, PROMPT.shape[1]:])
    print(f"transformers assisted sampling: {chi_square_test(torch.stack(samples), exact)}")

    # 2. the EAGLE loop: a seeded generator makes every run reproducible.
    torch._dynamo.reset()
    target = tiny_llama(0)
    config = EagleConfig.from_target(target.config)
    eagle = EagleDrafter(config, target.model.embed_tokens, target.lm_head)
    eagle.copy_target_layer(target.model.layers[0], 0.1)
    compiled = torch.compile(eagle.eval(), backend="nanospec",
                             options={"capacity": 4, "inductor": False, "head": "lm_head"})
    forward = hf_target_forward(target)
    exact = sequence_distribution(lambda ids: sampler.probs(forward(ids)[0][:, -1]), PROMPT, 3).sum(0)
    for top_k, mode in ((1, "chain"), (3, "tree")):
        generator, samples, committed, rounds = torch.Generator().manual_seed(0), [], 0, 0
        for _ in range(args.samples):
            out, stats = speculative_sample(forward, compiled, PROMPT, 3, sampler, generator, depth=2, top_k=top_k)
            nanospec_fx.active_vocab(eagle).reset()  # the next request
            samples.append(out[0, PROMPT.shape[1] + 1:])  # tokens 2 and 3: drafted and verified
            committed, rounds = committed + sum(a + 1 for a in stats.accepted), rounds + stats.rounds
        print(f"EAGLE {mode} sampling (tau {committed / rounds:.2f}): {chi_square_test(torch.stack(samples), exact)}")


if __name__ == "__main__":
    main()
