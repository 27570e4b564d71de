"""Shared test helpers: compile with nanospec, build the eager oracle, compare per dtype, a tiny Llama, and run
a fresh Python (or any command) in a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch._dynamo

import nanospec_fx

from nanospec_fx.eval.loaders import tiny_llama as _tiny_llama
from nanospec_fx.testing import TOLERANCES

ROOT = Path(__file__).resolve().parents[1]


def compile_nanospec(model, **options):
    """``torch.compile(model, backend="nanospec", options=...)``, inductor off unless asked, from a fresh Dynamo."""
    # One place for "a fresh Dynamo per compile" where pytest's autouse fixture (a reset per test) cannot reach: a
    # hypothesis test (and the pass fuzzer's judge) compiles one drafter per example inside one test, and the
    # tensor-parallel worker process runs a scenario's cases in one process with no fixture. Without it, the earlier
    # compiles' recompiles reach Dynamo's recompile limit and the later ones run eager (nothing checked).
    torch._dynamo.reset()
    options.setdefault("inductor", False)
    return torch.compile(model, backend="nanospec", options=options)


def active_mask(model, **kw) -> torch.Tensor:
    state = nanospec_fx.active_vocab(model, **kw)
    return state.contains(torch.arange(state.vocab_size))


def assert_close_per_dtype(actual, expected, compute_dtype=None):
    """Compare with the tolerance of ``compute_dtype`` (the head's dtype; default: the output's).

    An fp32 output computed from bf16 logits (``log_softmax(z.float())``) carries bf16 error.
    """
    if isinstance(expected, (tuple, list)):
        assert type(actual) is type(expected) or isinstance(actual, tuple) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_close_per_dtype(a, e, compute_dtype)
        return
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if expected.is_floating_point():
        rtol, atol = TOLERANCES[compute_dtype or expected.dtype]
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    else:
        torch.testing.assert_close(actual, expected)


def tiny_llama(vocab: int, layers: int, seed: int, hidden: int = 32, **config):
    """A random-weight LlamaForCausalLM small enough for CPU tests (``config``: more LlamaConfig fields)."""
    return _tiny_llama(vocab, layers, hidden=hidden, seed=seed, **config)


def run_command(args, *, env=None, unset=(), timeout=600, cwd=ROOT, check=True) -> subprocess.CompletedProcess:
    """Run ``args`` with this process's environment, less the variables named in ``unset``, plus ``env``.

    ``check``: assert it exited 0 (the message is the tail of its stderr); pass False to judge a failure yourself.
    """
    environ = {k: v for k, v in os.environ.items() if k not in unset}
    environ.update(env or {})
    done = subprocess.run([str(a) for a in args], env=environ, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    if check:
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done


def run_python(code: str | None = None, *args, **kw) -> subprocess.CompletedProcess:
    """A fresh Python (this interpreter) running ``code`` (dedented, as ``-c``) or, without code, ``args``
    (a script or ``-m module`` and its arguments); ``kw`` as for :func:`run_command`."""
    head = ["-c", textwrap.dedent(code)] if code is not None else []
    return run_command([sys.executable, *head, *args], **kw)


def request_state_by_hand(weight: torch.Tensor, bias: torch.Tensor | None, sets: list, capacity: int) -> list:
    """A per-request state (kernels/schema.py order) whose request r holds ``sets[r]`` in slot order, written
    directly, not observed: op tests whose inputs do not depend on the op under test."""
    from nanospec_fx.kernels import schema

    vocab, hidden = weight.shape
    ids, slot_of, cursor, cache_w, cache_b = schema.new_request_state(len(sets), vocab, hidden, capacity,
                                                                      weight.dtype, "cpu")
    for r, tokens in enumerate(sets):
        t = torch.tensor(tokens, dtype=torch.int64)
        ids[r, : len(t)] = t
        slot_of[r, t] = torch.arange(len(t), dtype=torch.int32)
        cursor[r] = len(t)
        cache_w[r, : len(t)] = weight[t]
        if bias is not None:
            cache_b[r, : len(t)] = bias[t]
    return [ids, slot_of, cursor, cache_w, cache_b]
