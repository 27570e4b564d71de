"""torch.vmap (and other functorch transforms Dynamo inlines) in a drafter, and Python calls with effects.

Dynamo brackets a transform's ops between calls that enter and leave its level and return nothing
(``_vmap_increment_nesting``/``_vmap_decrement_nesting``): dead-code elimination must keep them (only calls
known to be pure go), and nanospec's ops must not be placed on the transform's batched tensors. A head outside
the transform is rewritten (the transform in the body, or reading the logits); a head inside runs dense with
one warning that names the transform.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nanospec_fx
from helpers import active_mask, compile_nanospec
from nanospec_fx.diagnostics.warning import NanoSpecWarning
from nanospec_fx.vocab import reports as pass_reports
V, H, T = 48, 8, 0.7


class VmapDrafter(nn.Module):
    """Token embedding, a body, a head; ``where`` says which part runs under ``torch.vmap`` (over the batch)."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where
        self.embed = nn.Embedding(V, H)
        self.up = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.register_buffer("scales", torch.tensor([1.0, 2.0]))

    def body(self, h):
        return torch.tanh(self.up(h))

    def forward(self, ids, _mask=None):
        def chain(z):  # the chain ends at the head's temperature; the oracle masks there
            return z if _mask is None else z.masked_fill(~_mask, float("-inf"))

        if self.where == "body":
            h = torch.vmap(self.body)(self.embed(ids))
        elif self.where == "lookup":  # the token lookup itself inside the transform
            h = torch.vmap(lambda i: self.body(self.embed(i)))(ids)
        elif self.where == "ids_inside":  # ids computed inside the transform: nanospec cannot observe them
            h = torch.vmap(lambda i: self.body(self.embed(i.flip(-1))))(ids)
        elif self.where == "head":  # the beam form: the whole drafter, head included, under vmap
            return torch.vmap(lambda i: self.lm_head(self.body(self.embed(i))) / T)(ids)
        else:
            h = self.body(self.embed(ids))
        z = chain(self.lm_head(h) / T)
        if self.where == "reads_batched":  # the logits enter the transform as its batched input
            return torch.vmap(lambda row: row.log_softmax(-1))(z)
        if self.where == "reads_captured":  # the transform reads the logits from its closure
            return torch.vmap(lambda s: (z * s).log_softmax(-1))(self.scales)
        return z


def _run(where: str, ids: torch.Tensor):
    torch.manual_seed(0)
    model = VmapDrafter(where).eval()
    compiled = compile_nanospec(model)
    with torch.no_grad():
        out = compiled(ids)
        dense = model(ids)
    return model, out, dense


@pytest.mark.parametrize("where", ["body", "lookup", "reads_batched", "reads_captured"])
def test_head_outside_the_transform_is_rewritten_and_matches_the_oracle(where):
    ids = torch.tensor([[3, 7, 7, 11], [5, 2, 9, 40]])
    model, out, _ = _run(where, ids)
    state = nanospec_fx.active_vocab(model)
    assert pass_reports.reports(state), "the head was not rewritten"
    mask = active_mask(model)
    assert mask[ids.flatten()].all(), "an id fed to the drafter is not active"
    assert not mask.all()
    with torch.no_grad():
        expected = model(ids, _mask=mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_head_inside_vmap_runs_dense_with_one_warning_naming_it():
    ids = torch.tensor([[3, 7, 11], [5, 2, 9]])
    with pytest.warns(NanoSpecWarning, match=r"runs inside torch\.vmap.*Move the head out of the transform") as got:
        model, out, dense = _run("head", ids)
    assert len([w for w in got if issubclass(w.category, NanoSpecWarning)]) == 1
    torch.testing.assert_close(out, dense)


def test_ids_computed_inside_vmap_run_the_head_dense_with_a_warning():
    ids = torch.tensor([[3, 7, 11], [5, 2, 9]])
    with pytest.warns(NanoSpecWarning, match=r"computed inside torch\.vmap"):
        model, out, dense = _run("ids_inside", ids)
    torch.testing.assert_close(out, dense)


@torch._dynamo.allow_in_graph
def _count_call(counter: torch.Tensor) -> None:
    counter.add_(1)  # a Python call in the graph (no op schema) whose only result is its effect


class CountingDrafter(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, ids):
        _count_call(self.calls)
        return self.lm_head(torch.tanh(self.embed(ids))) / T


def test_python_call_with_an_effect_and_unused_result_is_kept():
    torch.manual_seed(0)
    model = CountingDrafter().eval()
    compiled = compile_nanospec(model)
    ids = torch.tensor([[3, 7, 11]])
    with torch.no_grad():
        compiled(ids)
        compiled(ids)
    assert pass_reports.reports(nanospec_fx.active_vocab(model)), "the head was not rewritten"
    assert int(model.calls) == 2, "the call's effect was eliminated with its unused result"


class VmapTarget(nn.Module):
    """A target scored under torch.vmap over the batch: its head's top-k cannot be observed there."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(V, H), nn.Linear(H, V)

    def forward(self, ids):
        return torch.vmap(lambda i: self.head(self.embed(i).tanh()))(ids)


def test_target_head_inside_vmap_is_not_observed_with_a_warning_and_runs_unchanged():
    torch.manual_seed(0)
    target, drafter = VmapTarget().eval(), VmapDrafter("body").eval()
    state = nanospec_fx.attach(drafter, head="lm_head.weight", capacity=16)
    observer = compile_nanospec(target, observe_topk=2, vocab=state)
    ids = torch.tensor([[3, 7, 11], [5, 2, 9]])
    with torch.no_grad(), pytest.warns(NanoSpecWarning, match=r"target's head .* not observed: it runs inside torch\.vmap"):
        out = observer(ids)
    with torch.no_grad():
        torch.testing.assert_close(out, target(ids), rtol=0, atol=0)


class JvpDrafter(nn.Module):
    """The head under forward-mode AD (``torch.func.jvp``): its logits and their tangent."""

    def __init__(self):
        super().__init__()
        self.embed, self.lm_head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        z, dz = torch.func.jvp(self.lm_head, (h,), (torch.ones_like(h),))
        return z / T, dz


def test_head_inside_jvp_runs_dense_with_a_warning_naming_it():
    torch.manual_seed(0)
    model = JvpDrafter().eval()
    ids = torch.tensor([[3, 7, 11]])
    with torch.no_grad(), pytest.warns(NanoSpecWarning, match=r"runs inside torch\.func\.jvp"):
        out = compile_nanospec(model)(ids)
    with torch.no_grad():
        for got, want in zip(out, model(ids)):
            torch.testing.assert_close(got, want)
