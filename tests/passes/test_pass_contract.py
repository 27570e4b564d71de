"""The pass against the contract (README, passes/__init__.py), one defect class per test.

Each drafter here applies the contract's mask itself, at the end of its own chain (``_chain_end``):
the test knows where the chain ends because it wrote the program, so the oracle shares nothing with
the pass. After that point everything is plain IEEE arithmetic on the masked logits. A case passes
when the compiled drafter equals that oracle (and every id fed is active), or when it warns once and
equals the dense drafter.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanospec_fx
from helpers import compile_nanospec
from nanospec_fx.vocab import reports as pass_reports
V, H = 48, 8
NEG = float("-inf")


def _chain_end(z: torch.Tensor, mask: torch.Tensor | None, axis: int = -1) -> torch.Tensor:
    """The oracle's mask, applied once where the chain ends (vocabulary along ``axis``)."""
    if mask is None:
        return z
    shape = [1] * z.dim()
    shape[axis] = -1
    return z.masked_fill(~mask.view(shape), NEG)


class Drafter(nn.Module):
    def __init__(self, tied: bool = False, max_norm: float | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H, max_norm=max_norm)
        self.body = nn.Linear(H, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("ban", torch.tensor([2, 5]))

    def hidden(self, ids):
        return torch.tanh(self.body(self.embed(ids)))


def _active(model) -> torch.Tensor:
    state = nanospec_fx.active_vocab(model)
    return state.contains(torch.arange(state.vocab_size))


def _run(model, *args, options=None):
    """(compiled output, oracle output, NanoSpecWarnings) with a fresh compile."""
    compiled = compile_nanospec(model, capacity=32, **(options or {}))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(*args)
        oracle = model(*args, mask=_active(model))
    return out, oracle, [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]


def _close(a, b):
    if isinstance(a, (tuple, list)):
        for x, y in zip(a, b):
            _close(x, y)
        return
    torch.testing.assert_close(a, b, equal_nan=True)


IDS = torch.tensor([[3, 7, 11, 13]])


# ----------------------------------------------------------------------------- views inside the chain (class 4)
class ViewThenSoftcap(Drafter):
    def __init__(self, view):
        super().__init__()
        self.view = view

    def forward(self, ids, mask=None):
        z = self.lm_head(self.hidden(ids))  # [1, S, V]
        axis = -1
        if self.view == "flatten":
            z = z.flatten(0, 1)
        elif self.view == "view_n":
            z = z.view(ids.numel(), -1)
        elif self.view == "transpose":
            z, axis = z.transpose(1, 2), 1
        elif self.view == "permute":
            z, axis = z.permute(2, 0, 1), 0
        elif self.view == "mT":
            z, axis = z.mT, 1
        elif self.view == "last":
            z = z[..., -1, :]
        elif self.view == "squeeze":
            z = z.squeeze(0)
        z = 2.0 * torch.tanh(z / 2.0)
        z = z.clamp(min=-1.5)
        return _chain_end(z, mask, axis)


@pytest.mark.parametrize("view", ["flatten", "view_n", "transpose", "permute", "mT", "last", "squeeze"])
def test_column_keeping_views_keep_inactive_tokens_at_minus_inf_through_later_post_ops(view):
    out, oracle, warned = _run(ViewThenSoftcap(view).eval(), IDS)
    assert not warned
    _close(out, oracle)


# ----------------------------------------------------------------------------- after a normalisation (class 5)
class AfterNormalisation(Drafter):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, ids, mask=None):
        z = _chain_end(self.lm_head(self.hidden(ids)) / 0.7, mask)  # the chain: head, temperature
        if self.kind == "exp_log_softmax":
            return torch.log_softmax(z, -1).exp()
        if self.kind == "neg_log_softmax":
            return -torch.log_softmax(z, -1)
        if self.kind == "entropy":
            p = torch.softmax(z, -1)
            return -(p * torch.log(p)).sum(-1)
        if self.kind == "clamp_finfo":
            return torch.log_softmax(z, -1).clamp(min=torch.finfo(z.dtype).min)
        if self.kind == "lse":
            return (z - z.logsumexp(-1, keepdim=True)).exp()
        if self.kind == "categorical":
            return torch.distributions.Categorical(logits=z).entropy()
        if self.kind == "exp_":
            p = torch.log_softmax(z, -1)
            return p.exp_()
        if self.kind == "typical":  # transformers' TypicalLogitsWarper, written out
            normalized = F.log_softmax(z, dim=-1)
            p = torch.exp(normalized)
            ent = -(normalized * p).nansum(-1, keepdim=True)
            shifted = torch.abs((-normalized) - ent)
            sorted_scores, sorted_indices = torch.sort(shifted, descending=False)
            cumulative = z.gather(-1, sorted_indices).softmax(dim=-1).cumsum(dim=-1)
            last_ind = (cumulative < 0.9).sum(dim=-1)
            last_ind.clamp_(max=z.shape[-1] - 1)
            remove = sorted_scores > sorted_scores.gather(-1, last_ind.unsqueeze(-1))
            remove[..., :1] = False
            return z.masked_fill(remove.scatter(-1, sorted_indices, remove), NEG)
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["exp_log_softmax", "neg_log_softmax", "entropy", "clamp_finfo", "lse", "categorical",
                                  "exp_", "typical"])
