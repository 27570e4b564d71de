"""Medusa heads stacked in one weight (issue 40 item 6): K heads ``[K, V, H]`` (or ``[K, H, V]``) applied by one
``einsum`` or batched ``matmul``/``bmm``, whatever the spelling, with the usual post-ops.

The K heads are one weight, so they read one active set (one state per head weight): ``active_vocab(model)`` is
that state, keyed on the stacked weight. Oracle: the eager drafter with every head's logits masked to the fed ids
(computed here with ``torch.isin``, never by the pass), -inf elsewhere; selections equal eager's over that set.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import nanospec_fx
from helpers import compile_nanospec
from nanospec_fx.testing import assert_equivalent

V, H, K = 50, 16, 3
NEG = float("-inf")


class Stacked(nn.Module):
    """A Medusa drafter whose K heads are one parameter, applied by ``spelling``."""

    def __init__(self, spelling: str, post: str = "logits", bias: bool = False, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.spelling, self.post = spelling, post
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        shape = (K, H, V) if "khv" in spelling else (K, V, H)
        self.W = nn.Parameter(torch.randn(*shape, generator=g) * 0.5)
        self.b = nn.Parameter(torch.randn(K, V, generator=g)) if bias else None
        self.mix = nn.Linear(H, K * H)  # per-head hidden states, for the spellings that take one per head
        self.to(dtype)

    def heads(self, ids):
        h = torch.tanh(self.body(self.embed(ids)))  # [B, T, H]
        last = h[:, -1]  # [B, H]
        s = self.spelling
        if s == "einsum_bh":
            return torch.einsum("bh,kvh->bkv", last, self.W)
        if s == "einsum_bth":
            return torch.einsum("bth,kvh->btkv", h, self.W)
        if s == "einsum_each_own_hidden":  # each head its own hidden state
            hk = self.mix(last).view(-1, K, H).transpose(0, 1)  # [K, B, H]
            return torch.einsum("kbh,kvh->kbv", hk, self.W)
        if s == "einsum_weight_first_khv":
            return torch.einsum("khv,bh->bkv", self.W, last)
        if s == "einsum_ellipsis":
            return torch.einsum("...h,kvh->...kv", h, self.W)
        if s == "matmul_unsqueeze":  # h.unsqueeze(1) @ W.mT: [B, 1, T, H] x [K, H, V] -> [B, K, T, V]
            return torch.matmul(h.unsqueeze(1), self.W.transpose(-1, -2))
        if s == "matmul_stored_khv":  # a stored [K, H, V] weight, no transpose
            return h.unsqueeze(1) @ self.W
        if s == "matmul_2d":  # [B, H] @ [K, H, V] -> [K, B, V]
            return last @ self.W.mT
        if s == "bmm_each_own_hidden":
            hk = self.mix(last).view(-1, K, H).transpose(0, 1)  # [K, B, H]
            return torch.bmm(hk, self.W.transpose(1, 2))
        raise AssertionError(s)

    def forward(self, ids):
        z = self.heads(ids)
        if self.b is not None:  # a [K, V] bias: broadcast along the other axes when V is last and K next to it
            z = z + (self.b if z.shape[-2] == K else self.b[:, None, :])
        if self.post == "logits":
            return z / 0.7
        if self.post == "log_softmax":
            return torch.log_softmax(z / 0.7, dim=-1)
        if self.post == "topk":
            return torch.softmax(z, dim=-1).topk(4, dim=-1)
        if self.post == "argmax":
            return z.argmax(-1)
        raise AssertionError(self.post)


SPELLINGS = ["einsum_bh", "einsum_bth", "einsum_each_own_hidden", "einsum_weight_first_khv", "einsum_ellipsis",
             "matmul_unsqueeze", "matmul_stored_khv", "matmul_2d", "bmm_each_own_hidden"]
IDS = torch.tensor([[3, 9, 27, 40], [5, 9, 11, 47]])


def _run(model, ids=IDS, **options):
    compiled = compile_nanospec(model, capacity=32, **options)
    with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
        warnings.simplefilter("always")
        out, ref = compiled(ids), model(ids)
    said = [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]
    return out, ref, said


def _fed(ids=IDS) -> torch.Tensor:
    return torch.isin(torch.arange(V), ids.flatten())


def _masked(z: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    return z.masked_fill(~active, NEG)


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_stacked_heads_are_rewritten_over_one_set_and_exact(spelling):
    model = Stacked(spelling).eval()
    out, ref, said = _run(model)
    assert not said, said
    state = nanospec_fx.active_vocab(model)
    assert state.weight is model.W and state.stacked and nanospec_fx.active_vocab(model.W) is state
    active = _fed()
    assert state.contains(torch.arange(V)).equal(active)  # the fed ids, nothing else
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isneginf(out[..., ~active]).all()  # every one of the K heads, at every position
    torch.testing.assert_close(out, _masked(ref, active), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("post", ["log_softmax", "topk", "argmax"])
@pytest.mark.parametrize("spelling", ["einsum_bh", "einsum_each_own_hidden", "matmul_unsqueeze"])
def test_post_ops_and_selections_over_the_set(spelling, post):
    model = Stacked(spelling, post=post, bias=True).eval()
    out, _, said = _run(model)
    assert not said, said
    active = _fed()
    with torch.inference_mode():
        z = model.heads(IDS)
        z = _masked(z + (model.b if z.shape[-2] == K else model.b[:, None, :]), active)  # oracle: bias, then mask
    if post == "log_softmax":
        torch.testing.assert_close(out, torch.log_softmax(z / 0.7, -1), rtol=1e-5, atol=1e-5)
    elif post == "topk":
        probs = torch.softmax(z, -1)
        values, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        torch.testing.assert_close(out.values, values[..., :4])
        assert out.indices.equal(order[..., :4]) and active[out.indices].all()
    else:
        assert out.equal(z.argmax(-1)) and active[out].all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_and_dtype(dtype):
    model = Stacked("einsum_bth", bias=True, dtype=dtype).eval()
    out, ref, said = _run(model)
    assert not said, said
    assert out.dtype == ref.dtype == dtype
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out, _masked(ref, _fed()), **tol)


def test_the_set_follows_observe_and_weight_writes():
    """One set for the K heads: an id observed by the user is active in every head; a write to one head's slice of
    the weight is seen at the next call (the cache's K rows per token are refreshed)."""
    model = Stacked("einsum_bh").eval()
    compiled = compile_nanospec(model, capacity=32)
    with torch.inference_mode():
        compiled(IDS)
    state = nanospec_fx.active_vocab(model)
    state.observe([30, 31])
    with torch.no_grad():
        model.W[1, 30].mul_(-2.0)
    ids = IDS[:, :2]
    with torch.inference_mode():
        out, ref = compiled(ids), model(ids)
    active = _fed() | torch.isin(torch.arange(V), torch.tensor([30, 31]))
    torch.testing.assert_close(out, _masked(ref, active), rtol=1e-5, atol=1e-5)


def test_capacity_below_the_fed_ids_keeps_the_newest_and_masks_the_rest():
    model = Stacked("einsum_bh").eval()
    compiled = compile_nanospec(model, capacity=4)
    with torch.inference_mode():
        out, ref = compiled(IDS), model(IDS)
    active = nanospec_fx.active_vocab(model).contains(torch.arange(V))
    assert int(active.sum()) == 4
    torch.testing.assert_close(out, _masked(ref, active), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("post", ["logits", "log_softmax"])
def test_v_not_the_last_output_axis(post):
    """``"bh,kvh->bvk"``: the compact logits keep the slot axis last and are moved where V is; the chain goes on along
    the moved axis (materialised there), so inactive tokens are -inf in every head, before and after the post-op."""
    class Moved(Stacked):
        def forward(self, ids):
            z = torch.einsum("bh,kvh->bvk", torch.tanh(self.body(self.embed(ids)))[:, -1], self.W) / 0.7
            return z if self.post == "logits" else torch.log_softmax(z, dim=1)

    model = Moved("einsum_bh", post=post).eval()
    out, _, said = _run(model)
    assert not said, said
    with torch.inference_mode():
        z = torch.einsum("bh,kvh->bvk", torch.tanh(model.body(model.embed(IDS)))[:, -1], model.W) / 0.7
    z = z.masked_fill(~_fed()[:, None], NEG)
    torch.testing.assert_close(out, z if post == "logits" else torch.log_softmax(z, dim=1), rtol=1e-5, atol=1e-5)


def test_explain_and_assert_equivalent_see_the_stacked_head():
    model = Stacked("einsum_bth", bias=True).eval()
    compiled = compile_nanospec(model, capacity=32)
    with torch.inference_mode():
        compiled(IDS)
    report = nanospec_fx.explain(model, quiet=True)
    assert "W" in str(report) and f"{K} heads stacked" in str(report)
    state = assert_equivalent(model, (IDS,), options={"capacity": 32})
    assert state.stacked and state.weight.shape == (K, V, H)


def test_a_target_observer_feeds_all_k_heads():
    """The target's top-k joins the one set of the stack: every head of the drafter computes it."""
    drafter = Stacked("einsum_bh").eval()
    compiled = compile_nanospec(drafter, capacity=32)
    with torch.inference_mode():
        compiled(IDS)
    state = nanospec_fx.active_vocab(drafter)

    class Target(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(V, H), nn.Linear(H, V)

        def forward(self, ids):
            return self.head(torch.tanh(self.embed(ids)))

    target = Target().eval()
    observer = torch.compile(target, backend="nanospec", options={"observe_topk": 2, "vocab": state,
                                                                   "inductor": False})
    ids = torch.tensor([[1, 2]])
    with torch.inference_mode():
        logits = observer(ids)
    top = logits.topk(2, dim=-1).indices.flatten()
    active = _fed() | torch.isin(torch.arange(V), torch.cat([top, ids.flatten()]))  # its input ids join too
    assert state.contains(torch.arange(V)).equal(active)
    with torch.inference_mode():
        out, ref = compiled(IDS), drafter(IDS)
    torch.testing.assert_close(out, _masked(ref, active), rtol=1e-5, atol=1e-5)


def test_reference_kernels_give_the_same():
    """The compiled graph on the torch reference (``use_kernels("reference")``: whole capacity, no host read)."""
    model = Stacked("einsum_each_own_hidden", bias=True).eval()
    with nanospec_fx.use_kernels("reference"):
        out, ref, said = _run(model)
    assert not said, said
    torch.testing.assert_close(out, _masked(ref, _fed()), rtol=1e-5, atol=1e-5)


def test_under_inductor():
    model = Stacked("einsum_bth", post="log_softmax", bias=True).eval()
    out, ref, said = _run(model, inductor=True)
    assert not said, said
    with torch.inference_mode():
        z = _masked(model.heads(IDS) + model.b, _fed())
    torch.testing.assert_close(out, torch.log_softmax(z / 0.7, -1), rtol=1e-5, atol=1e-5)


def test_training_the_body_through_the_frozen_stack():
    """Grad mode on, the stacked weight frozen (EAGLE-style body training): rewritten, and the body's gradients equal
    eager's through the masked heads."""
    model = Stacked("einsum_bh").train()
    model.W.requires_grad_(False)
    compiled = compile_nanospec(model, capacity=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", nanospec_fx.NanoSpecWarning)  # rewritten, not dense
        out = compiled(IDS)
    assert nanospec_fx.active_vocab(model).stacked
    active = _fed()
    ref = _masked(model(IDS), active)
    assert out.requires_grad and ref.requires_grad
    (g,) = torch.autograd.grad(out[..., active].square().sum(), model.body.weight)
    (want,) = torch.autograd.grad(ref[..., active].square().sum(), model.body.weight)
    torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(out[..., ~active]).all()


@pytest.mark.parametrize("spelling", ["einsum_bh", "einsum_weight_first_khv"])
def test_attach_before_the_first_call(spelling):
    """``attach(model, head="W")`` creates the stacked weight's one set before any call; the compiled graph then reads
    that same state (its ids kept), whichever of [K, V, H] / [K, H, V] the weight is stored as."""
    model = Stacked(spelling).eval()
    state = nanospec_fx.attach(model, head="W", capacity=32)
    assert state.stacked and state.rows == V and state.hidden_size == H
    state.observe([44, 45])
    out, ref, said = _run(model)
    assert not said, said
    assert nanospec_fx.active_vocab(model) is state
    active = _fed() | torch.isin(torch.arange(V), torch.tensor([44, 45]))
    torch.testing.assert_close(out, _masked(ref, active), rtol=1e-5, atol=1e-5)


def test_a_sum_over_positions_is_rewritten():
    """``"bth,kvh->bkv"`` also sums over the positions (the same sum for every token): rewritten over the cache."""
    class SummedOverPositions(Stacked):
        def heads(self, ids):
            return torch.einsum("bth,kvh->bkv", torch.tanh(self.body(self.embed(ids))), self.W)

    model = SummedOverPositions("einsum_bh").eval()
    out, ref, said = _run(model)
    assert not said, said
    torch.testing.assert_close(out, _masked(ref, _fed()), rtol=1e-5, atol=1e-5)


def test_a_stacked_weight_read_otherwise_stays_exact_and_says_why():
    """``"bkh,kvh->bv"`` contracts the stack's K axis too (the heads summed): not read as K heads of one set: dense,
    exact, and one warning naming the stacked weight and the reason."""
    class SummedHeads(Stacked):
        def heads(self, ids):
            last = torch.tanh(self.body(self.embed(ids)))[:, -1]
            return torch.einsum("bkh,kvh->bv", self.mix(last).view(-1, K, H), self.W)

    model = SummedHeads("einsum_bh").eval()
    out, ref, said = _run(model)
    assert len(said) == 1 and "stacked weight W" in said[0] and "not rewrite" in said[0], said
    torch.testing.assert_close(out, ref)


def test_a_longer_call_recompiles_with_dynamic_shapes_and_stays_exact():
    """The second shape makes Dynamo compile a graph with symbolic sizes: the stack is found and exact there too."""
    model = Stacked("matmul_unsqueeze", bias=True).eval()
    compiled = compile_nanospec(model, capacity=32)
    longer = torch.tensor([[3, 9, 27, 40, 41, 2], [5, 9, 11, 47, 0, 1]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", nanospec_fx.NanoSpecWarning)
        with torch.inference_mode():
            compiled(IDS)
            out, ref = compiled(longer), model(longer)
    torch.testing.assert_close(out, _masked(ref, _fed(IDS) | _fed(longer)), rtol=1e-5, atol=1e-5)
