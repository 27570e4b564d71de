"""A LoRA delta on the head is one head over one active set (issue 40, item 2).

``lm_head(h) + B(A(h)) * s``, and PEFT's ``lora.Linear`` wrapping ``lm_head`` (a stand-in with its structure:
``base_layer``, ``lora_A``/``lora_B``/``lora_dropout`` ModuleDicts keyed by adapter, a ``scaling`` dict; peft need not
be installed): column v of the sum is token v's alone, so one set makes it exact. Two full heads added, or a delta
whose logits are read elsewhere, are not deltas: they run dense with the heads-meet warning. Oracle (independent of
the pass): the eager model's logits with -inf at the tokens the set does not hold.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import nanospec_fx
from helpers import compile_nanospec
from nanospec_fx.vocab import reports as pass_reports
from nanospec_fx.passes import StateNodes, find_heads, rewrite_head
from nanospec_fx.vocab.state import STATE_TENSORS, ActiveVocab

V, H, R = 40, 8, 2
IDS = torch.tensor([[5, 17, 23], [9, 31, 2]])


class LoraLinear(nn.Module):
    """PEFT ``lora.Linear``'s structure and forward (every adapter's delta added to the base layer's output)."""

    def __init__(self, base: nn.Linear, adapters: dict[str, int], seed: int = 1):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.base_layer = base
        self.lora_A = nn.ModuleDict({n: nn.Linear(base.in_features, r, bias=False) for n, r in adapters.items()})
        self.lora_B = nn.ModuleDict({n: nn.Linear(r, base.out_features, bias=False) for n, r in adapters.items()})
        self.lora_dropout = nn.ModuleDict({n: nn.Dropout(0.1) for n in adapters})
        self.scaling = {n: 8 / r for n, r in adapters.items()}
        for b in self.lora_B.values():  # PEFT starts B at zero; a trained adapter is not
            nn.init.normal_(b.weight, generator=g)

    def forward(self, x):
        result = self.base_layer(x)
        for name in self.lora_A:
            result = result + self.lora_B[name](self.lora_A[name](self.lora_dropout[name](x))) * self.scaling[name]
        return result


class Drafter(nn.Module):
    """Embedding -> tanh -> a head with a LoRA delta in one of the forms under test."""

    def __init__(self, form: str, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, H)
        self.form = form
        if form.startswith("peft"):
            adapters = {"default": R, "second": 3} if form == "peft_two_adapters" else {"default": R}
            self.lm_head = LoraLinear(nn.Linear(H, V, bias=form != "peft_no_bias"), adapters)
        else:
            self.lm_head = nn.Linear(H, V)
            self.A = nn.Linear(H, R if form != "two_full_heads" else H, bias=False)
            self.B = nn.Linear(R if form != "two_full_heads" else H, V, bias=form == "delta_bias")

    def forward(self, ids):
        h = torch.tanh(self.embed(ids))
        if self.form.startswith("peft"):
            return self.lm_head(h)
        if self.form == "two_full_heads":  # a second head of full rank: no delta
            return self.lm_head(h) + self.B(h)
        delta = self.B(self.A(h))
        if self.form == "delta_read_elsewhere":  # the delta's own logits are an output too
            return self.lm_head(h) + delta * 0.5, delta
        return self.lm_head(h) + delta * 0.5 if self.form != "scale_first" else 0.5 * delta + self.lm_head(h)


LORA_FORMS = ["plain", "scale_first", "delta_bias", "peft", "peft_no_bias", "peft_two_adapters"]


