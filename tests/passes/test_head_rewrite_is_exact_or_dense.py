"""The head rewrite is exact or runs dense: every use of the logits is exact, materialised or dense+warned.

Each test is one defect class: the compiled drafter is compared with the oracle "eager dense
drafter with inactive logits set to -inf after the head's last elementwise step" (``_mask``;
writes into the logits count as such steps), or it must warn.
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
V, H = 40, 8
NEG = float("-inf")


def _mask(model) -> torch.Tensor:
    state = nanospec_fx.active_vocab(model)
    return state.contains(torch.arange(state.vocab_size))


def _masked(z: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return z if mask is None else z.masked_fill(~mask, NEG)


class Base(nn.Module):
    """Embedding -> tiny body -> ``lm_head``; subclasses say what happens to the logits."""

    def __init__(self, vocab: int = V, hidden: int = H, bias: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, hidden)
        self.body = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=bias)
        self.register_buffer("banned", torch.zeros(vocab, dtype=torch.bool))
        self.banned[[1, 3, 5]] = True

    def hidden(self, ids):
        return torch.tanh(self.body(self.embed(ids)))


def _run(model, ids, **options):
    compiled = compile_nanospec(model, capacity=16, **options)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(ids)
        expected = model(ids, _mask=_mask(model))
    return out, expected, [w for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]


def _ids():
    return torch.tensor([[1, 2, 3, 7, 9, 11]])


def _assert_dense_with_warning(model, ids, match: str, **options):
    """The compiled model warns with ``match`` and returns exactly the dense model's output."""
    compiled = compile_nanospec(model, **options)
    with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning, match=match):
        out = compiled(ids)
    torch.testing.assert_close(out, model(ids))


# ----------------------------------------------------------------------------- 1. mutations
class MaskedFillInPlace(Base):
    def forward(self, ids, _mask=None):
        z = _masked(self.lm_head(self.hidden(ids)), _mask)
        z.masked_fill_(self.banned, NEG)
        return torch.log_softmax(z / 0.5, -1).topk(3, dim=-1)


class SetItem(Base):
    def forward(self, ids, _mask=None):
        z = _masked(self.lm_head(self.hidden(ids)), _mask)
        z[..., self.banned] = NEG
        return z, z.topk(2, dim=-1).indices


class ClampInPlaceAndAugmented(Base):
    def forward(self, ids, _mask=None):
        z = self.lm_head(self.hidden(ids))
        z /= 0.7
        torch.clamp_(z, -0.5, 0.5)
        z *= 2.0
        return _masked(z, _mask)


class CopyThroughView(Base):
    def forward(self, ids, _mask=None):
        z = self.lm_head(self.hidden(ids))
        last = z[:, -1]
        last.copy_(torch.zeros_like(last))  # a dense write into the logits through a view: a post-op too
        return _masked(z, _mask)


class IndexPutThenReadBase(Base):
    def forward(self, ids, _mask=None):
        z = _masked(self.lm_head(self.hidden(ids)), _mask)
        v = z[:, -1]
        z.index_put_((torch.tensor([0]), torch.tensor([5]), torch.tensor([2])), torch.tensor(7.0))
        return v * 1.0, z.argmax(-1)


@pytest.mark.parametrize("cls", [MaskedFillInPlace, SetItem, ClampInPlaceAndAugmented, CopyThroughView,
                                 IndexPutThenReadBase])
def test_mutations_of_the_logits_are_never_lost(cls):
    model = cls().eval()
    out, expected, _ = _run(model, _ids())
    torch.testing.assert_close(out, expected)


def test_in_place_post_ops_run_compact():
    model = ClampInPlaceAndAugmented().eval()
    _run(model, _ids())
    (report,) = pass_reports.reports(nanospec_fx.active_vocab(model))
    assert {"itruediv", "clamp_", "imul"} <= set(report.post_ops) and not report.materialised


def test_a_write_with_no_compact_form_is_a_materialisation_point():
    model = SetItem().eval()
    _run(model, _ids())
    (report,) = pass_reports.reports(nanospec_fx.active_vocab(model))
    assert any("setitem" in m for m in report.materialised)
    assert any("test_head_rewrite_is_exact_or_dense.py" in m for m in report.materialised)  # where it is