def test_after_a_normalisation_the_rest_is_plain_arithmetic(kind):
    out, oracle, warned = _run(AfterNormalisation(kind).eval(), IDS)
    assert not warned
    _close(out, oracle)


# ----------------------------------------------------------------------------- lookups (classes 3, 14)
class Lookup(Drafter):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.register_buffer("held", torch.tensor([[17, 19]]))
        self.padded = torch.randn(V + 5, H)  # a plain tensor attribute, no parameter or buffer: still a table

    def embed_ids(self, ids):
        E = self.embed.weight
        k = self.kind
        if k == "index_select":
            return E.index_select(0, ids.flatten()).view(*ids.shape, H)
        if k == "torch_index_select":
            return torch.index_select(E, 0, ids.flatten()).view(*ids.shape, H)
        if k == "gather":
            flat = ids.flatten()
            return E.gather(0, flat[:, None].expand(-1, H)).view(*ids.shape, H)
        if k == "one_hot":
            return F.one_hot(ids, V).float() @ E
        if k == "embedding_bag":
            return F.embedding_bag(ids, E, mode="sum")[:, None, :]
        if k == "functional":
            return F.embedding(ids, E)
        if k == "index":
            return E[ids]
        if k == "literal_list":
            return self.embed(ids) + self.embed(torch.tensor([29, 31])).sum(0)
        if k == "literal_int":
            return self.embed(ids) + E[23]
        if k == "buffer":
            return self.embed(ids) + self.embed(self.held).sum(1, keepdim=True)
        if k == "take":
            return torch.take(E, ids * H)[..., None].expand(*ids.shape, H)
        if k == "eq_one_hot":  # a one-hot written by hand: nanospec cannot read its ids
            return (ids[..., None] == torch.arange(V)).to(E.dtype) @ E
        if k == "eq_one_hot_attribute":  # the same over a padded table held as a plain attribute (no axis of V)
            return (ids[..., None] == torch.arange(V + 5)).to(E.dtype) @ self.padded
        raise AssertionError(k)

    def forward(self, ids, mask=None):
        z = self.lm_head(torch.tanh(self.body(self.embed_ids(ids))))
        return _chain_end(z, mask)


@pytest.mark.parametrize("kind", ["index_select", "torch_index_select", "gather", "one_hot", "embedding_bag",
                                  "functional", "index", "literal_list", "literal_int", "buffer"])
def test_every_lookup_kind_is_observed_before_the_head_reads_the_set(kind):
    model = Lookup(kind).eval()
    out, oracle, warned = _run(model, IDS)
    assert not warned
    fed = {"literal_list": [29, 31], "literal_int": [23], "buffer": [17, 19]}.get(kind, [])
    assert nanospec_fx.active_vocab(model).contains(IDS.flatten().tolist() + fed).all()
    _close(out, oracle)


@pytest.mark.parametrize("kind, op", [("take", "take"), ("eq_one_hot", "matmul"), ("eq_one_hot_attribute", "matmul")])
def test_a_lookup_nanospec_cannot_read_leaves_the_head_dense_and_says_which(kind, op):
    model = Lookup(kind).eval()
    compiled = compile_nanospec(model, capacity=32)
    with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning, match=rf"runs dense: {op} \("):
        out = compiled(IDS)
    torch.testing.assert_close(out, model(IDS))