@pytest.mark.parametrize("form", LORA_FORMS)
def test_a_lora_delta_is_one_head_of_one_set(form):
    model = Drafter(form).eval()
    compiled = compile_nanospec(model, capacity=16)
    with torch.no_grad():
        out = compiled(IDS)  # no warning (a NanoSpecWarning is an error in the tests)
        dense = model(IDS)
    state = nanospec_fx.active_vocab(compiled)
    (report,) = pass_reports.reports(state)
    assert report.head.endswith("weight") and "lora_B" not in report.head and report.head != "B.weight"
    active = state.contains(torch.arange(V))
    assert active[IDS.flatten()].all() and not active.all()
    torch.testing.assert_close(out, dense.masked_fill(~active, float("-inf")), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["two_full_heads", "delta_read_elsewhere"])
def test_heads_that_are_no_lora_delta_stay_dense_with_a_warning(form):
    model = Drafter(form).eval()
    compiled = compile_nanospec(model, capacity=16)
    with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning, match="two heads are combined"):
        out = compiled(IDS)
    torch.testing.assert_close(out, model(IDS))


def _trace(model: nn.Module) -> torch.fx.GraphModule:
    """A torch.fx graph of ``model`` through its nn.Linear layers, each node with its value (what passes read)."""

    class Tracer(torch.fx.Tracer):
        def is_leaf_module(self, module, name):
            return False

    gm = torch.fx.GraphModule(model, Tracer().trace(model))

    class Record(torch.fx.Interpreter):
        def run_node(self, node):
            node.meta["val"] = value = super().run_node(node)
            return value

    Record(gm).run(IDS)
    return gm


@pytest.mark.parametrize("form", ["plain", "peft_two_adapters"])
def test_the_delta_reads_only_the_rows_of_b_at_the_active_set(form):
    """On the graph (as the backend's copy holds it): one head, and each delta's projection becomes one over the rows
    of B gathered at the set's slots; no projection reads all V rows of B."""
    model = Drafter(form).eval()
    gm = _trace(model)
    (head,) = find_heads(gm, [IDS])
    bs = [n for n in gm.graph.nodes if n.op == "get_attr" and "lora_B" in n.target or n.target == "B.weight"]
    assert len(bs) == (2 if form == "peft_two_adapters" else 1) and head.weight not in bs
    weights = dict(gm.named_parameters())
    state = ActiveVocab(weights[head.name], weights[head.name.replace("weight", "bias")], capacity=16)
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        nodes = StateNodes(*[gm.graph.placeholder(f"state_{n}") for n in reversed(STATE_TENSORS)][::-1])
    fake = FakeTensorMode()
    for f in dataclasses.fields(nodes):
        getattr(nodes, f.name).meta["val"] = fake.from_tensor(getattr(state, f.name), static_shapes=True)
    rewrite_head(gm.graph, head, nodes, state.capacity)
    gm.graph.lint()
    gm.recompile()
    for w in bs:  # B is read only by the row gather
        assert {u.target for u in w.users} == {torch.index_select}
    state.observe(torch.tensor([3, 7, 11, 39]))
    active = state.contains(torch.arange(V))
    with torch.no_grad():
        out = gm(IDS, *state.tensors())
        expected = model(IDS).masked_fill(~active, float("-inf"))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


class LoopDrafter(nn.Module):
    """A LoRA head called ``steps`` times in ``forward``: a draft loop (each step's argmax embedded and fed back) or
    MTP depths (each depth reads the given ids, no step reads another's logits). ``delta_of="earlier"``: each later
    step adds the delta of the step before's hidden state (no one call's own). ``oracle``: the eager model with the
    contract's masking (-inf outside the set at each step; a fed-back id joins it for every later step)."""

    def __init__(self, steps: int = 2, loop: bool = True, delta_of: str = "own"):
        super().__init__()
        torch.manual_seed(3)
        self.steps, self.loop, self.delta_of = steps, loop, delta_of
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.lm_head = LoraLinear(nn.Linear(H, V), {"default": R})

    def forward(self, ids, oracle=None):
        h = torch.tanh(self.body(self.embed(ids)))[:, -1]
        before, outs = h, []
        for step in range(self.steps):
            if self.delta_of == "earlier" and step:
                lora = self.lm_head
                z = lora.base_layer(h) + lora.lora_B["default"](lora.lora_A["default"](before)) * lora.scaling["default"]
            else:
                z = self.lm_head(h)
            if oracle is not None:
                z = z.masked_fill(~oracle, float("-inf"))
            outs.append(z)
            nxt = z.argmax(-1) if self.loop else ids[:, step]
            if oracle is not None and self.loop:
                oracle = oracle.clone()
                oracle[nxt] = True
            before, h = h, torch.tanh(self.body(self.embed(nxt)) + h)
        return torch.stack(outs, 1)