# ----------------------------------------------------------------------------- 2. head selection
class LogitsAndWideHidden(Base):
    """A small-vocabulary drafter returning (logits, hidden) with hidden wider than V."""

    def __init__(self):
        super().__init__(vocab=12, hidden=8)
        self.proj = nn.Linear(8, 20)  # H' = 20 > V = 12

    def forward(self, ids, _mask=None):
        h = self.hidden(ids)
        return _masked(self.lm_head(h), _mask), self.proj(h)


def test_head_is_the_projection_to_the_embedding_vocabulary_not_the_widest():
    model = LogitsAndWideHidden().eval()
    ids = torch.tensor([[1, 2, 3]])
    (logits, hidden), (exp_logits, exp_hidden), _ = _run(model, ids)
    torch.testing.assert_close(hidden, exp_hidden)
    torch.testing.assert_close(logits, exp_logits)
    assert pass_reports.reports(nanospec_fx.active_vocab(model))[0].head == "lm_head.weight"


class RouterAndDequantisedHead(nn.Module):
    """An MoE router (a projection) and a head computed from an int8 weight: only the latter is V."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, H)
        self.router = nn.Linear(H, 4)
        self.experts = nn.Linear(H, H)
        self.register_buffer("w_int8", torch.randint(-127, 127, (V, H), dtype=torch.int8))
        self.register_buffer("scale", torch.rand(V, 1) / 100)

    def forward(self, ids, _mask=None):
        h = self.embed(ids)
        gate = torch.softmax(self.router(h), -1).max(-1, keepdim=True).values
        h = h + gate * self.experts(h)
        return F.linear(h, self.w_int8.float() * self.scale)


def test_a_projection_that_is_not_the_vocabulary_is_never_rewritten():
    """The router is not the head; the int8 head is (its active rows are dequantised per call)."""
    model = RouterAndDequantisedHead().eval()
    compiled = compile_nanospec(model, capacity=16)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        out = compiled(ids)
        expected = model(ids).masked_fill(~_mask(compiled), NEG)
    torch.testing.assert_close(out, expected)
    assert nanospec_fx.active_vocab(compiled).is_weight(model.w_int8)


def test_head_option_naming_nothing_fails_and_lists_candidates():
    model = LogitsAndWideHidden().eval()
    with pytest.raises(Exception, match=r"no_such_layer.*lm_head\.weight.*proj\.weight"):
        compile_nanospec(model, head="no_such_layer")(torch.tensor([[1, 2]]))


# ----------------------------------------------------------------------------- 3. direct consumers
class Direct(Base):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, ids, _mask=None):
        z = _masked(self.lm_head(self.hidden(ids)), _mask)
        if self.kind == "smallest":
            return z.topk(3, dim=-1, largest=False)
        if self.kind == "log_softmax_topk":
            return torch.log_softmax(z, -1).topk(3, dim=-1)
        return z[:, -1]


@pytest.mark.parametrize("kind", ["smallest", "log_softmax_topk", "last"])
def test_consumers_reading_the_head_directly_take_the_compact_path(kind):
    model = Direct(kind).eval()
    ids = _ids()
    out, expected, _ = _run(model, ids)
    report = pass_reports.reports(nanospec_fx.active_vocab(model))[0]
    active = _mask(model)
    if kind == "last":
        torch.testing.assert_close(out, expected)
        assert report.post_ops == ["getitem"]  # the slice runs on compact logits, then one [B, V] scatter
        return
    values, indices = out
    if kind == "smallest":
        # The contract: top-k reads the logits with -inf at inactive tokens, so the k smallest are
        # inactive tokens (ties among them: any order). It runs on the materialised logits.
        assert report.exits == ["topk"] and not report.consumers
        with torch.no_grad():
            masked = model.lm_head(model.hidden(ids)).masked_fill(~active, NEG)
        torch.testing.assert_close(values, expected.values)
        torch.testing.assert_close(masked.gather(-1, indices), values)
        return
    assert "topk" in report.consumers and not report.exits
    assert active[indices].all()  # only active tokens are ever selected
    torch.testing.assert_close(values, expected.values)
    torch.testing.assert_close(indices, expected.indices)


def test_inserted_nodes_carry_fake_tensor_metadata():
    from nanospec_fx.passes.rewrite_head import rewrite_head  # noqa: F401 - the module under test

    seen = []

    def spy(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    import nanospec_fx.compiler.lowering as lowering

    original = lowering.compile_graph
    lowering.compile_graph = lambda gm, ex, inductor, patches: spy(gm, ex)
    try:
        _run(Direct("log_softmax_topk").eval(), _ids())
    finally:
        lowering.compile_graph = original
    nodes = [n for n in seen[-1].graph.nodes if n.op == "call_function" and "nanospec" in str(n.target)]
    assert nodes and all("val" in n.meta and "example_value" in n.meta for n in nodes)
    missing = [
        n.name for n in nodes if "observe" not in n.name and not isinstance(n.meta["val"], (torch.Tensor, tuple))
    ]
    assert not missing


# ----------------------------------------------------------------------------- 4. graph breaks
class BreakBeforeSoftcap(Base):
    def forward(self, ids, _mask=None):
        z = _masked(self.lm_head(self.hidden(ids)), _mask)
        torch._dynamo.graph_break()
        return 2.0 * torch.tanh(z / 2.0)


def test_logits_living_across_a_graph_break_leave_the_head_dense_naming_the_break():
    # Post-ops after the break run in another graph: the head's own graph cannot prove them, so it
    # stays dense and the warning names the break (not "no LM head found").
    _assert_dense_with_warning(BreakBeforeSoftcap().eval(), _ids(),
                               r"runs dense: this graph is one piece of a call split by graph breaks \(it ends at a "
                               r"graph break at .*test_head_rewrite_is_exact_or_dense.py")


# ----------------------------------------------------------------------------- 5. dead code
class SideEffectsInTheBody(Base):
    def forward(self, ids, _mask=None):
        h = self.hidden(ids)
        torch.clamp_(h, -0.1, 0.1)
        torch.nan_to_num_(h)
        torch.tanh_(h)
        buf = torch.empty_like(h)
        torch.mul(h, 3.0, out=buf)
        return _masked(self.lm_head(buf), _mask)


def test_side_effecting_ops_with_unused_results_survive():
    model = SideEffectsInTheBody().eval()
    out, expected, _ = _run(model, _ids())
    torch.testing.assert_close(out, expected)


def test_side_effecting_ops_survive_in_a_target_observer():
    drafter = Base().eval()
    target = SideEffectsInTheBody().eval()
    ids = _ids()
    state = nanospec_fx.attach(drafter, head="lm_head.weight", capacity=16)
    compiled = compile_nanospec(target, observe_topk=2, vocab=state)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), target(ids))


# ----------------------------------------------------------------------------- 6. observe order
class HeadBeforeEmbedding(Base):
    """Scores the previous hidden state, then embeds the new ids (program order: head first)."""

    def forward(self, h_prev, ids, _mask=None):
        z = _masked(2.0 * torch.tanh(self.lm_head(h_prev) / 2.0), _mask)
        return z, self.embed(ids)


def test_one_call_sees_one_state_when_the_head_runs_before_the_embedding():
    model = HeadBeforeEmbedding().eval()
    compiled = compile_nanospec(model, capacity=4)
    h = torch.randn(1, 2, H)
    with torch.no_grad():
        for step in range(4):  # the ring of 4 slots evicts at every step
            ids = torch.arange(3 * step, 3 * step + 3).view(1, 3) % V
            z, _ = compiled(h, ids)
            active = _mask(model)
            assert active[ids].all()  # observed before the head read the state
            expected, _ = model(h, ids, _mask=active)
            torch.testing.assert_close(z, expected)


# ----------------------------------------------------------------------------- 7. padded embedding
class PaddedEmbedding(Base):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V + 4, H)  # padded to a multiple of 4

    def forward(self, ids, _mask=None):
        return _masked(self.lm_head(self.hidden(ids)), _mask)


def test_padded_embedding_is_not_guessed_and_says_which_option_to_pass():
    _assert_dense_with_warning(PaddedEmbedding().eval(), torch.tensor([[1, 2, 3]]),
                               r"44 rows.*'vocab_size': 40.*lm_head\.weight", capacity=16)


def test_padded_embedding_observes_the_ids_in_the_vocabulary():
    model = PaddedEmbedding().eval()
    ids = torch.tensor([[1, 2, 3, 42]])  # 42 >= V: not a token of the head
    out, expected, _ = _run(model, ids, vocab_size=V)
    torch.testing.assert_close(out, expected)
    assert sorted(nanospec_fx.active_vocab(model).token_ids().tolist()) == [1, 2, 3]


class SmallTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, H)  # ids of another, smaller vocabulary
        self.lm_head = nn.Linear(H, V)

    def forward(self, h, ids):
        return self.lm_head(h + self.embed(ids))


def test_nothing_observable_warns():
    compiled = compile_nanospec(SmallTable().eval(), capacity=8, head="lm_head")
    with torch.no_grad(), pytest.warns(nanospec_fx.NanoSpecWarning, match="nothing joins the active set"):
        compiled(torch.randn(1, 2, H), torch.tensor([[1, 2]]))


# ----------------------------------------------------------------------------- 8. coverage
class Einsum(Base):
    def forward(self, ids, _mask=None):
        z = torch.einsum("...h,vh->...v", self.hidden(ids), self.lm_head.weight)
        return _masked(z.clamp(-1.0, 1.0).masked_fill(self.banned, -5.0), _mask)


class Medusa(Base):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(H, V, bias=False) for _ in range(3))

    def forward(self, ids, _mask=None):
        h = self.hidden(ids)
        return torch.stack([head(h) for head in self.heads], dim=0)


def test_einsum_head_with_clamp_and_masked_fill_runs_compact():
    model = Einsum().eval()
    out, expected, _ = _run(model, _ids())
    torch.testing.assert_close(out, expected)
    (report,) = pass_reports.reports(nanospec_fx.active_vocab(model))
    assert {"clamp", "masked_fill"} <= set(report.post_ops)


def test_medusa_heads_stacked_are_each_rewritten():
    model = Medusa().eval()
    compiled = compile_nanospec(model, capacity=16)
    ids = _ids()
    with torch.no_grad():
        out = compiled(ids)
        h = model.hidden(ids)
        expected = torch.stack([head(h).masked_fill(~_mask_of(model, f"heads.{i}"), NEG)
                                for i, head in enumerate(model.heads)])
    torch.testing.assert_close(out, expected)


def _mask_of(model, head: str) -> torch.Tensor:
    state = nanospec_fx.active_vocab(model, head=head)
    return state.contains(torch.arange(state.vocab_size))


# ----------------------------------------------------------------------------- 10. autocast
def test_autocast_dtype_matches_eager():
    model = Base().eval()

    class Plain(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m.lm_head(self.m.hidden(ids))

    wrapped = Plain(model)
    compiled = compile_nanospec(wrapped, capacity=16)
    ids = _ids()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(ids)
        expected = wrapped(ids)
    assert out.dtype == expected.dtype == torch.bfloat16
    active = _mask(model)
    torch.testing.assert_close(out[..., active], expected[..., active], rtol=2e-2, atol=5e-2)


class ScoreEmbedScore(Base):
    """A two-step drafter in one graph: the tokens it embeds between the two heads are new, so
    the observe between them evicts slots that the first head's logits are still mapped with."""

    def forward(self, ids, _mask=None):
        h = self.hidden(ids)
        z1 = self.lm_head(h)
        nxt = (z1.argmax(-1) + 1) % V
        z2 = self.lm_head(torch.tanh(self.body(self.embed(nxt))))
        return z1 * 1.0, z2


