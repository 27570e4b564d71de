"""Which projection is the LM head: by structure, with clear errors and warnings."""
from __future__ import annotations

import pytest
import torch
import torch._inductor.config
from torch._inductor.custom_graph_pass import CustomGraphPass

import nanospec_fx
from drafters import HEAD_KINDS, NoHead, TinyDrafter, TwoHeads
from helpers import active_mask, compile_nanospec
from nanospec_fx.vocab import reports as pass_reports
@pytest.mark.parametrize("head", HEAD_KINDS)
def test_every_head_pattern_is_rewritten(head):
    torch.manual_seed(0)
    model = TinyDrafter(97, 8, head=head).eval()
    compiled = compile_nanospec(model, capacity=8)
    with torch.no_grad():
        compiled(torch.randint(0, 97, (1, 4)))
    (report,) = pass_reports.reports(nanospec_fx.active_vocab(model))
    assert (report.vocab_size, report.hidden_size, report.projections) == (97, 8, 1)
    assert report.observers == 1  # the token embedding, not the position table
    if head == "matmul_T_bias":
        assert "add" in report.post_ops  # the separate bias add runs on the compact logits


def test_body_layer_as_wide_as_the_vocabulary_is_not_the_head():
    torch.manual_seed(0)
    vocab = 64
    model = TinyDrafter(vocab, 8, body_width=vocab).eval()  # up: 8 -> 64 == V, feeds down-projection
    compiled = compile_nanospec(model, capacity=8)
    ids = torch.randint(0, vocab, (2, 3))
    with torch.no_grad():
        out = compiled(ids)
        expected = model(ids, _mask=active_mask(model))
    (report,) = pass_reports.reports(nanospec_fx.active_vocab(model))
    assert report.head == "lm_head.weight"
    torch.testing.assert_close(out, expected)


def test_no_head_runs_unchanged_and_warns_once():
    model = NoHead(8).eval()
    compiled = compile_nanospec(model)
    x = torch.randn(3, 8)
    with pytest.warns(nanospec_fx.NanoSpecWarning, match="no LM head found"):
        out = compiled(x)
    torch.testing.assert_close(out, model(x))


def test_two_heads_over_the_vocabulary_are_both_rewritten():
    torch.manual_seed(0)
    model = TwoHeads(50, 8).eval()
    ids = torch.randint(0, 50, (1, 3))
    with torch.no_grad():
        a, b = compile_nanospec(model, capacity=8)(ids)
    for head, z in (("head_a", a), ("head_b", b)):
        active = active_mask(model, head=head)
        assert active[ids].all()
        torch.testing.assert_close(z, getattr(model, head)(model.embed(ids)).masked_fill(~active, float("-inf")))


def test_head_option_settles_the_choice():
    torch.manual_seed(0)
    model = TwoHeads(50, 8).eval()
    compiled = compile_nanospec(model, head="head_b", capacity=8)
    ids = torch.randint(0, 50, (1, 3))
    with torch.no_grad():
        a, b = compiled(ids)
    torch.testing.assert_close(a, model.head_a(model.embed(ids)))  # untouched
    state = nanospec_fx.active_vocab(model)
    assert pass_reports.reports(state)[0].head == "head_b.weight"
    assert torch.isneginf(b[..., ~state.contains(torch.arange(50))]).all()


def test_vocab_size_option_filters_projections():
    model = TinyDrafter(60, 8).eval()
    with pytest.warns(nanospec_fx.NanoSpecWarning, match="no LM head found"):
        compile_nanospec(model, vocab_size=61)(torch.randint(0, 60, (1, 2)))


def test_grad_mode_with_trainable_head_stays_dense_and_says_so():
    torch.manual_seed(0)
    model = TinyDrafter(80, 8).train()
    compiled = compile_nanospec(model)
    ids = torch.randint(0, 80, (1, 4))
    with pytest.warns(nanospec_fx.NanoSpecWarning, match="needs gradients"):
        out = compiled(ids)
    torch.testing.assert_close(out, model(ids))
    out.sum().backward()
    assert model.lm_head.weight.grad is not None


@pytest.mark.parametrize("options, message", [
    ({"capacity": 0}, "capacity"),
    ({"capacity": "big"}, "capacity"),
    ({"observe_inputs": "yes"}, "observe_inputs"),
    ({"capcity": 10}, "unknown nanospec option"),
])
def test_bad_options_raise_clearly(options, message):
    model = TinyDrafter(40, 8).eval()
    with pytest.raises(Exception, match=message):
        compile_nanospec(model, **options)(torch.randint(0, 40, (1, 2)))


class _SeeInductorConfig(CustomGraphPass):
    """A post-grad pass given as an inductor option: inductor runs it while it compiles a graph; it records the
    inductor config in force then, and whether the graph calls nanospec's ops (the rewritten head)."""

    def __init__(self):
        self.seen: list[tuple[bool, bool]] = []

    def __call__(self, graph):
        calls_nanospec = any(str(getattr(n.target, "namespace", "")) == "nanospec" for n in graph.nodes)
        self.seen.append((torch._inductor.config.fallback_random, calls_nanospec))

    def uuid(self):
        return None  # no cache key: inductor compiles (and runs this pass) every time