@pytest.mark.parametrize("steps,loop", [(2, True), (3, True), (2, False)])
def test_each_call_of_a_lora_head_adds_its_own_delta(steps, loop):
    """Each step's delta is read over the set as that step's head reads it (a draft loop's later step is computed
    from the earlier ones' logits: its delta belongs to it alone); rewritten, no warning."""
    model = LoopDrafter(steps, loop).eval()
    compiled = compile_nanospec(model, capacity=16)
    with torch.no_grad():
        out = compiled(IDS)
    seed = torch.zeros(V, dtype=torch.bool)
    seed[IDS.flatten()] = True
    with torch.no_grad():
        expected = model(IDS, oracle=seed)
    (report,) = pass_reports.reports(nanospec_fx.active_vocab(compiled))
    assert "lora_B" not in report.head and not torch.isneginf(out[:, 0, IDS[0]]).any()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_delta_that_is_no_one_calls_own_runs_dense_with_a_warning():
    """A draft loop's second step adding the delta of the first step's hidden state: its sum is computed from both
    calls and its input is the last one's no longer; dense with the reason, never a crash."""
    model = LoopDrafter(2, loop=True, delta_of="earlier").eval()
    compiled = compile_nanospec(model, capacity=16)
    with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning, match="LoRA delta") as caught:
        out = compiled(IDS)
    assert sum(issubclass(w.category, nanospec_fx.NanoSpecWarning) for w in caught) == 1
    with torch.no_grad():
        torch.testing.assert_close(out, model(IDS))


class TwoHeadsLoop(nn.Module):
    """Two heads of their own weights, each with a LoRA delta, the second fed the first's argmax (MTP depths with a
    head each, drafting in ``forward``). ``masks``: the oracle's, one per head (-inf outside its set)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)
        self.first = LoraLinear(nn.Linear(H, V), {"default": R}, seed=2)
        self.second = LoraLinear(nn.Linear(H, V), {"default": R}, seed=3)

    def forward(self, ids, masks=(None, None)):
        h = torch.tanh(self.body(self.embed(ids)))[:, -1]
        z1 = self.first(h)
        if masks[0] is not None:
            z1 = z1.masked_fill(~masks[0], float("-inf"))
        z2 = self.second(torch.tanh(self.body(self.embed(z1.argmax(-1)))))
        if masks[1] is not None:
            z2 = z2.masked_fill(~masks[1], float("-inf"))
        return z1, z2


def test_a_later_heads_delta_is_read_over_that_heads_set():
    """The second head's delta is computed from the first head's logits too (through the argmax): it is the second
    head's, read over its set, not the first's (which holds other tokens here)."""
    model = TwoHeadsLoop().eval()
    compiled = compile_nanospec(model, capacity=16)
    with torch.no_grad():
        compiled(IDS)
        nanospec_fx.active_vocab(model.second.base_layer.weight).observe(torch.tensor([0, 1, 4, 6, 7, 8]))
        nanospec_fx.active_vocab(model.first.base_layer.weight).observe(torch.tensor([36, 37]))
        out = compiled(IDS)
        masks = tuple(nanospec_fx.active_vocab(m.base_layer.weight).contains(torch.arange(V))
                      for m in (model.first, model.second))
        expected = model(IDS, masks)
    assert not torch.equal(*masks)
    for got, want in zip(out, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