def test_logits_scored_before_an_observe_keep_their_slot_table():
    model = ScoreEmbedScore().eval()
    compiled = compile_nanospec(model, capacity=6)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    state = None
    with torch.no_grad():
        for _ in range(3):
            before = None if state is None else state.token_ids().clone()
            z1, z2 = compiled(ids)
            state = nanospec_fx.active_vocab(model)
            dense = model.lm_head(model.hidden(ids))
            finite = ~torch.isneginf(z1)
            # every finite entry is the dense logit of that very token (never another token's)
            torch.testing.assert_close(z1[finite], dense[finite])
            assert finite.any()
            ids = torch.tensor([[6, 7, 8, 9, 10]]) if before is None else ids


class PaddedVocabSlice(Base):
    """A head padded to 48 outputs for a 40-token vocabulary; the drafter slices the real ones."""

    def __init__(self):
        super().__init__(vocab=48)

    def forward(self, ids, _mask=None):
        z = _masked(self.lm_head(self.hidden(ids)) / 0.8, _mask)
        return z[..., :40].topk(2, dim=-1)


def test_vocabulary_slice_of_a_padded_head_is_exact():
    model = PaddedVocabSlice().eval()
    out, expected, caught = _run(model, _ids())
    torch.testing.assert_close(out, expected)
    (report,) = pass_reports.reports(nanospec_fx.active_vocab(model))
    assert "truediv" in report.post_ops and not caught


