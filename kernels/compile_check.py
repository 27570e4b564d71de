"""Compile every nanospec Triton kernel, as the ops launch it, to a GPU binary without a GPU.

The interpreter accepts code a real GPU compile rejects (tl.dot tiles under 16, dtype mixes,
loop-carried type changes), and it never sees the variants Triton really builds: at launch time
Triton specialises integer arguments (== 1, divisible by 16) and pointers (16-byte aligned), and
the wrapper picks num_warps / num_stages. So this module *runs the op wrappers* on CPU tensors at
representative shapes with ``JITFunction.run`` replaced by a recorder that binds the arguments with
Triton's own specialisation code for the target and compiles that exact variant (bundled ptxas),
instead of launching. Every compiled variant's TTIR is then checked for int32 products of integer
arguments (strides, sizes): offsets that can pass 2^31 must be computed in int64.

    TRITON_INTERPRET=0 python -m nanospec_fx.kernels.compile_check [--arch 90]

Run it in a process where TRITON_INTERPRET is not 1 (the kernels must be JIT functions).
"""
from __future__ import annotations

import argparse
import contextlib
import re
import sys

_DEF = re.compile(r"(%[\w#]+)(?::\d+)?\s*=")
_USE = re.compile(r"%[\w#]+")
_ARG = re.compile(r"(%[\w#]+): i32\b")
_LOC = re.compile(r"\s+loc\(.*$")


def int32_argument_products(ttir: str) -> list[str]:
    """TTIR lines with an ``arith.muli`` on i32 values derived from an integer kernel argument.

    Integer arguments are strides and sizes; an index times one of them in int32 wraps silently
    once the product passes 2^31. Derivation is followed through every op (a result is derived
    if any operand is), including loop bounds into induction variables.
    """
    tainted: set[str] = set()
    bad = []
    for line in ttir.splitlines():
        if "tt.func" in line:
            tainted |= set(_ARG.findall(line))
            continue
        defs = set(_DEF.findall(line))
        uses = set(_USE.findall(line)) - defs
        if not uses & tainted:
            continue
        if "arith.muli" in line:
            ty = _LOC.sub("", line).rsplit(":", 1)[-1].strip()
            if ty == "i32" or re.fullmatch(r"tensor<[\dx]*xi32(,.*)?>", ty):
                bad.append(_LOC.sub("", line).strip())
        tainted |= defs
    return bad


