"""Each pass on a small FX graph traced with ``torch.fx`` (no Dynamo, no backend): what it finds, what it
inserts, and what the rewritten graph computes with a real ActiveVocab's tensors."""
from __future__ import annotations

import dataclasses
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from drafters import NoHead, TinyDrafter, TwoHeads
from nanospec_fx.passes import (HeadSelectionError, ObserveInto, StateNodes, find_heads, insert_input_observers,
                                insert_topk_observers, rewrite_head)
from nanospec_fx.kernels.schema import STATE_FIELDS
from nanospec_fx.vocab.state import STATE_TENSORS, ActiveVocab

V, H = 50, 8


class _Tracer(fx.Tracer):
    def is_leaf_module(self, module, name):  # trace through nn.Linear / nn.Embedding to F.linear / F.embedding
        return False


class _Call(nn.Module):
    """The model called with one tensor (the drafters' eager-only ``_mask`` stays out of the graph)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)


def trace(model: nn.Module, example: torch.Tensor) -> fx.GraphModule:
    """A traced graph whose nodes carry their example values (what the passes read), like Dynamo's: recorded under
    torch.no_grad(), the mode the tests run it in (Dynamo records each value in its call's grad mode, and a chain
    step whose operand needs gradients runs the head dense)."""
    root = _Call(model)
    gm = fx.GraphModule(root, _Tracer().trace(root))

    class Record(fx.Interpreter):
        def run_node(self, node):
            node.meta["val"] = value = super().run_node(node)
            return value

    with torch.no_grad():
        Record(gm).run(example)
    return gm


def placeholders(graph: fx.Graph, names: list[str]) -> list[fx.Node]:
    """New trailing placeholders (as the backend adds for the state and the drafter's weight)."""
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    nodes = []
    with graph.inserting_after(last):
        for name in reversed(names):
            nodes.append(graph.placeholder(name))
    return nodes[::-1]


def state_placeholders(graph: fx.Graph) -> StateNodes:
    """Placeholders for an ActiveVocab's tensors, in ``ActiveVocab.tensors()`` order."""
    return StateNodes(*placeholders(graph, list(STATE_TENSORS)))


def observe_into(graph: fx.Graph) -> ObserveInto:
    """Inputs of an observer: the head weight (rows to copy) followed by the state tensors."""
    weight, *state = placeholders(graph, ["head_weight", *STATE_TENSORS])
    return ObserveInto(weight, None, StateNodes(*state), num_pinned=0, vocab_size=V)


def ids(*shape, seed=0):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- find_heads
def test_find_heads_picks_the_projection_that_reaches_the_output():
    torch.manual_seed(0)
    x = ids(1, 4)
    (head,) = find_heads(trace(TinyDrafter(V, H, body_width=V).eval(), x), [x])  # a body layer as wide as V
    assert (head.name, head.vocab_size, head.hidden_size, len(head.nodes)) == ("model.lm_head.weight", V, H, 1)
    assert find_heads(trace(NoHead(H), torch.randn(2, H)), [torch.randn(2, H)]) == []
    both = find_heads(trace(TwoHeads(V, H), x), [x])  # every projection onto the vocabulary is a head
    assert [h.name for h in both] == ["model.head_a.weight", "model.head_b.weight"]
    with pytest.raises(HeadSelectionError, match="no_such.*head_a.*head_b"):
        find_heads(trace(TwoHeads(V, H), x), [x], head="no_such")
    (chosen,) = find_heads(trace(TwoHeads(V, H), x), [x], head="head_b")
    assert chosen.name == "model.head_b.weight"


# ----------------------------------------------------------------------------- rewrite_head
@pytest.mark.parametrize("head,post", [("linear", "softcap"), ("matmul_T_bias", "bias_add"), ("tied", "last_position")])
def test_rewrite_head_computes_the_masked_dense_logits(head, post):
    torch.manual_seed(0)
    model = TinyDrafter(V, H, head=head, post=post).eval()
    x = ids(2, 5)
    gm = trace(model, x)
    (match,) = find_heads(gm, [x])
    nodes = state_placeholders(gm.graph)
    state = ActiveVocab(dict(gm.named_parameters())[match.name] if head != "tied" else model.embed.weight,
                        model.head_bias if head == "matmul_T_bias" else None, capacity=16)
    fake = FakeTensorMode()
    for node in dataclasses.fields(nodes):  # the backend records their (fake) values too
        getattr(nodes, node.name).meta["val"] = fake.from_tensor(getattr(state, node.name), static_shapes=True)
    report = rewrite_head(gm.graph, match, nodes, state.capacity)
    gm.graph.lint()
    gm.recompile()
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.nanospec.scatter_logits.default in targets or torch.ops.nanospec.head_logits.default in targets
    assert report.vocab_size == V and report.projections == 1

    state.observe(torch.tensor([3, 7, 11, 40]))
    mask = state.contains(torch.arange(V))
    with torch.no_grad():
        out = gm(x, *state.tensors())
        expected = model(x, _mask=mask)
    torch.testing.assert_close(out, expected)
    assert torch.isneginf(out[..., ~mask]).all()


@pytest.mark.parametrize("post,masked", [("none", False), ("temperature", True), ("softcap", True)])
def test_rewrite_head_runs_topk_on_compact_logits(post, masked):
    """The log_softmax reads the compact logits; where a post-op may turn the -inf past the count finite (tanh of
    -inf is -1 times the cap) it reads them re-masked with ``ids >= 0``, and only there: the compact logits (cast to
    float) are -inf past the count already. 5 of 8 slots filled, so a mask left out where needed changes values."""
    torch.manual_seed(0)
    model = TinyDrafter(V, H, post=post, returns="log_softmax_topk").eval()
    x = ids(1, 3)
    gm = trace(model, x)
    (match,) = find_heads(gm, [x])
    state = ActiveVocab(model.lm_head.weight, capacity=8)
    nodes = state_placeholders(gm.graph)
    report = rewrite_head(gm.graph, match, nodes, state.capacity)
    gm.recompile()
    assert report.consumers  # the top-k reads compact logits
    remasks = [n for n in nodes.ids.users if n.target is operator.ge]
    assert len(remasks) == masked, gm.code
    state.observe(torch.tensor([1, 5, 9, 20, 33]))
    with torch.no_grad():
        values, indices = gm(x, *state.tensors())
        ref_values, ref_indices = model(x, _mask=state.contains(torch.arange(V)))
    torch.testing.assert_close(values, ref_values)
    assert torch.equal(indices, ref_indices)


# ----------------------------------------------------------------------------- observers
def test_input_observer_sees_token_ids_not_positions():
    torch.manual_seed(0)
    model = TinyDrafter(V, H).eval()
    x = ids(1, 6)
    gm = trace(model, x)
    assert (
        insert_input_observers(gm.graph, observe_into(gm.graph)) == 1
    )  # the token table, not the 16-row position table
    gm.recompile()
    state = ActiveVocab(model.lm_head.weight, capacity=16)
    with torch.no_grad():
        gm(x, state.weight, *state.tensors())
    assert set(state.token_ids().tolist()) == set(x.flatten().tolist())
    rows = state.token_ids()
    torch.testing.assert_close(state.cache_w[: len(rows)], model.lm_head.weight[rows])  # rows copied with the ids


class SlicedHead(nn.Module):
    """A target whose head reads ``hidden[:, -keep:]``, as transformers' ``logits_to_keep``."""

    def __init__(self, keep: int = 1):
        super().__init__()
        self.keep = keep
        self.embed = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)

    def forward(self, x):
        return self.lm_head(self.embed(x)[:, -self.keep:])