def test_inductor_options_pass_through():
    """Keys nanospec does not own reach inductor as config patches: inductor runs the post-grad pass the option
    names, with the other option (fallback_random, off by default) in force; the patch ends with the compile."""
    torch.manual_seed(0)
    model = TinyDrafter(40, 8).eval()
    see = _SeeInductorConfig()
    compiled = compile_nanospec(model, capacity=8, inductor=True, fallback_random=True, post_grad_custom_post_pass=see)
    ids = torch.randint(0, 40, (1, 3))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), model(ids, _mask=active_mask(model)))
    assert see.seen == [(True, True)], f"(fallback_random, rewritten) per graph inductor compiled: {see.seen}"
    assert torch._inductor.config.fallback_random is False and torch._inductor.config.post_grad_custom_post_pass is None


def test_position_table_with_vocabulary_rows_is_not_observed():
    torch.manual_seed(0)
    model = TinyDrafter(16, 8).eval()  # V == rows of the position table (16)
    compiled = compile_nanospec(model, capacity=8)
    with torch.no_grad():
        compiled(torch.tensor([[9, 11]]))
    state = nanospec_fx.active_vocab(model)
    assert pass_reports.reports(state)[-1].observers == 1
    assert sorted(state.token_ids().tolist()) == [9, 11]  # positions 0 and 1 did not join


def _transpose_graph(op: str, target, *args, shape=(97, 8)):
    """x @ <transpose of W> built by hand, the transpose spelt as ``op`` (call_method / call_function)."""
    import operator

    import torch.fx as fx

    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["example_value"], w.meta["example_value"] = torch.empty(2, shape[-1]), torch.empty(shape)
    t = g.create_node(op, target, (w, *args))
    mm = g.call_function(operator.matmul, (x, t))
    g.output(mm)
    return x, w, t, mm


# Every way Dynamo (torch 2.13 .. 2.15) or a hand-written graph spells a 2-D transpose of the head weight.
TRANSPOSE_SPELLINGS = [
    ("call_method", "t"), ("call_function", torch.t), ("call_function", torch.Tensor.t),
    ("call_function", getattr, "T"), ("call_function", getattr, "mT"),
    ("call_method", "numpy_T"), ("call_function", torch.ops.aten.numpy_T.default),
    ("call_function", torch.ops.aten.mT.default), ("call_function", torch.ops.aten.t.default),
    ("call_function", torch.ops.aten.numpy_T), ("call_function", torch.ops.aten.mT),  # torch 2.14/2.15 Dynamo: packets
    ("call_method", "transpose", 0, 1), ("call_method", "transpose", -1, -2), ("call_function", torch.transpose, 1, 0),
    ("call_function", torch.ops.aten.transpose.int, 0, 1), ("call_method", "swapaxes", 0, 1),
    ("call_method", "permute", 1, 0), ("call_method", "permute", (1, 0)),
    ("call_function", torch.permute, (1, 0)), ("call_function", torch.ops.aten.permute.default, [1, 0]),
]


def _spelling_id(spelling) -> str:
    """A test id without object addresses (pytest-xdist's workers must collect the same ids): ops by their name
    (``aten.t.default``), functions by module and name (``torch.t``, ``Tensor.t``, ``getattr``)."""
    def part(p) -> str:
        if isinstance(p, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) or not callable(p):
            return str(p)
        module = getattr(p, "__module__", None) or "Tensor"
        return p.__name__ if module == "builtins" else f"{module}.{p.__name__}"

    return "-".join(map(part, spelling))


@pytest.mark.parametrize("spelling", TRANSPOSE_SPELLINGS, ids=_spelling_id)
def test_transposed_weight_reads_every_spelling(spelling):
    from nanospec_fx.passes.projections import match_projection, transposed_weight

    x, w, t, mm = _transpose_graph(*spelling)
    assert transposed_weight(t) is w
    assert match_projection(mm) == (x, w, None)


@pytest.mark.parametrize("spelling", [
    ("call_method", "transpose", 0, 0), ("call_method", "permute", 0, 1), ("call_method", "contiguous"),
    ("call_function", getattr, "shape"), ("call_function", torch.ops.aten.clone.default),
])
def test_not_a_transpose_is_not_read_as_one(spelling):
    from nanospec_fx.passes.projections import match_projection, transposed_weight

    _, _, t, mm = _transpose_graph(*spelling)
    assert transposed_weight(t) is None and match_projection(mm) is None


def test_transpose_of_a_3d_weight_is_not_a_head_weight():
    from nanospec_fx.passes.projections import transposed_weight

    _, _, t, _ = _transpose_graph("call_method", "transpose", 1, 2, shape=(4, 97, 8))
    assert transposed_weight(t) is None