def test_medusa_head_chosen_by_name_is_rewritten_and_the_stack_reads_it_materialised():
    model = Medusa().eval()
    compiled = compile_nanospec(model, capacity=16, head="heads.1")
    ids = _ids()
    with torch.no_grad():
        out = compiled(ids)
        h = model.hidden(ids)
        active = _mask(model)
        expected = torch.stack([model.heads[0](h), model.heads[1](h).masked_fill(~active, NEG), model.heads[2](h)])
    torch.testing.assert_close(out, expected)


class BreakBetweenEmbeddingAndHead(Base):
    def forward(self, ids, _mask=None):
        h = self.hidden(ids)
        torch._dynamo.graph_break()
        return _masked(self.lm_head(h), _mask)


def test_a_head_after_a_graph_break_stays_dense_naming_the_break_and_the_remedy():
    # The ids are embedded in another graph: nothing proves they are observed before this head
    # reads the set (same model instance, same call), so it runs dense and says where and why.
    _assert_dense_with_warning(
        BreakBetweenEmbeddingAndHead().eval(),
        _ids(),
        r"resumes after a graph break at .*test_head_rewrite_is_exact_or_dense.py:\d+ \(forward\).*"
        r"observe_inputs': False",
        capacity=16,
    )


def test_with_observe_inputs_off_a_head_after_a_graph_break_is_rewritten_and_fed_by_the_user():
    model = BreakBetweenEmbeddingAndHead().eval()
    compiled = compile_nanospec(model, capacity=16, observe_inputs=False)
    state = nanospec_fx.attach(model, head="lm_head", capacity=16)
    state.observe([1, 2, 3])
    with torch.no_grad():
        out = compiled(_ids())
    assert pass_reports.reports(state), "the head was not rewritten"
    torch.testing.assert_close(out, model(_ids(), _mask=_mask(model)))


