"""``torch.library.opcheck`` on every per-request op (small shapes, CPU): schema (declared mutations), fake
implementation and AOT dispatch. The state is written by hand, so the inputs do not depend on the op under test.
The ops have no autograd (inference only): inputs do not require a gradient."""
from __future__ import annotations

import pytest
import torch

from nanospec_fx.kernels import ops_per_request, schema  # noqa: F401  (registers the ops)

V, H, C, R = 19, 4, 6, 3
SETS = [[3, 17, 0, 11], [], [5, 6, 7, 8, 9, 10]]


def _state(with_bias=True):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=g)
    bias = torch.randn(V, generator=g) if with_bias else None
    state = schema.new_request_state(R, V, H, C, torch.float32, "cpu")
    ids, slot_of, cursor, cache_w, cache_b = state
    for r, tokens in enumerate(SETS):
        t = torch.tensor(tokens, dtype=torch.int64)
        ids[r, : len(t)] = t
        slot_of[r, t] = torch.arange(len(t), dtype=torch.int32)
        cursor[r] = len(t)
        cache_w[r, : len(t)] = weight[t]
        if bias is not None:
            cache_b[r, : len(t)] = bias[t]
    return weight, bias, state


def _cases():
    for with_bias in (True, False):
        weight, bias, state = _state(with_bias)
        ids, _, cursor, cache_w, cache_b = state
        b = cache_b if with_bias else None
        tag = "bias" if with_bias else "nobias"
        rows = torch.tensor([2, 0, 2, 1])
        tokens = torch.tensor([[1, 2], [3, -1], [4, 12], [2, 2]])  # new, active, evicting (row 2 is full)
        yield f"observe-{tag}", "observe_per_request", (tokens, rows, weight, bias, *state, 1)
        x = torch.randn(2, 2, H)
        rows2 = torch.tensor([[0, 2], [1, 0]])
        yield f"compact_logits-{tag}", "compact_logits_per_request", (x, rows2, cache_w, b, cursor)
        yield f"head_logits-{tag}", "head_logits_per_request", (x, rows2, cache_w, b, ids, cursor, V)
    _, _, (ids, _, cursor, cache_w, _) = _state()
    compact = torch.randn(3, C)
    rows = torch.tensor([1, 2, 0])
    yield "scatter_logits", "scatter_logits_per_request", (compact, rows, ids, cursor, V)
    for largest in (True, False):
        yield f"compact_topk-{largest}", "compact_topk_per_request", (compact, rows, ids, cursor, 3, largest)
    yield "compact_topk-k-past-capacity", "compact_topk_per_request", (compact, rows, ids, cursor, C + 2, True)
    yield "compact_argmax", "compact_argmax_per_request", (compact, rows, ids, cursor)


CASES = list(_cases())


def test_every_per_request_op_is_checked():
    assert {op for _, op, _ in CASES} == set(schema.REQUEST_OPS)


@pytest.mark.parametrize("op,args", [pytest.param(op, args, id=name) for name, op, args in CASES])
def test_opcheck(op, args):
    torch.library.opcheck(getattr(torch.ops.nanospec, op).default, args)