class Recorder:
    """Replaces ``JITFunction.run``: binds and compiles for ``target`` instead of launching."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.target = GPUTarget("cuda", arch, 32)
        self.backend = make_backend(self.target)
        self.seen: dict = {}
        self.problems: list[str] = []

    def run(self, kernel, *args, grid, warmup, **kwargs):
        import triton
        from triton.compiler import ASTSource
        from triton.runtime.jit import create_function_from_signature

        binder = create_function_from_signature(kernel.signature, kernel.params, self.backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(self.backend, kwargs, bound, specialization, options)
        key = (kernel.fn.__name__, repr(sorted(signature.items())), repr(sorted(constexprs.items(), key=str)),
               repr(sorted(attrs.items(), key=str)), options.num_warps, options.num_stages)
        if key in self.seen:
            return None
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=self.target,
                                  options=options.__dict__)
        if not compiled.asm.get("cubin"):
            self.problems.append(f"{kernel.fn.__name__}: no cubin")
        for line in int32_argument_products(compiled.asm["ttir"]):
            self.problems.append(f"{kernel.fn.__name__}{dict(signature)}: int32 product of an argument: {line}")
        self.seen[key] = compiled
        return None

    @contextlib.contextmanager
    def installed(self):
        from triton.runtime.jit import JITFunction

        real = JITFunction.run
        recorder = self

        def run(self, *args, grid, warmup, **kwargs):
            return recorder.run(self, *args, grid=grid, warmup=warmup, **kwargs)

        JITFunction.run = run
        try:
            yield self
        finally:
            JITFunction.run = real


def _launch_everything() -> None:
    """Call every op wrapper at shapes that produce each specialisation the ops can launch."""
    import torch

    from . import triton_head as th
    from . import triton_kernels as T
    from .schema import new_state
    from .selection import use_kernels
    from .triton_util import direct_launch

    # (V, H, C): sizes divisible by 16 (Llama-3 head: H = 4096, C = 3072, V % 16 == 0) and not.
    shapes = [(128256, 64, 3072), (1001, 100, 100)]
    with direct_launch(), torch.no_grad():
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for vocab, hidden, capacity in shapes:
                w = torch.zeros(vocab, hidden, dtype=dtype)
                b = torch.zeros(vocab, dtype=dtype)
                state = new_state(vocab, hidden, capacity, dtype, "cpu")
                ids, _, cursor, cache_w, cache_b = state
                for tok_dtype in (torch.int32, torch.int64):
                    for bias in (None, b):
                        T.observe(torch.zeros(5, dtype=tok_dtype), w, bias, *state, 0)
                for rows in (1, 3, 10):
                    x = torch.zeros(rows, hidden, dtype=dtype)
                    for bias in (None, cache_b):
                        names = (getattr(th, "HEAD_CONFIGS", ["default"])
                                 if (dtype, vocab) == (torch.bfloat16, 128256) else ["default"])
                        for name in names:
                            with use_kernels(head_config=name):
                                compact = T.compact_logits(x, cache_w, bias, cursor)
                                T.head_logits(x, cache_w, bias, ids, cursor, vocab)
                    T.scatter_logits(compact, ids, cursor, vocab)
                    for largest in (True, False):
                        T.compact_topk(compact, ids, cursor, min(10, capacity), largest)
    _launch_per_request(shapes)


def _launch_per_request(shapes) -> None:
    """Every wrapper with ``rows`` (a per-request state) at the same shapes, 3 request rows."""
    import torch

    from . import triton_kernels as T
    from .schema import new_request_state
    from .triton_util import direct_launch

    with direct_launch(), torch.no_grad():
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for vocab, hidden, capacity in shapes:
                w, b = torch.zeros(vocab, hidden, dtype=dtype), torch.zeros(vocab, dtype=dtype)
                state = new_request_state(3, vocab, hidden, capacity, dtype, "cpu")
                ids, _, cursor, cache_w, cache_b = state
                rows = torch.tensor([2, 0, 2])
                for bias in (None, b):
                    T.observe(torch.zeros(3, 5, dtype=torch.int64), w, bias, *state, 0, rows)
                x = torch.zeros(3, hidden, dtype=dtype)
                for bias in (None, cache_b):
                    compact = T.compact_logits(x, cache_w, bias, cursor, rows)
                    T.head_logits(x, cache_w, bias, ids, cursor, vocab, rows)
                T.scatter_logits(compact, ids, cursor, vocab, rows)
                for largest in (True, False):
                    T.compact_topk(compact, ids, cursor, min(10, capacity), largest, rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    args = parser.parse_args(argv)

    from triton.runtime.jit import JITFunction

    from . import triton_head

    if not isinstance(triton_head._head_kernel, JITFunction):
        print("kernels are not JIT functions: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    recorder = Recorder(args.arch)
    try:
        with recorder.installed():
            _launch_everything()
    except (ImportError, AttributeError, TypeError) as exc:  # launcher internals differ in this triton
        import triton

        print(f"compile_check cannot record launches with triton {triton.__version__}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 3
    for p in recorder.problems:
        print(p, file=sys.stderr)
    kernels = sorted({k[0] for k in recorder.seen})
    print(f"compiled {len(recorder.seen)} kernel variants ({', '.join(kernels)}) for sm_{args.arch}")
    return 1 if recorder.problems else 0


if __name__ == "__main__":
    sys.exit(main())
