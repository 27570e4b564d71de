"""Compile every nanospec Triton kernel to a GPU binary without a GPU.

The interpreter accepts code a real GPU compile rejects (tl.dot tiles under 16, dtype mixes,
loop-carried type changes). Triton can compile ahead of time for a target with its bundled
ptxas, so this catches those errors on a CPU machine:

    TRITON_INTERPRET=0 python -m nanospec_fx.kernels.compile_check [--arch 90]

Run it in a process where TRITON_INTERPRET is not 1 (the kernels must be JIT functions).
"""
from __future__ import annotations

import argparse
import sys

_PTR = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}


def _cases():
    """(kernel, signature types by argument, constexprs) for each variant the ops launch."""
    from . import triton_head as th
    from . import triton_observe as to
    from . import triton_select as ts

    for tok in ("*i32", "*i64"):
        yield to._observe_alloc_kernel, dict(tok_ptr=tok, n="i32", ids_ptr="*i64", slot_of_ptr="*i32", cursor_ptr="*i64",
                                             dest_ptr="*i64", V="i32", C="i32", P="i32"), dict(BLOCK=to._BLOCK)
    for dt in _PTR.values():
        for has_bias in (False, True):
            yield to._observe_copy_kernel, dict(tok_ptr="*i64", dest_ptr="*i64", w_ptr=dt, b_ptr=dt, cw_ptr=dt, cb_ptr=dt, H="i32",
                                                stride_wv="i32", stride_wh="i32", stride_b="i32", stride_cw="i32"), \
                dict(HAS_BIAS=has_bias, BLOCK_H=to._BLOCK_H)
            for scatter in (False, True):
                yield th._head_kernel, dict(x_ptr=dt, w_ptr=dt, b_ptr=dt, cursor_ptr="*i64", ids_ptr="*i64", out_ptr=dt, M="i32",
                                            C="i32", H="i32", V="i32", stride_xm="i32", stride_wc="i32", stride_om="i32"), \
                    dict(HAS_BIAS=has_bias, SCATTER=scatter, UPCAST=False, IEEE=dt == "*fp32",
                         BLOCK_M=th._BLOCK_M, BLOCK_C=th._BLOCK_C, BLOCK_K=th._BLOCK_K)
        yield th._scatter_kernel, dict(src_ptr=dt, ids_ptr="*i64", cursor_ptr="*i64", out_ptr=dt, C="i32", V="i32",
                                       stride_sm="i32", stride_om="i32"), dict(BLOCK=th._SCATTER_BLOCK)
        for largest in (True, False):
            for block in (16, 4096):
                yield ts._topk_kernel, dict(src_ptr=dt, ids_ptr="*i64", cursor_ptr="*i64", val_ptr=dt, tok_ptr="*i64", C="i32",
                                            K="i32", stride_s="i32"), dict(LARGEST=largest, BLOCK=block)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    args = parser.parse_args(argv)

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    target = GPUTarget("cuda", args.arch, 32)
    n = 0
    for kernel, types, constexprs in _cases():
        if not isinstance(kernel, JITFunction):
            print("kernels are not JIT functions: unset TRITON_INTERPRET", file=sys.stderr)
            return 2
        signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
        missing = [name for name, t in signature.items() if t == "constexpr" and name not in constexprs]
        if missing:
            raise ValueError(f"{kernel.fn.__name__}: no type for {missing}")
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=target)
        assert compiled.asm.get("cubin"), kernel.fn.__name__
        n += 1
    print(f"compiled {n} kernel variants for sm_{args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