class CondLookup(Drafter):
    def forward(self, ids, mask=None):
        def yes(i, e):
            return F.embedding(i, e)

        def no(i, e):
            return F.embedding(i, e) * 2.0

        h = torch.cond(ids.sum() > 0, yes, no, (ids, self.embed.weight))
        return _chain_end(self.lm_head(torch.tanh(self.body(h))), mask)


def test_a_lookup_inside_torch_cond_leaves_the_head_dense():
    model = CondLookup().eval()
    compiled = compile_nanospec(model, capacity=32)
    with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning, match="runs dense"):
        out = compiled(IDS)
    torch.testing.assert_close(out, model(IDS))


# ----------------------------------------------------------------------------- head before the ids (class 2)
class HeadFirst(Drafter):
    def __init__(self, brk):
        super().__init__()
        self.brk = brk
        self.pre = nn.Linear(H, H)

    def breaks(self, t):
        if self.brk == "item":
            return t + float(t.sum().item()) * 0.0
        if self.brk == "print":
            print("drafting")
            return t
        if self.brk == "branch":
            return t * 2.0 if t.sum() > 1e9 else t
        return t

    def forward(self, ids, prev, mask=None):
        z = self.lm_head(self.pre(prev)) / 0.8
        z = z.masked_fill(torch.isin(torch.arange(V), self.ban), NEG)
        z = _chain_end(z, mask)
        p = torch.softmax(z, -1)
        p = self.breaks(p)
        h = self.hidden(ids)
        return p, h


@pytest.mark.parametrize("brk", ["item", "print", "branch"])
def test_a_head_scored_before_a_graph_break_and_the_embedding_stays_dense_naming_the_break(brk):
    model = HeadFirst(brk).eval()
    prev = torch.randn(1, 4, H)
    compiled = compile_nanospec(model, capacity=32)
    with (
        torch.no_grad(),
        pytest.warns(nanospec_fx.NanoSpecWarning, match=r"runs dense: this graph is one piece.*ends at"),
    ):
        out = compiled(IDS, prev)
    _close(out, model(IDS, prev))


def test_a_head_scored_before_the_embedding_in_one_graph_sees_the_ids_of_its_call():
    model = HeadFirst("none").eval()
    prev = torch.randn(1, 4, H)
    out, oracle, warned = _run(model, IDS, prev)
    assert not warned
    assert nanospec_fx.active_vocab(model).contains(IDS).all()
    _close(out, oracle)