class BreakInsideTheEmbeddingFunction(Base):
    def embed_ids(self, ids):
        h = self.embed(ids)
        for layer in (self.body,):
            h = torch.tanh(layer(h))
            torch._dynamo.graph_break()  # in a loop: Dynamo runs this whole function outside any graph
        return h

    def forward(self, ids, _mask=None):
        return _masked(self.lm_head(self.embed_ids(ids)), _mask)


def test_ids_that_cannot_be_observed_leave_the_head_dense_with_a_warning():
    _assert_dense_with_warning(BreakInsideTheEmbeddingFunction().eval(), _ids(),
                               "runs dense: this graph is one piece of a call", capacity=16)


class ClampsItsIds(Base):
    def forward(self, ids, _mask=None):
        ids = ids.clone()
        ids.clamp_(0, 4)  # the drafter embeds the clamped ids: those are what must be observed
        return _masked(self.lm_head(self.hidden(ids)), _mask)


def test_observe_reads_the_ids_as_the_embedding_does():
    model = ClampsItsIds().eval()
    out, expected, _ = _run(model, torch.tensor([[1, 9, 30]]))
    torch.testing.assert_close(out, expected)
    assert sorted(nanospec_fx.active_vocab(model).token_ids().tolist()) == [1, 4]


class WriteThenPostOps(Base):
    """A finite write into the logits, then more post-ops and a vocabulary slice."""

    def __init__(self):
        super().__init__(vocab=44)

    def forward(self, ids, _mask=None):
        z = self.lm_head(self.hidden(ids))
        z[..., self.banned] = 3.0
        z = _masked(2.0 * torch.tanh(z / 2.0), _mask)
        y = z[..., :40]
        return _masked(y * 1.5, None if _mask is None else _mask[:40])


