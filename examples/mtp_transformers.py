"""NanoSpec for drafters that score the target's own head in transformers: MTP layers and DFlash.

1. MTP: a tiny DeepSeek-V3 checkpoint with one MTP layer is written locally (nothing from a hub) and loaded;
   ``nanospec_fx.speculative_pair(target, mtp=True)`` is the whole setup, then ``target.generate(ids, use_mtp=True)``.
2. DFlash: a tiny Llama target and a DFlash drafter (``MuseGlimmerAssistantModel``); ``speculative_pair(target,
   drafter)``, then ``target.generate(ids, assistant_model=drafter, speculation_type="dflash")``.

Each prints whether the output equals the target's plain greedy output and how many tokens the drafting head
scored (the active set) out of V. The target's own forward (the verification) stays dense.

    python examples/mtp_transformers.py --no-inductor    # the rewritten graphs run eagerly: starts faster
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import transformers

import nanospec_fx
from nanospec_fx.eval.loaders import tiny_mtp_checkpoint

START = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {message}", flush=True)


def mtp(directory: Path, vocab: int, new_tokens: int, inductor: bool) -> None:
    say("writing a tiny DeepSeek-V3 checkpoint with one MTP layer")
    target = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_mtp_checkpoint(directory / "deepseek", vocab_size=vocab)).eval()
    ids = torch.randint(1, vocab, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = target.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    state = nanospec_fx.speculative_pair(target, mtp=True, capacity=64, inductor=inductor)  # the one line
    say("generate(use_mtp=True) with the MTP layers compiled by nanospec (first call compiles)")
    with torch.inference_mode():
        out = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, use_mtp=True)
    print(f"MTP: output == greedy target output: {torch.equal(out, plain)}; the MTP head scored "
          f"{len(state)} active tokens of V={vocab}")
    nanospec_fx.detach(target)


def dflash(vocab: int, new_tokens: int, inductor: bool) -> None:
    say("building a tiny Llama target and a DFlash drafter")
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, pad_token_id=0, bos_token_id=None,
        eos_token_id=None)).eval()
    drafter = transformers.MuseGlimmerAssistantModel(transformers.MuseGlimmerAssistantConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, block_size=4, mask_token_id=vocab - 1, target_layer_ids=[0, 2], max_position_embeddings=128,
        sliding_window=64, pad_token_id=0, bos_token_id=None, eos_token_id=None)).eval()
    ids = torch.randint(1, vocab - 1, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = target.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    state = nanospec_fx.speculative_pair(target, drafter, capacity=64, inductor=inductor)  # the one line
    say("generate(assistant_model=drafter, speculation_type='dflash') with a compact head for the drafted block")
    with torch.inference_mode():
        out = target.generate(ids, max_new_tokens=new_tokens, do_sample=False, assistant_model=drafter,
                              speculation_type="dflash")
    print(f"DFlash: output == greedy target output: {torch.equal(out, plain)}; the drafting head scored "
          f"{len(state)} active tokens of V={vocab}")
    nanospec_fx.detach(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=500)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--no-inductor", action="store_true", help="run the rewritten graphs eagerly")
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models: one thread is faster
    with tempfile.TemporaryDirectory() as directory:
        mtp(Path(directory), args.vocab, args.new_tokens, not args.no_inductor)
    dflash(args.vocab, args.new_tokens, not args.no_inductor)
    say("done")


if __name__ == "__main__":
    main()