class SideTable(Drafter):
    """A table of V/2 rows read at ``extra - 3`` (the shape of a vocabulary-parallel embedding's shard): on one device
    it is no token lookup, so ``extra`` never joins the set."""

    def __init__(self):
        super().__init__()
        self.side = nn.Embedding(V // 2, H)

    def forward(self, ids, extra, mask=None):
        h = torch.tanh(self.body(self.embed(ids) + self.side((extra - 3).clamp(0, V // 2 - 1))))
        z = self.lm_head(h)
        return z if mask is None else z.masked_fill(~mask, float("-inf"))


def test_a_shard_shaped_side_table_on_one_device_observes_nothing():
    model = SideTable().eval()
    extra = torch.tensor([[40, 41, 42, 43]])
    out, oracle, warned = _run(model, IDS, extra)
    assert not warned
    assert torch.equal(torch.nonzero(_active(model)).flatten(), IDS.unique())  # the fed ids, not extra's
    _close(out, oracle)


# ----------------------------------------------------------------------------- grad mode at the head (classes 12, 15)
class EnablesGrad(Drafter):
    def forward(self, ids, mask=None):
        with torch.enable_grad():
            return _chain_end(self.lm_head(self.hidden(ids)), mask)


def test_enable_grad_inside_forward_keeps_a_trainable_head_dense_and_backward_works():
    model = EnablesGrad().eval()
    compiled = compile_nanospec(model, capacity=32)
    with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning, match="needs gradients here"):
        out = compiled(IDS)
    out.sum().backward()
    assert model.lm_head.weight.grad is not None


class NoGradForward(Drafter):
    @torch.no_grad()
    def forward(self, ids, mask=None):
        return _chain_end(self.lm_head(self.hidden(ids)), mask)


def test_a_no_grad_forward_called_in_grad_mode_is_rewritten():
    model = NoGradForward().eval()
    compiled = compile_nanospec(model, capacity=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", nanospec_fx.NanoSpecWarning)
        out = compiled(IDS)
    assert pass_reports.reports(nanospec_fx.active_vocab(model))
    _close(out, model(IDS, mask=_active(model)))


# ----------------------------------------------------------------------------- the head weight written (class 11)
def test_a_max_norm_embedding_tied_to_the_head_leaves_it_dense():
    model = Drafter(tied=True, max_norm=0.5).eval()
    model.forward = lambda ids, mask=None: _chain_end(model.lm_head(model.hidden(ids)), mask)
    compiled = compile_nanospec(model, capacity=32)
    reference = Drafter(tied=True, max_norm=0.5).eval()
    with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning, match="max_norm"):
        out = compiled(IDS)
        expected = reference.lm_head(reference.hidden(IDS))
    torch.testing.assert_close(out, expected)


# ----------------------------------------------------------------------------- a draft loop inside forward (class 8)
class DraftLoop(Drafter):
    """k draft steps in one call, each embedding a token computed from the previous step's argmax."""

    def forward(self, ids, mask=None):
        if mask is not None:  # the oracle's set, as the contract says it is at each head read
            mask = mask.clone()
            mask[ids.flatten()] = True
        h = self.hidden(ids)[:, -1]
        steps = []
        for _ in range(4):
            z = self.lm_head(h) + self.bias_row
            z = _chain_end(z, mask)
            tok = (z.argmax(-1) + 1) % V  # a token the set does not hold yet
            steps.append(z)
            if mask is not None:
                mask[tok] = True
            h = torch.tanh(self.body(self.embed(tok)))
        return torch.stack(steps, 1)

    def __init__(self):
        super().__init__()
        self.bias_row = nn.Parameter(torch.randn(V))


@pytest.mark.parametrize("capacity", [32, 4])
def test_each_step_of_a_draft_loop_reads_the_set_as_it_is_at_that_step(capacity):
    model = DraftLoop().eval()
    ids = torch.tensor([[3, 11]])
    compiled = compile_nanospec(model, capacity=capacity)
    state = nanospec_fx.attach(model, head="lm_head", capacity=capacity)
    before = state.contains(torch.arange(V)).clone()
    with torch.no_grad():
        out = compiled(ids)
        oracle = model(ids, mask=before)
    if capacity >= 8:
        _close(out, oracle)
        return
    # With eviction the oracle's set is the state's at each step: replay the compiled trajectory in
    # eager and check that every finite logit is that token's own, at most `capacity` are finite, and
    # the token fed at the previous step is among them.
    with torch.no_grad():
        h, tok = model.hidden(ids)[:, -1], None
        for k in range(out.shape[1]):
            z = model.lm_head(h) + model.bias_row
            finite = torch.isfinite(out[:, k])
            assert int(finite.sum()) <= capacity
            torch.testing.assert_close(out[:, k][finite], z[finite])
            if tok is not None:
                assert finite[0, tok].all()
            tok = (out[:, k].argmax(-1) + 1) % V
            h = torch.tanh(model.body(model.embed(tok)))


# ----------------------------------------------------------------------------- several models in one process (class 1)
class Plain(Drafter):
    def forward(self, ids, mask=None):
        return _chain_end(self.lm_head(self.hidden(ids)), mask)


def _fresh_plain(seed):
    torch.manual_seed(seed)
    model = Plain().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


@pytest.mark.parametrize("reset_between", [False, True])
def test_instances_and_models_called_alternately_keep_their_own_sets(reset_between):
    a, b = _fresh_plain(1), _fresh_plain(2)  # two instances of one class: they share compiled graphs
    c = Lookup("index").eval()  # another model
    compiled = {m: torch.compile(m, backend="nanospec", options={"inductor": False, "capacity": 32}) for m in (a, b, c)}
    feeds = {a: [[1, 2]], b: [[30, 31]], c: [[40, 41]]}
    with torch.no_grad():
        for _ in range(2):
            for m in (a, b, c):
                if reset_between:
                    torch._dynamo.reset()  # the subject: a user's reset between calls must not mix the sets
                out = compiled[m](torch.tensor(feeds[m]))
                _close(out, m(torch.tensor(feeds[m]), mask=_active(m)))
    for m in (a, b, c):
        others = [t for o in (a, b, c) if o is not m for t in feeds[o][0]]
        state = nanospec_fx.active_vocab(m)
        assert state.contains(feeds[m][0]).all()
        assert not state.contains(others).any(), "ids of another model or instance joined this one's set"


def test_a_compiled_free_function_shared_by_two_drafters_feeds_each_its_own_set():
    a, b = _fresh_plain(3), _fresh_plain(4)

    @torch.compile(backend="nanospec", options={"inductor": False, "capacity": 32})
    def draft(model, ids):
        return torch.softmax(model.lm_head(model.hidden(ids)) / 0.5, -1)

    with torch.no_grad():
        pa = draft(a, torch.tensor([[5, 6]]))
        pb = draft(b, torch.tensor([[7, 8]]))
    for m, p, ids in ((a, pa, [5, 6]), (b, pb, [7, 8])):
        state = nanospec_fx.active_vocab(m)
        assert state.contains(ids).all()
        with torch.no_grad():
            ref = torch.softmax(_chain_end(m.lm_head(m.hidden(torch.tensor([ids]))) / 0.5, _active(m)), -1)
        _close(p, ref)


# ----------------------------------------------------------------------------- elementwise steps by name (class 5)
class ElementwiseSteps(Drafter):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, ids, mask=None):
        z = self.lm_head(self.hidden(ids))
        if self.kind == "softplus":  # an elementwise op outside nanospec's list: torch tags it pointwise
            return _chain_end(F.softplus(z) * 2.0, mask)
        if self.kind == "log1p_then_cap":
            return _chain_end(3.0 * torch.tanh(torch.log1p(z.abs()) / 3.0), mask)
        if self.kind == "min_p":  # a threshold from a reduction: the chain ends at z, plain arithmetic after
            z = _chain_end(z, mask)
            return z.masked_fill(z < z.max(-1, keepdim=True).values - 1.0, NEG)
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["softplus", "log1p_then_cap", "min_p"])
def test_elementwise_steps_torch_tags_pointwise_are_steps_of_the_chain(kind):
    out, oracle, warned = _run(ElementwiseSteps(kind).eval(), IDS)
    assert not warned
    _close(out, oracle)


class WhereOnItsOwnComparison(Drafter):
    def forward(self, ids, mask=None):
        z = self.lm_head(self.hidden(ids))
        return torch.where(z > 0, z, 0.5 * z)  # the chain goes on through the comparison: not provable here


def test_a_step_combining_the_logits_with_a_comparison_of_them_leaves_the_head_dense():
    model = WhereOnItsOwnComparison().eval()
    compiled = compile_nanospec(model, capacity=32)
    with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning, match="runs dense: where"):
        out = compiled(IDS)
    torch.testing.assert_close(out, model(IDS))


# ----------------------------------------------------------------------------- more shapes of the classes (class 14)
class HookedAndCopied(Drafter):
    """A forward hook on the head that edits its output, and ids copied into a buffer before the lookup."""

    def __init__(self, order):
        super().__init__()
        self.order = order
        self.register_buffer("slot", torch.zeros(1, 4, dtype=torch.long))
        self.lm_head.register_forward_hook(lambda mod, inp, out: out * 0.5 + 1.0)
        self.pre = nn.Linear(H, H)

    def forward(self, ids, prev=None, mask=None):
        if self.order == "head_first":
            z = _chain_end(self.lm_head(self.pre(prev)), mask)
            self.slot.copy_(ids)
            return z, self.hidden(self.slot)
        self.slot.copy_(ids)
        return _chain_end(self.lm_head(self.hidden(self.slot)), mask)


def test_a_forward_hook_on_the_head_is_a_step_of_the_chain_and_ids_copied_into_a_buffer_are_observed():
    model = HookedAndCopied("embed_first").eval()
    out, oracle, warned = _run(model, IDS)
    assert not warned
    assert nanospec_fx.active_vocab(model).contains(IDS).all()
    _close(out, oracle)


def test_ids_copied_into_a_buffer_after_the_head_read_leave_it_dense():
    model = HookedAndCopied("head_first").eval()
    prev = torch.randn(1, 4, H)
    compiled = compile_nanospec(model, capacity=32)
    with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning, match="runs dense: the ids looked up"):
        out = compiled(IDS, prev)
    _close(out, model(IDS, prev))