def test_inactive_tokens_stay_minus_inf_after_writes_and_later_post_ops():
    model = WriteThenPostOps().eval()
    out, expected, _ = _run(model, _ids())
    torch.testing.assert_close(out, expected)


class PositionTableOfWidthH(Base):
    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(H, H)  # H rows, like the hidden width

    def forward(self, ids, _mask=None):
        h = self.hidden(ids) + self.pos(torch.arange(ids.shape[-1]))
        return _masked(self.lm_head(h), _mask), h


def test_positions_from_a_dynamic_length_are_not_token_ids():
    model = PositionTableOfWidthH().eval()
    compiled = compile_nanospec(model, capacity=16)
    with torch.no_grad():
        for ids in (torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 6, 7, 1]])):  # the second call recompiles dynamic
            (z, h) = compiled(ids)
            torch.testing.assert_close(z, model(ids, _mask=_mask(model))[0])
    state = nanospec_fx.active_vocab(model)
    assert pass_reports.reports(state)[-1].observers == 1 and state.contains(torch.tensor([4, 5, 6, 7])).all()


class OutIntoNewBuffer(Base):
    def forward(self, ids, _mask=None):
        z = self.lm_head(self.hidden(ids))
        buf = torch.empty_like(z)
        torch.tanh(z / 2.0, out=buf)  # an elementwise post-op written with out=
        return _masked(buf * 2.0, _mask)


def test_out_write_of_a_post_op_keeps_inactive_tokens_minus_inf():
    model = OutIntoNewBuffer().eval()
    out, expected, _ = _run(model, _ids())
    torch.testing.assert_close(out, expected)


class SliceThenSoftcap(Base):
    def __init__(self):
        super().__init__(vocab=44)

    def forward(self, ids, _mask=None):
        z = self.lm_head(self.hidden(ids))[..., :40]
        return _masked(2.0 * torch.tanh(z / 2.0), None if _mask is None else _mask[:40])


def test_post_ops_after_a_vocabulary_slice_keep_inactive_tokens_minus_inf():
    model = SliceThenSoftcap().eval()
    out, expected, _ = _run(model, _ids())
    torch.testing.assert_close(out, expected)


class NestedBreakAfterHead(Base):
    def post(self, z):
        for _ in range(1):
            torch._dynamo.graph_break()  # in a loop of a nested call: Dynamo runs `post` outside any graph
            z = 2.0 * torch.tanh(z / 2.0)
        return z

    def forward(self, ids, _mask=None):
        return self.post(self.lm_head(self.hidden(ids)))


def test_logits_crossing_a_nested_graph_break_leave_the_head_dense_with_a_warning():
    # Two true warnings: the head's graph is one piece of the call (dense), and Dynamo skipped `post` (its loop's
    # break), which nanospec never saw.
    model = NestedBreakAfterHead().eval()
    compiled = compile_nanospec(model, capacity=16)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", nanospec_fx.NanoSpecWarning)
        out = compiled(_ids())
    said = [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]
    assert any("runs dense: this graph is one piece of a call" in m for m in said), said
    assert all("runs dense: this graph is one piece of a call" in m or "Dynamo skipped 'post'" in m for m in said), said
    torch.testing.assert_close(out, model(_ids()))


class SmallestAfterWrite(Base):
    def forward(self, ids, _mask=None):
        z = self.lm_head(self.hidden(ids))
        z[..., self.banned] = 0.0  # a write: the logits are materialised here
        return z.topk(2, dim=-1, largest=False)


def test_smallest_top_k_of_materialised_logits_reads_minus_inf_at_inactive_tokens():
    # The contract's oracle: top-k reads the chain's logits with -inf at inactive tokens (plain IEEE
    # after the chain), so the k smallest are inactive tokens, never re-lifted to +inf.
    model = SmallestAfterWrite().eval()
    compiled = compile_nanospec(model, capacity=16)
    ids = _ids()
    with torch.no_grad():
        values, indices = compiled(ids)
        active = _mask(model)
        z = model.lm_head(model.hidden(ids))
        z[..., model.banned] = 0.0
        z = z.masked_fill(~active, NEG)
    assert not active[indices].any()
    torch.testing.assert_close(values, z.topk(2, dim=-1, largest=False).values)