@pytest.mark.parametrize("observe_prompt", [False, True])
def test_topk_observer_and_the_positions_a_slice_leaves_out(observe_prompt):
    torch.manual_seed(0)
    target = SlicedHead().eval()
    x = ids(1, 7)
    gm = trace(target, x)
    (match,) = find_heads(gm, [x])
    assert insert_topk_observers(gm.graph, match.nodes, 2, observe_into(gm.graph), observe_prompt=observe_prompt) == 1
    gm.recompile()
    drafter_state = ActiveVocab(target.lm_head.weight, capacity=V)
    with torch.no_grad():
        out = gm(x, drafter_state.weight, *drafter_state.tensors())
        torch.testing.assert_close(out, target(x))  # the target's output is unchanged
        logits = target.lm_head(target.embed(x))[0]
    positions = logits if observe_prompt else logits[-1:]
    assert set(drafter_state.token_ids().tolist()) == set(positions.topk(2, dim=-1).indices.flatten().tolist())


def test_the_state_tensors_are_declared_once():
    """The ops' schema declares the state once (kernels/schema.py): the placeholders the passes create (StateNodes,
    built positionally from the graph's inputs) and the tensors an ActiveVocab hands a graph (``tensors()``) follow
    its order, and each tensor at a field's position is what the declaration says that field is."""
    assert tuple(StateNodes.__dataclass_fields__) == STATE_TENSORS
    weight = torch.randn(V, H)
    state = ActiveVocab(weight, capacity=4)
    state.observe([7, 3])
    handed = state.tensors()
    assert len(handed) == len(STATE_FIELDS)
    sizes = {"C": 4, "V": V, "H": H}
    for field, tensor in zip(STATE_FIELDS, handed):
        assert tensor.dtype == (field.dtype or weight.dtype), f"{field.name}: {tensor.dtype}"
        shape = [sizes[d] if d in sizes else int(d) for d in field.shape.strip("[]").split(", ")]
        assert list(tensor.shape) == shape, f"{field.name}: {tuple(tensor.shape)}, declared {field.shape}"
    at = dict(zip(STATE_TENSORS, handed))  # by position, as a graph receives them
    assert at["ids"][:2].tolist() == [7, 3] and at["ids"][2:].tolist() == [-1, -1]  # slot -> token id
    assert at["slot_of"][[7, 3, 0]].tolist() == [0, 1, -1]  # token id -> slot, -1 inactive
    assert at["cursor"].tolist() == [2]
    torch.testing.assert_close(at["cache_w"][:2], weight[[7, 3]])  # head rows in slot order