def test_every_instance_that_runs_a_dense_graph_is_told_so():
    a, b = Lookup("take").eval(), Lookup("take").eval()  # one class: Dynamo compiles the graph once
    compiled = {m: torch.compile(m, backend="nanospec", options={"inductor": False, "capacity": 32}) for m in (a, b)}
    for m in (a, b):
        with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning, match="runs dense: take"):
            compiled[m](IDS)


class OutOfPlaceBans(Drafter):
    """Bans written out of place (scatter/index_fill of constants) are steps of the chain, like in-place ones."""

    def forward(self, ids, mask=None):
        z = self.lm_head(self.hidden(ids))
        z = z.scatter(-1, self.ban.expand(*z.shape[:-1], -1), 0.0)
        z = z.index_fill(-1, self.ban + 1, 5.0)
        return _chain_end(2.0 * torch.tanh(z / 2.0), mask)


def test_bans_written_out_of_place_are_steps_of_the_chain():
    out, oracle, warned = _run(OutOfPlaceBans().eval(), IDS)
    assert not warned
    _close(out, oracle)


# ----------------------------------------------------------------------------- elementwise in the form called (class 5)
class ReducedByAnElementwiseName(Drafter):
    """``max``/``min`` are elementwise with two tensors (``aten::max.other`` is tagged pointwise) and a reduction with
    one: ``z.max()`` ends the chain (the oracle's mask is applied to the z it reads), ``torch.max(z, floor)`` is a
    step of it (inactive tokens stay -inf through the soft-cap after it)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.register_buffer("floor", torch.linspace(-0.3, 0.2, V))

    def forward(self, ids, mask=None):
        z = self.lm_head(self.hidden(ids))[:, -1]  # [1, V]
        if self.kind == "stable_softmax":  # the textbook softmax of a batch-1 drafter
            z = _chain_end(z, mask)
            e = torch.exp(z - z.max())
            return e / e.sum()
        if self.kind == "max_returned":
            z = _chain_end(z, mask)
            return z, z.max()
        if self.kind == "min_after_softcap":
            z = _chain_end(2.0 * torch.tanh(z / 2.0), mask)
            return z, torch.min(z)
        if self.kind == "max_other":
            return _chain_end(3.0 * torch.tanh(torch.max(z, self.floor) / 3.0), mask)
        if self.kind == "pow_scalar_base":  # pow with a number base: elementwise in z
            return _chain_end((2.0 ** z).clamp(min=0.5), mask)
        raise AssertionError(self.kind)


@pytest.mark.parametrize("kind", ["stable_softmax", "max_returned", "min_after_softcap", "max_other",
                                  "pow_scalar_base"])
def test_an_op_is_a_step_of_the_chain_only_in_its_elementwise_form(kind):
    out, oracle, warned = _run(ReducedByAnElementwiseName(kind).eval(), IDS)
    assert not warned
    _close(out, oracle)


# ----------------------------------------------------------------------------- operands cast to the logits' dtype (class 6)
class OperandCastLikeTheLogits(Drafter):
    """A [V] operand cast or shaped after the logits (``bias.type_as(z)``: mixed-precision code) is an operand of the
    chain like ``z + bias``: read at the active tokens, and the soft-cap after it keeps inactive tokens at -inf."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        g = torch.Generator().manual_seed(5)
        self.register_buffer("logit_bias", torch.randn(V, generator=g) * 3)

    def forward(self, ids, mask=None):
        z = self.lm_head(self.hidden(ids))
        b = self.logit_bias
        if self.kind == "type_as":
            z = z + b.type_as(z)
        elif self.kind == "to_tensor":
            z = z + b.to(z)
        elif self.kind == "expand_as":
            z = z + b.expand_as(z)
        elif self.kind == "zeros_like":
            z = z + (torch.zeros_like(z) + b)
        elif self.kind == "scale_type_as":
            z = z * (b.abs() + 0.5).type_as(z)
        else:
            raise AssertionError(self.kind)
        return _chain_end(4.0 * torch.tanh(z / 4.0), mask)


