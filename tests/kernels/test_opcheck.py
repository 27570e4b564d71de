"""``torch.library.opcheck`` with its default checks on every nanospec op (small shapes, CPU).

opcheck runs each op through its schema (declared mutations and aliasing), its fake (meta) implementation,
its autograd registration and AOT dispatch: the ways torch.compile reaches an op that a plain call never does.
The state is written out by hand (not by ``observe``), so the inputs do not depend on the op under test. Every op
is checked on the shared set and with ``rows`` on a per-request state (inputs that need no gradient: per-request
calls are inference only).
"""
from __future__ import annotations

import pytest
import torch

from nanospec_fx.kernels import ops, schema  # noqa: F401  (importing ops registers torch.ops.nanospec)
from helpers import request_state_by_hand

V, H, C, ACTIVE = 20, 4, 8, 5
REQUEST_SETS = [[3, 17, 0, 11], [], [5, 6, 7, 8, 9, 10, 12, 13]]  # per request: some, none, full (C = 8)


def _state(dtype=torch.float32, with_bias=True):
    """A state holding ACTIVE tokens of a random head, and that head (weight, bias)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=g, dtype=dtype)
    bias = torch.randn(V, generator=g, dtype=dtype) if with_bias else None
    tokens = torch.tensor([3, 17, 0, 11, 6])
    ids, slot_of, cursor, cache_w, cache_b = schema.new_state(V, H, C, dtype, "cpu")
    ids[:ACTIVE] = tokens
    slot_of[tokens] = torch.arange(ACTIVE, dtype=torch.int32)
    cursor[0] = ACTIVE
    cache_w[:ACTIVE] = weight[tokens]
    if bias is not None:
        cache_b[:ACTIVE] = bias[tokens]
    return weight, bias, [ids, slot_of, cursor, cache_w, cache_b]


def _request_state(with_bias=True):
    """A per-request state holding REQUEST_SETS of a random head, and that head (weight, bias)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=g)
    bias = torch.randn(V, generator=g) if with_bias else None
    state = request_state_by_hand(weight, bias, REQUEST_SETS, C)
    return weight, bias, state


def _request_cases():
    """(name, op, args) with ``rows`` (last): repeated rows, a padding row (-1), leading dims."""
    for with_bias in (True, False):
        weight, bias, state = _request_state(with_bias)
        ids, _, cursor, cache_w, cache_b = state
        b = cache_b if with_bias else None
        tag = "bias" if with_bias else "nobias"
        rows = torch.tensor([2, 0, 2, 1, -1])
        tokens = torch.tensor([[1, 2], [3, -1], [4, 14], [2, 2], [15, 16]])  # new, active, evicting, padding
        yield f"rows-observe-{tag}", "observe", (tokens, weight, bias, *state, 1, rows)
        x = torch.randn(2, 2, H)
        rows2 = torch.tensor([[0, 2], [1, -1]])
        yield f"rows-compact_logits-{tag}", "compact_logits", (x, cache_w, b, cursor, rows2)
        yield f"rows-head_logits-{tag}", "head_logits", (x, cache_w, b, ids, cursor, V, rows2)
    _, _, (ids, _, cursor, cache_w, _) = _request_state()
    compact = torch.randn(3, C)
    rows = torch.tensor([1, 2, 0])
    yield "rows-scatter_logits", "scatter_logits", (compact, ids, cursor, V, rows)
    for largest in (True, False):
        yield f"rows-compact_topk-{largest}", "compact_topk", (compact, ids, cursor, 3, largest, rows)
    yield "rows-compact_topk-k-past-capacity", "compact_topk", (compact, ids, cursor, C + 2, True, rows)
    yield "rows-compact_argmax", "compact_argmax", (compact, ids, cursor, rows)


def _compact(grad: bool):
    g = torch.Generator().manual_seed(1)
    compact = torch.randn(3, C, generator=g)
    compact[:, ACTIVE:] = float("-inf")  # slots past the count, as compact_logits leaves them
    return compact.requires_grad_(grad)


