"""Head benchmark at Llama-3-8B shape: dense LM head vs the nanospec-compiled head.

    python benchmarks/head_llama3.py                 # fp32, 10 rows, 3000 active tokens

Both variants run in one process on the same weight; medians over repeats. The bytes limit is
V / active: the dense head reads all V rows, the compact one reads the active rows only.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn

import nanospec_fx
from nanospec_fx.eval.bench.timing import interleaved_medians


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rows", type=int, default=10)
    p.add_argument("--active", type=int, default=3000)
    p.add_argument("--capacity", type=int, default=3072)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    head = nn.Linear(args.hidden, args.vocab, bias=False).to(dtype).eval().requires_grad_(False)
    x = torch.randn(args.rows, args.hidden, dtype=dtype)
    compiled = torch.compile(head, backend="nanospec", options={"capacity": args.capacity})

    with torch.inference_mode():
        compiled(x)  # compile and create the state
        state = nanospec_fx.active_vocab(head)
        state.observe(torch.randperm(args.vocab)[: args.active])
        out = compiled(x)
        dense_out = head(x)
        mask = state.contains(torch.arange(args.vocab))
        assert (torch.allclose(out[:, mask], dense_out[:, mask], rtol=1e-3, atol=1e-3)
                and torch.isneginf(out[:, ~mask]).all())
        seconds = interleaved_medians({"dense": lambda: head(x), "nanospec": lambda: compiled(x)}, args.repeats)
        dense_ms, nanospec_ms = 1e3 * seconds["dense"], 1e3 * seconds["nanospec"]

    print(f"shape: H={args.hidden} V={args.vocab} rows={args.rows} active={len(state)} capacity={state.capacity} "
          f"dtype={args.dtype} threads={torch.get_num_threads()}")
    print(f"dense head      {dense_ms:9.3f} ms")
    print(f"nanospec head   {nanospec_ms:9.3f} ms")
    print(f"speedup         {dense_ms / nanospec_ms:9.1f}x   "
          f"(bytes limit V/capacity = {args.vocab / state.capacity:.1f}x)")


if __name__ == "__main__":
    main()