@pytest.mark.parametrize("kind", ["type_as", "to_tensor", "expand_as", "zeros_like", "scale_type_as"])
def test_an_operand_cast_or_shaped_like_the_logits_is_read_at_the_active_tokens(kind):
    out, oracle, warned = _run(OperandCastLikeTheLogits(kind).eval(), IDS)
    assert not warned
    _close(out, oracle)


# ----------------------------------------------------------------------------- a copy of the logits is not the logits (class 6)
class WrittenCopy(Drafter):
    """``contiguous``/``reshape``/``to(copy=True)`` return their input, a view of it or a copy, as eager's layout
    allows: a write to a copy never reaches the logits, a write through the input itself does. Both tensors are graph
    outputs (read outside the chain): the oracle masks each where it is returned."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, ids, mask=None):
        z = self.lm_head(self.hidden(ids))  # [2, 4, V]
        k = self.kind
        if k == "dense_alias":  # z materialised by a ban first, then the same tensor under another name
            z[..., self.ban] = NEG
            y = z.float()
            y.mul_(2.0)
            return _chain_end(z, mask), _chain_end(y, mask)
        if k == "contiguous_copy":
            y = z[:, -1].contiguous()  # a copy: z[:, -1] is not contiguous with two rows
        elif k == "reshape_copy":
            y = z[:, -2:].reshape(-1, V)  # no view has this shape: a copy
        elif k == "to_copy":
            y = z[:, -1].to(torch.float32, copy=True)
        elif k == "contiguous_self":
            y = z.contiguous()  # z itself: the ban below is z's too
        elif k == "float_self":
            y = z.float()  # z itself (already float32)
        elif k == "reshape_view":
            y = z.reshape(-1, V)  # a view
        else:
            raise AssertionError(k)
        y.mul_(0.5)  # in place on the compact copy, then the ban materialises it
        y[..., self.ban] = NEG
        return _chain_end(z, mask), _chain_end(y, mask)


IDS2 = torch.tensor([[3, 7, 11, 13], [5, 7, 17, 19]])


@pytest.mark.parametrize("kind", ["contiguous_copy", "reshape_copy", "to_copy", "contiguous_self", "float_self",
                                  "reshape_view", "dense_alias"])
def test_a_write_to_a_copy_of_the_logits_never_reaches_them_and_one_to_an_alias_does(kind):
    out, oracle, warned = _run(WrittenCopy(kind).eval(), IDS2)
    assert not warned
    _close(out, oracle)


# The forms of pointwise-tagged ATen names that torch does not tag (on tensors, out= variants left out). The pass takes
# a call of such a name for an elementwise step when it returns one tensor that drops no axis of its operands
# (patterns.is_elementwise); that holds of exactly the elementwise forms only if every untagged form is elementwise
# (masked_fill.Tensor, rsub.Tensor, true_divide.Scalar, where.Scalar*, xlogy_.Scalar_Other) or returns a tuple or a
# reduced tensor (max/min with one tensor, where(cond)). A torch that adds a form must be read again.
_UNTAGGED_FORMS = {
    "masked_fill.Tensor", "max.default", "max.dim", "min.default", "min.dim", "rsub.Tensor", "true_divide.Scalar",
    "where.ScalarOther", "where.ScalarSelf", "where.Scalar", "where.default", "xlogy_.Scalar_Other",
}


def test_every_untagged_tensor_form_of_a_pointwise_name_is_known():
    found = set()
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        overloads = [(o, getattr(packet, o)) for o in packet.overloads()]
        if not any(torch.Tag.pointwise in op.tags for _, op in overloads):
            continue
        for o, op in overloads:
            args = op._schema.arguments
            out_variant = any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in args)
            if torch.Tag.pointwise not in op.tags and not out_variant and any(str(a.type) == "Tensor" for a in args):
                found.add(f"{name}.{o}")
    assert found == _UNTAGGED_FORMS