def _cases():
    """(op name, args) pairs: with and without bias, with and without inputs that need a gradient."""
    for with_bias in (True, False):
        weight, bias, state = _state(with_bias=with_bias)
        ids, _, cursor, cache_w, cache_b = state
        b = cache_b if with_bias else None
        tag = "bias" if with_bias else "nobias"
        # fresh ids, ids already active, and enough new ids to evict (num_pinned 2 keeps two slots)
        for name, tokens in (("new", [1, 2]), ("active", [3, 17]), ("evicting", [1, 2, 4, 5, 7, 8])):
            yield f"observe-{tag}-{name}", "observe", (torch.tensor(tokens), weight, bias, *state, 2)
        for grad in (False, True):
            x = torch.randn(2, 3, H).requires_grad_(grad)
            g = "grad" if grad else "nograd"
            yield f"compact_logits-{tag}-{g}", "compact_logits", (x, cache_w, b, cursor)
            yield f"head_logits-{tag}-{g}", "head_logits", (x, cache_w, b, ids, cursor, V)
    _, _, (ids, _, cursor, _, _) = _state()
    for grad in (False, True):
        g = "grad" if grad else "nograd"
        yield f"scatter_logits-{g}", "scatter_logits", (_compact(grad), ids, cursor, V)
        for largest in (True, False):
            yield f"compact_topk-{g}-largest{largest}", "compact_topk", (_compact(grad), ids, cursor, 3, largest)
    yield "compact_topk-k-past-count", "compact_topk", (_compact(False), ids, cursor, C - 1, True)
    yield "compact_argmax", "compact_argmax", (_compact(False), ids, cursor)
    for name, weight in _head_weights():  # quantised rows and the columns of an [H, V] weight
        state = schema.new_state(V, H, C, weight.dtype, "cpu")
        yield f"observe-{name}", "observe", (torch.tensor([1, 2, 9]), weight, None, *state, 0)


def _head_weights():
    """Head weights beyond a contiguous float [V, H]: int8, float8 (when torch has it), a ``W.t()`` view."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(V, H, generator=g) * 20
    yield "int8", w.round().to(torch.int8)
    if hasattr(torch, "float8_e4m3fn"):
        yield "float8", w.to(torch.float8_e4m3fn)
    yield "transposed", w.t().contiguous().t()


@pytest.mark.parametrize("kernels", ["reference", "host", "triton"])
@pytest.mark.parametrize("name,weight", list(_head_weights()), ids=lambda v: v if isinstance(v, str) else "")
def test_observe_copies_the_exact_rows_of_every_head_weight(kernels, name, weight, use_kernels):
    """Every implementation caches the fed tokens' rows bit for bit (float8 is copied as its bytes)."""
    use_kernels(kernels)
    ids, slot_of, cursor, cache_w, cache_b = schema.new_state(V, H, C, weight.dtype, "cpu")
    tokens = torch.tensor([4, 19, 4, 0])
    torch.ops.nanospec.observe(tokens, weight, None, ids, slot_of, cursor, cache_w, cache_b, 0)
    assert ids[:3].tolist() == [4, 19, 0] and int(cursor) == 3
    assert torch.equal(cache_w[:3].view(torch.uint8) if weight.element_size() == 1 else cache_w[:3],
                       weight[[4, 19, 0]].contiguous().view(torch.uint8) if weight.element_size() == 1
                       else weight[[4, 19, 0]])


CASES = list(_cases()) + list(_request_cases())


def test_every_op_in_the_schema_is_checked():
    assert {op for name, op, _ in CASES if not name.startswith("rows-")} == set(schema.OPS)
    assert {op for name, op, _ in CASES if name.startswith("rows-")} == set(schema.OPS)


@pytest.mark.parametrize(
    "op,args", [pytest.param(op, args, id=name) for name, op, args in CASES]
)
def test_opcheck(op, args):
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if any(isinstance(a, torch.Tensor) and a.dtype in _FLOAT8 for a in args):
        utils = utils[1:]  # opcheck's schema check compares values with arithmetic float8 tensors do not have on CPU
    torch.library.opcheck(getattr(torch.ops.nanospec, op).default, args, test_utils=utils)


_FLOAT8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}
