"""Head layouts beyond ``F.linear(h, W)`` with W [V, H]: every form is rewritten exactly or runs dense with a warning.

Oracle (independent of the pass): the eager dense drafter's logits with -inf at the tokens the active set does not
hold after the call, and every id the call fed is in the set.

* ``[H, V]`` weights: ``h @ W``, ``torch.matmul(h, W)``, ``F.linear(h, W.t())`` (``.T``, ``.mT``, ``permute``,
  ``transpose``), with and without bias; the state is keyed on the stored Parameter, in-place writes refresh the
  cached columns, and an embedding tied as ``W.t()`` is observed (or, when it renormalises the weight, dense).
* weight-only int8 / float8 heads with a per-row or per-tensor scale, applied before or after the matmul: the
  quantised rows are cached, the scales gathered, and the [V, H] weight is never dequantised whole.
* heads behind ``torch.nn.utils.parametrize`` whose parametrisation is row-wise: only the active rows are
  computed; one that mixes rows runs dense with a warning.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.fx as fx
import torch.nn.functional as F
from torch.nn.utils import parametrize

import nanospec_fx
from helpers import compile_nanospec
from nanospec_fx.vocab import reports as pass_reports
V, H = 40, 8
NEG = float("-inf")


FED = torch.tensor([[5, 17, 23], [9, 31, 2]])  # no token 0: a gather at unfilled slots (id -1 -> 0) would show


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (2, 3), generator=torch.Generator().manual_seed(seed))


def _check_exact(model, compiled, ids, only: torch.Tensor | None = None) -> nanospec_fx.ActiveVocab:
    """compiled(ids) == eager logits with -inf at inactive tokens; the ids fed are active (with ``only``: exactly
    those ids are); no warning."""
    with torch.no_grad():
        out = compiled(ids)
        dense = model(ids)
    state = nanospec_fx.active_vocab(compiled)
    active = state.contains(torch.arange(V))
    assert active[ids.flatten()].all(), "an id fed to the drafter is not active"
    torch.testing.assert_close(out, dense.masked_fill(~active, NEG), rtol=1e-5, atol=1e-5)
    assert pass_reports.reports(state), "the head was not rewritten"
    if only is not None:
        assert set(state.token_ids().tolist()) == set(only.flatten().tolist()), "tokens nobody fed are active"
    return state


def _check_dense(model, ids, match: str, **options):
    compiled = compile_nanospec(model, **options)
    with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning, match=match):
        out = compiled(ids)
    torch.testing.assert_close(out, model(ids))


# ----------------------------------------------------------------------------- [H, V] weights
HV_FORMS = {
    "at": lambda h, W, b: _plus(h @ W, b),
    "matmul": lambda h, W, b: _plus(torch.matmul(h, W), b),
    "linear_t": lambda h, W, b: F.linear(h, W.t(), b),
    "linear_T": lambda h, W, b: F.linear(h, W.T, b),
    "linear_mT": lambda h, W, b: F.linear(h, W.mT, b),
    "linear_permute": lambda h, W, b: F.linear(h, W.permute(1, 0), b),
    "linear_transpose": lambda h, W, b: F.linear(h, W.transpose(0, 1), b),
}


def _plus(z, b):
    return z if b is None else z + b


class HVHead(nn.Module):
    """Embedding -> tiny body -> a head whose weight is a Parameter stored [H, V]."""

    def __init__(self, form: str, bias: bool = False, tied: str = "", seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.form, self.tied = form, tied
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.W = nn.Parameter(torch.randn(H, V) / H**0.5)
        self.b = nn.Parameter(torch.randn(V)) if bias else None

    def lookup(self, ids):
        if self.tied == "embedding_t":  # the token table is the head's weight, read as [V, H]
            return F.embedding(ids, self.W.t())
        if self.tied == "index_t":
            return self.W.t()[ids]
        if self.tied == "max_norm_t":  # renormalises the looked-up rows of W in place
            return F.embedding(ids, self.W.t(), max_norm=0.5)
        if self.tied == "columns":  # W[:, ids]: a read of the head's columns no lookup rule covers
            return self.W[:, ids].permute(1, 2, 0)
        return self.embed(ids)

    def forward(self, ids):
        h = torch.tanh(self.body(self.lookup(ids)))
        return HV_FORMS[self.form](h, self.W, self.b)


@pytest.mark.parametrize("form,bias",
                         [(f, i % 2 == 1) for i, f in enumerate(HV_FORMS)] + [("at", False), ("linear_t", True)])
def test_hv_weight_head_is_rewritten_exactly(form, bias):
    model = HVHead(form, bias).eval()
    compiled = compile_nanospec(model, capacity=16)
    state = _check_exact(model, compiled, FED, only=FED)
    assert state.transposed and state.is_weight(model.W)  # keyed on the Parameter, not on a view of it
    _check_exact(model, compiled, _ids(1))  # a second call: the same state, new ids added


def test_hv_head_follows_in_place_writes_of_the_weight():
    model = HVHead("at", bias=True).eval()
    compiled = compile_nanospec(model, capacity=16)
    _check_exact(model, compiled, _ids(0))
    with torch.no_grad():
        model.W.mul_(-2.0)  # the cached columns are stale now
        model.b.add_(1.0)
    _check_exact(model, compiled, _ids(0))


def test_hv_head_of_a_second_instance_reads_its_own_weight():
    a, b = HVHead("linear_t", seed=0).eval(), HVHead("linear_t", seed=1).eval()
    ca = torch.compile(a, backend="nanospec", options={"inductor": False, "capacity": 16})
    cb = torch.compile(b, backend="nanospec", options={"inductor": False, "capacity": 16})
    for _ in range(2):
        _check_exact(a, ca, _ids(0))
        _check_exact(b, cb, _ids(1))
    assert nanospec_fx.active_vocab(ca) is not nanospec_fx.active_vocab(cb)


@pytest.mark.parametrize("tied", ["embedding_t", "index_t"])
def test_hv_head_tied_to_its_embedding_as_a_transpose(tied):
    model = HVHead("at", tied=tied).eval()
    _check_exact(model, compile_nanospec(model, capacity=16), _ids(0))


def test_hv_head_tied_to_an_embedding_that_renormalises_it_runs_dense():
    _check_dense(HVHead("at", tied="max_norm_t").eval(), _ids(0), "writes the head's weight")


def test_hv_head_whose_columns_are_read_by_ids_runs_dense():
    _check_dense(HVHead("at", tied="columns").eval(), _ids(0), "not a lookup nanospec can observe")


def test_hv_weight_computed_in_the_graph_runs_dense():
    class Computed(HVHead):
        def forward(self, ids):
            return torch.tanh(self.body(self.embed(ids))) @ (self.W * 2)

    _check_dense(Computed("at").eval(), _ids(0), "no LM head found")


# ----------------------------------------------------------------------------- weight-only quantised heads
def _graphs_of(model, **options):
    """Compile ``model`` with nanospec, keeping every graph the backend returns (inductor off: FX graphs)."""
    from nanospec_fx.compiler.backend import nanospec_backend

    graphs = []

    def backend(gm, example_inputs):
        compiled = nanospec_backend(gm, example_inputs, options={"inductor": False, "capacity": 16, **options})
        inner = getattr(compiled, "compiled", compiled)
        graphs.append(getattr(inner, "__self__", gm).graph)
        return compiled

    return torch.compile(model, backend=backend), graphs


def _full_matrices(graph: fx.Graph, dtype=torch.float32) -> list[str]:
    """Computed nodes holding a [V, H] float tensor: a dequantised (or parametrised) head built whole."""
    found = []
    for n in graph.nodes:
        v = n.meta.get("val", n.meta.get("example_value"))
        if n.op in ("call_function", "call_method") and isinstance(v, torch.Tensor) and tuple(v.shape) == (V, H) \
                and v.dtype == dtype:
            found.append(n.name)
    return found


QUANT_FORMS = {  # scale before the matmul (per row, in every spelling, per tensor) or after it
    "row_none": lambda h, m: F.linear(h, m.q.to(h.dtype) * m.s[:, None], m.b),
    "row_unsqueeze": lambda h, m: F.linear(h, m.q.to(h.dtype) * m.s.unsqueeze(-1), m.b),
    "row_view": lambda h, m: F.linear(h, m.s.view(-1, 1) * m.q.float(), m.b),
    "row_col_buffer": lambda h, m: F.linear(h, m.q.to(h.dtype) * m.s_col, m.b),
    "row_type_as": lambda h, m: F.linear(h, m.q.type_as(h) * m.s[:, None], m.b),
    "tensor": lambda h, m: F.linear(h, m.q.to(h.dtype) * m.s0, m.b),
    "after": lambda h, m: F.linear(h, m.q.to(h.dtype)) * m.s + (0 if m.b is None else m.b),
}
QDTYPES = {"int8": torch.int8, "fp8": getattr(torch, "float8_e4m3fn", None)}


class QuantHead(nn.Module):
    """Embedding -> tiny body -> a weight-only quantised head: ``q`` [V, H] int8/float8, ``s`` [V] per-row scale."""

    def __init__(self, form: str, qdtype: torch.dtype, bias: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        w = torch.randn(V, H)
        scale = w.abs().amax(1) / (127 if qdtype == torch.int8 else 200)
        q = w / scale[:, None]
        self.register_buffer("q", (q.round() if qdtype == torch.int8 else q).to(qdtype))
        self.register_buffer("s", scale)
        self.register_buffer("s_col", scale[:, None].clone())
        self.register_buffer("s0", torch.tensor(0.01))
        self.b = nn.Parameter(torch.randn(V)) if bias else None

    def forward(self, ids):
        return QUANT_FORMS[self.form](torch.tanh(self.body(self.embed(ids))), self)


@pytest.mark.parametrize("form,qdtype,bias", [(f, q, (i + j) % 2 == 1) for i, f in enumerate(QUANT_FORMS)
                                              for j, q in enumerate(QDTYPES)])
def test_quantised_head_is_rewritten_on_its_active_rows(form, qdtype, bias):
    if QDTYPES[qdtype] is None:
        pytest.skip("this torch has no float8_e4m3fn")
    model = QuantHead(form, QDTYPES[qdtype], bias).eval()
    compiled, graphs = _graphs_of(model)
    state = _check_exact(model, compiled, FED, only=FED)
    assert state.is_weight(model.q) and state.cache_w.dtype == QDTYPES[qdtype]  # the quantised rows are cached
    assert graphs and not any(_full_matrices(g) for g in graphs), "the whole [V, H] weight was dequantised"
    _check_exact(model, compiled, _ids(1))


def test_quantised_head_follows_new_weights_and_scales():
    model = QuantHead("row_none", torch.int8).eval()
    compiled = compile_nanospec(model, capacity=16)
    _check_exact(model, compiled, _ids(0))
    with torch.no_grad():
        model.q.neg_()  # the cached int8 rows are stale: refreshed by the version counter
        model.s.mul_(3.0)  # scales are gathered per call
    _check_exact(model, compiled, _ids(0))


def test_scale_broadcast_along_the_hidden_axis_is_not_row_wise():
    """``q * s`` with s [V] and V == H scales columns, not rows: dense with a warning naming why."""
    class Square(QuantHead):
        def forward(self, ids):
            return F.linear(torch.tanh(self.body(self.embed(ids))), self.q.to(torch.float32) * self.s)

    global V  # noqa: PLW0603 - a square head for this one case
    saved, V = V, H
    try:
        model = Square("row_none", torch.int8).eval()
    finally:
        V = saved
    _check_dense(model, torch.tensor([[1, 2, 3]]), "cannot prove that each of its rows")


# ----------------------------------------------------------------------------- parametrised heads
class RowNorm(nn.Module):
    def forward(self, W):
        return W / W.norm(dim=-1, keepdim=True)


class RowScaleShift(nn.Module):
    """Elementwise ops, a [1, H] and a [V, 1] tensor, a reduction over the last axis: every row on its own."""

    def __init__(self):
        super().__init__()
        self.register_buffer("gain", torch.linspace(0.5, 1.5, H)[None, :])

    def forward(self, W):
        centred = W - W.mean(dim=1, keepdim=True)
        return torch.tanh(centred * self.gain) * 2.0 + W.amax(-1, keepdim=True)


class ColumnNorm(nn.Module):
    def forward(self, W):
        return W / W.norm(dim=0, keepdim=True)  # mixes rows: not row-wise


class GlobalScale(nn.Module):
    def forward(self, W):
        return W / W.abs().max()  # a reduction over every row: not row-wise


PARAMETRISATIONS = ("row_norm", "row_scale_shift", "normalize", "weight_norm")


class ParamHead(nn.Module):
    def __init__(self, kind: str, bias: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=bias)
        if kind == "weight_norm":
            self.lm_head = torch.nn.utils.parametrizations.weight_norm(self.lm_head)
        elif kind == "normalize":
            parametrize.register_parametrization(self.lm_head, "weight", _Normalize())
        else:
            parametrize.register_parametrization(self.lm_head, "weight", {
                "row_norm": RowNorm, "row_scale_shift": RowScaleShift, "column_norm": ColumnNorm,
                "global_scale": GlobalScale}[kind]())

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.body(self.embed(ids))))


class _Normalize(nn.Module):
    def forward(self, W):
        return F.normalize(W, dim=-1)


@pytest.mark.parametrize("kind,bias", [(k, i % 2 == 0) for i, k in enumerate(PARAMETRISATIONS)])
def test_row_wise_parametrised_head_computes_only_active_rows(kind, bias):
    model = ParamHead(kind, bias).eval()
    compiled, graphs = _graphs_of(model)
    _check_exact(model, compiled, FED, only=FED)
    assert graphs and not any(_full_matrices(g) for g in graphs), "the whole [V, H] weight was computed"
    with torch.no_grad():  # a write to the stored parameter: the cached rows follow it
        for p in model.lm_head.parametrizations.weight.parameters():
            p.mul_(1.5)
    _check_exact(model, compiled, _ids(1))


@pytest.mark.parametrize("kind", ["column_norm", "global_scale"])
def test_parametrisation_that_is_not_row_wise_runs_dense(kind):
    _check_dense(ParamHead(kind).eval(), _ids(0), "cannot prove that each of its rows")


def test_parametrised_head_with_a_trainable_input_in_grad_mode_runs_dense():
    """weight_norm's g trainable, v frozen: the compact head would give g no gradient, so it stays dense."""
    model = ParamHead("weight_norm").eval()
    model.lm_head.parametrizations.weight.original1.requires_grad_(False)  # v; g (original0) stays trainable
    compiled = compile_nanospec(model)
    ids = _ids(0)
    with pytest.warns(nanospec_fx.NanoSpecWarning, match="needs gradients"):
        out = compiled(ids)
    out.sum().backward()
    g = model.lm_head.parametrizations.weight.original0
    expected = torch.autograd.grad(model(ids).sum(), g)[0]
    torch.testing.assert_close(g.grad, expected)


@pytest.mark.parametrize("drafter", ["hv", "int8"])
def test_target_observer_copies_the_rows_of_a_transposed_or_quantised_drafter_head(drafter):
    """A target observer feeding these drafters' sets copies head rows the drafter's compact head reads."""
    model = (HVHead("at", bias=True) if drafter == "hv" else QuantHead("row_none", torch.int8)).eval()
    compiled = compile_nanospec(model, capacity=32)
    _check_exact(model, compiled, _ids(0))  # the drafter's state exists and is bound
    class Target(HVHead):  # its own forward: Dynamo compiles it apart from the drafter's
        def forward(self, ids):
            return F.linear(torch.tanh(self.body(self.embed(ids))), self.W.t())

    target = Target("at", seed=3).eval()  # any head of V outputs: its top-2 join the drafter's set
    observer = torch.compile(target, backend="nanospec", options={
        "inductor": False, "observe_topk": 2, "vocab": nanospec_fx.active_vocab(compiled)})
    ids = _ids(2)
    with torch.no_grad():
        top2 = target(ids).topk(2, dim=-1).indices
        observer(ids)
    assert nanospec_fx.active_vocab(compiled).contains(top2).all()
    _check_exact(model, compiled, _ids(0))  # the rows the observer copied are the drafter's
