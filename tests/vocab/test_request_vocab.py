"""RequestVocabs: per-request active vocabularies of one head (nanospec_fx/vocab/request_vocab.py).

Oracles are plain torch: the dense head ``x @ W.T + b`` masked to a Python model of each request's set.
Runs on the CPU paths (host and reference); the Triton kernels are checked op by op in
tests/kernels/test_per_request_ops.py, and once end to end here.
"""
from __future__ import annotations

import pytest
import torch

from nanospec_fx import ActiveVocab, RequestVocabs, VocabConfig
from nanospec_fx.kernels.triton_util import INTERPRET
from nanospec_fx.vocab.request_vocab import token_to_row_from_d2t

NEG = float("-inf")
V, H = 41, 16
TOL = dict(rtol=1e-5, atol=1e-4)


@pytest.fixture(params=["host", "reference"])
def kernels(request, use_kernels):
    use_kernels(request.param)
    return request.param


def _head(seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, H, generator=g), (torch.randn(V, generator=g) if bias else None)


def _oracle(x, weight, bias, sets_per_row):
    """Dense logits with -inf outside each row's set (a list of Python sets, one per row of x [B, H])."""
    dense = x @ weight.T + (bias if bias is not None else 0)
    mask = torch.zeros_like(dense, dtype=torch.bool)
    for i, s in enumerate(sets_per_row):
        mask[i, sorted(s)] = True
    return dense.masked_fill(~mask, NEG)


def test_each_row_is_computed_against_its_own_request(kernels):
    weight, bias = _head(1)
    vocabs = RequestVocabs(weight, bias, max_requests=3, capacity=8)
    sets = {"a": {1, 2, 3}, "b": {3, 40, 7, 0}, "c": set()}
    for rid, s in sets.items():
        vocabs.assign(rid)
        vocabs.observe(rid, sorted(s))
    order = ["b", "a", "b", "c", "a", "a"]  # permuted and repeated batch rows
    rows = vocabs.rows_for(order)
    x = torch.randn(len(order), H, generator=torch.Generator().manual_seed(2))
    want = _oracle(x, weight, bias, [sets[r] for r in order])
    torch.testing.assert_close(vocabs.logits(x, rows), want, **TOL)
    torch.testing.assert_close(vocabs.scatter(vocabs.compact_logits(x, rows), rows), want, **TOL)
    vals, toks = vocabs.topk(x, rows, 2)
    want_vals, want_toks = torch.sort(want, dim=-1, descending=True, stable=True)
    torch.testing.assert_close(vals, want_vals[:, :2], **TOL)
    assert torch.equal(toks, want_toks[:, :2])  # request c (empty): padded with ids 0, 1 at -inf
    assert torch.equal(vocabs.argmax(x, rows), want.argmax(-1))
    assert vocabs.head_calls == 4  # logits, compact_logits, topk, argmax
    # leading dims: x [2, 3, H] with rows [2, 3]
    got = vocabs.logits(x.reshape(2, 3, H), rows.reshape(2, 3))
    torch.testing.assert_close(got.reshape(len(order), V), want, **TOL)


def test_isolation_survives_release_and_row_reuse(kernels):
    weight, _ = _head(3)
    vocabs = RequestVocabs(weight, max_requests=2, capacity=6)
    row_a, row_b = vocabs.assign("A"), vocabs.assign("B")
    assert row_a != row_b
    vocabs.observe("A", [5, 9])
    vocabs.observe("B", [1])
    x = torch.randn(1, H)
    assert not torch.isfinite(vocabs.logits(x, vocabs.rows_for(["B"]))[0, [5, 9]]).any()
    assert vocabs.contains("A", [5, 9, 1]).tolist() == [True, True, False]
    assert vocabs.contains("B", [5, 9, 1]).tolist() == [False, False, True]
    vocabs.release("A")
    vocabs.release("A")  # twice: no-op
    assert "A" not in vocabs and vocabs.free_rows == 1
    assert vocabs.assign("C") == row_a  # the freed row, emptied
    assert vocabs.active_count("C") == 0
    assert not torch.isfinite(vocabs.logits(x, vocabs.rows_for(["C"]))).any()
    assert vocabs.token_ids("B").tolist() == [1]


def test_assign_is_idempotent_and_full_rows_raise(kernels):
    vocabs = RequestVocabs(_head(4)[0], max_requests=2, capacity=4)
    assert vocabs.assign("x") == vocabs.assign("x") == 0
    vocabs.assign(17)
    with pytest.raises(RuntimeError, match="all 2 request rows"):
        vocabs.assign("y")
    with pytest.raises(KeyError, match="no row"):
        vocabs.observe("y", [1])
    assert sorted(map(str, vocabs.request_ids)) == ["17", "x"]


def test_reset_and_seed_ids(kernels):
    vocabs = RequestVocabs(_head(5)[0], max_requests=2, capacity=6, seed_ids=[0, 2])
    vocabs.assign("r")
    assert vocabs.token_ids("r").tolist() == [0, 2]
    vocabs.observe("r", [7, 8])
    vocabs.reset("r")
    assert vocabs.token_ids("r").tolist() == [0, 2]
    vocabs.release("r")
    vocabs.assign("s")
    assert vocabs.token_ids("s").tolist() == [0, 2]


def test_eviction_is_per_request(kernels):
    """One request overflowing its capacity evicts its own oldest tokens, never another request's."""
    vocabs = RequestVocabs(_head(6)[0], max_requests=2, capacity=4, num_pinned=1)
    vocabs.assign("busy")
    vocabs.assign("calm")
    vocabs.observe("calm", [30, 31])
    vocabs.observe("busy", [1, 2, 3, 4])
    vocabs.observe("busy", [5, 6])  # ring of 3 slots after the pinned token 1: 2, 3 evicted
    assert sorted(vocabs.token_ids("busy").tolist()) == [1, 4, 5, 6]
    assert vocabs.token_ids("calm").tolist() == [30, 31]


def test_observe_rows_batches_several_requests(kernels):
    weight, bias = _head(7)
    one, many = (RequestVocabs(weight, bias, max_requests=3, capacity=5) for _ in range(2))
    for v in (one, many):
        for rid in ("a", "b", "c"):
            v.assign(rid)
    batch = [("b", [4, 5, -1]), ("a", [6, -1, -1]), ("b", [5, 7, 8]), ("b", [9, 10, 11])]
    for rid in ("a", "b"):  # the oracle: per request, its ids in batch order, as one call
        one.observe(rid, [t for r, toks in batch if r == rid for t in toks if t >= 0])
    many.observe_rows(many.rows_for([r for r, _ in batch]), torch.tensor([t for _, t in batch]))
    for rid in ("a", "b", "c"):
        assert torch.equal(one.token_ids(rid), many.token_ids(rid)), rid
    assert sorted(many.token_ids("b").tolist()) == [7, 8, 9, 10, 11]  # 4, 5 dropped within the call (capacity 5)
    many.observe_rows(many.rows_for([]), torch.zeros(0, 3, dtype=torch.int64))  # an empty batch: nothing
    assert sorted(many.token_ids("b").tolist()) == [7, 8, 9, 10, 11]


def test_validation_and_token_map(kernels):
    weight, _ = _head(8)  # 41 head rows: a draft vocabulary of a 100-token target
    d2t = torch.arange(V) * 2 - torch.arange(V)  # draft id i -> target id 2 i
    vocabs = RequestVocabs(weight, max_requests=1, capacity=8, token_to_row=token_to_row_from_d2t(d2t, 100))
    vocabs.assign(0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocabs.observe(0, [100])
    with pytest.raises(TypeError):
        vocabs.observe(0, [1.5])
    vocabs.observe(0, [4, 5, 10])  # 5 has no draft row: skipped
    assert vocabs.token_ids(0).tolist() == [4, 10]
    x = torch.randn(1, H)
    finite = torch.isfinite(vocabs.logits(x, vocabs.rows_for([0])))[0]
    assert finite.nonzero().flatten().tolist() == [2, 5]  # head rows (draft ids) of tokens 4 and 10
    # one meaning per name on both state classes: rows = head rows (the last dim of logits), vocab_size = token ids
    assert (vocabs.rows, vocabs.vocab_size) == (V, 100)
    active = ActiveVocab(weight, capacity=8, token_to_row=token_to_row_from_d2t(d2t, 100))
    assert (active.rows, active.vocab_size) == (V, 100)
    assert vocabs.contains(0, [4, 10, 5, 100, -1]).tolist() == [True, True, False, False, False]


def test_padding_rows_read_as_an_empty_set(kernels):
    """Every head call reads a padding row (-1, or past max_requests) as an empty set, never another request's."""
    weight, bias = _head(13)
    vocabs = RequestVocabs(weight, bias, max_requests=2, capacity=8)
    vocabs.assign("a"), vocabs.assign("b")
    vocabs.observe("a", [1, 2]), vocabs.observe("b", [3, 4])
    rows = torch.tensor([-1, vocabs.row_of("a"), 2, vocabs.row_of("b")])
    x = torch.randn(4, H)
    want = _oracle(x, weight, bias, [set(), {1, 2}, set(), {3, 4}])
    torch.testing.assert_close(vocabs.logits(x, rows), want, **TOL)
    vals, toks = vocabs.topk(x, rows, 3)
    assert toks[0].tolist() == [0, 1, 2] and torch.isneginf(vals[0]).all()  # an empty set's padding
    assert vocabs.argmax(x, rows).tolist() == [0, int(want[1].argmax()), 0, int(want[3].argmax())]


def test_weight_written_in_place_is_followed(kernels):
    weight, _ = _head(9)
    vocabs = RequestVocabs(weight, max_requests=1, capacity=4)
    vocabs.assign("r")
    vocabs.observe("r", [3])
    with torch.no_grad():
        weight.mul_(2)
    x = torch.randn(1, H)
    torch.testing.assert_close(vocabs.logits(x, vocabs.rows_for(["r"]))[0, 3], (x @ weight[3]).reshape(()), **TOL)


def test_bad_arguments():
    weight, _ = _head(10)
    with pytest.raises(ValueError, match="max_requests"):
        RequestVocabs(weight, max_requests=0)
    with pytest.raises(ValueError, match="num_pinned"):
        RequestVocabs(weight, capacity=4, num_pinned=4)
    vocabs = RequestVocabs(weight, max_requests=1, capacity=4)
    vocabs.assign("r")
    with pytest.raises(ValueError, match="leading dims"):
        vocabs.logits(torch.randn(2, H), vocabs.rows_for(["r"]))


@pytest.mark.skipif(not INTERPRET, reason="Triton on CPU needs the interpreter")
def test_triton_path_end_to_end(use_kernels):
    pytest.importorskip("triton")
    use_kernels("triton")
    weight, bias = _head(11)
    vocabs = RequestVocabs(weight, bias, max_requests=2, capacity=5)
    vocabs.assign("a")
    vocabs.assign("b")
    vocabs.observe_rows(vocabs.rows_for(["a", "b", "a"]), torch.tensor([[1, 2], [3, -1], [2, 4]]))
    rows = vocabs.rows_for(["b", "a"])
    x = torch.randn(2, H)
    want = _oracle(x, weight, bias, [{3}, {1, 2, 4}])
    torch.testing.assert_close(vocabs.logits(x, rows), want, **TOL)
    assert torch.equal(vocabs.argmax(x, rows), want.argmax(-1))


def test_built_from_the_backends_vocabulary_options(kernels):
    weight, _ = _head(12)
    counts = torch.zeros(V)
    counts[[9, 4, 30]] = torch.tensor([50.0, 40.0, 30.0])  # frequency ranks: 9, 4, 30
    hybrid = RequestVocabs.from_config(weight, None, VocabConfig(capacity=5, policy="hybrid", frequencies=counts,
                                                                 pinned_size=2), max_requests=2)
    assert (hybrid.capacity, hybrid.num_pinned, hybrid.policy) == (5, 2, "hybrid")
    hybrid.assign("a")
    hybrid.observe("a", [1, 2, 3, 5, 6])  # the ring of 3 keeps the last 3; the pinned core stays
    assert sorted(hybrid.token_ids("a").tolist()) == [3, 4, 5, 6, 9]
    static = RequestVocabs.from_config(weight, None, VocabConfig(policy="static", frequencies=counts, static_size=2))
    static.assign("s")
    static.observe("s", [1])  # frozen: ignored
    assert sorted(static.token_ids("s").tolist()) == [4, 9]


def test_observe_rows_refuses_ids_that_do_not_match_the_rows(kernels):
    """ids [2, 3] for 3 rows used to be reshaped to [3, 2]: requests received each other's tokens."""
    weight, _ = _head(11)
    vocabs = RequestVocabs(weight, max_requests=3, capacity=8)
    for rid in ("a", "b", "c"):
        vocabs.assign(rid)
    rows = vocabs.rows_for(["a", "b", "c"])
    for bad in (torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([1, 2]), torch.zeros(3, 1, 2, dtype=torch.long)):
        with pytest.raises(ValueError, match="token_ids must be"):
            vocabs.observe_rows(rows, bad)
    with pytest.raises(ValueError, match="1-D"):
        vocabs.observe_rows(rows.reshape(3, 1), torch.tensor([[1], [2], [3]]))
    with pytest.raises(TypeError, match="integer request rows"):
        vocabs.observe_rows(rows.float(), torch.tensor([[1], [2], [3]]))
    with pytest.raises(TypeError, match="integer request rows"):
        vocabs.logits(torch.randn(3, H), rows.float() + 0.5)
    assert all(vocabs.active_count(r) == 0 for r in ("a", "b", "c"))  # nothing joined on any refusal
    vocabs.observe_rows(rows, torch.tensor([7, 8, 9]))  # one id per batch row: [B]
    assert [vocabs.token_ids(r).tolist() for r in ("a", "b", "c")] == [[7], [8], [9]]


def test_padding_rows_observe_nothing(kernels):
    """A batch padded with row -1 (or a row past max_requests): its ids join no request (-1 used to wrap to the
    last row)."""
    weight, _ = _head(12)
    vocabs = RequestVocabs(weight, max_requests=2, capacity=8)
    vocabs.assign("a"), vocabs.assign("b")
    rows = torch.tensor([vocabs.row_of("a"), -1, 5, vocabs.row_of("b")])
    vocabs.observe_rows(rows, torch.tensor([[1, 2], [3, 4], [5, 6], [7, -1]]))
    assert vocabs.token_ids("a").tolist() == [1, 2] and vocabs.token_ids("b").tolist() == [7]


def test_property_observe_rows_takes_only_matching_shapes():
    """Any token_ids shape whose leading dim is not B raises and changes nothing; a matching one observes
    each batch row's ids into its own request only (hypothesis)."""
    from hypothesis import given, settings, strategies as st

    weight, _ = _head(13)

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(st.integers(1, 4), st.integers(0, 3), st.integers(1, 3))
    def check(batch, lead, width):
        vocabs = RequestVocabs(weight, max_requests=4, capacity=16)
        names = [f"r{i}" for i in range(batch)]
        for n in names:
            vocabs.assign(n)
        rows = vocabs.rows_for(names)
        tokens = torch.arange(lead * width).reshape(lead, width) % V
        if lead != batch:
            with pytest.raises(ValueError, match="token_ids must be"):
                vocabs.observe_rows(rows, tokens)
            assert all(vocabs.active_count(n) == 0 for n in names)
        else:
            vocabs.observe_rows(rows, tokens)
            for i, n in enumerate(names):
                assert sorted(vocabs.token_ids(n).tolist()) == sorted(set(tokens[i].tolist()))

    check()


def test_arguments_in_the_wrong_places_get_a_clear_error():
    weight = torch.randn(V, H)
    with pytest.raises(TypeError, match=r"bias must be the head's \[V\] bias tensor or None, got int 8: the second "
                                        r"argument is the bias"):
        RequestVocabs(weight, 8, 3072)  # the bias left out
    with pytest.raises(TypeError, match=r"weight must be the head's \[V, H\] weight tensor, got Linear"):
        RequestVocabs(torch.nn.Linear(H, V))
    vocabs = RequestVocabs(weight, max_requests=2, capacity=8)  # the documented form
    assert vocabs.max_requests == 2 and vocabs.capacity == 8


@pytest.mark.parametrize("kind", [ActiveVocab, RequestVocabs])
def test_both_state_classes_check_their_arguments_alike(kind):
    """One argument check for every state kind: the same error, naming the class's own signature."""
    weight = torch.randn(V, H)
    with pytest.raises(TypeError, match=rf"the second argument is the bias \({kind.__name__}\(weight, bias=None"):
        kind(weight, 8)
    with pytest.raises(TypeError, match=rf"capacity must be a positive int, got a tensor: {kind.__name__}\("):
        kind(weight, capacity=torch.tensor(8))
    for capacity in (0, True, 2.0):
        with pytest.raises(ValueError, match=rf"capacity must be a positive int, got {capacity!r}"):
            kind(weight, capacity=capacity)
    with pytest.raises(ValueError, match=r"head weight must be 2-D"):
        kind(torch.randn(2, 2, V, H))  # 3-D is a stacked head for ActiveVocab
    with pytest.raises(ValueError, match=rf"head bias must have shape \({V},\)"):
        kind(weight, torch.zeros(V + 1))
    with pytest.raises(ValueError, match=r"num_pinned must be in \[0, capacity=4\), got 4"):
        kind(weight, capacity=4, num_pinned=4)
    state = kind(weight, capacity=10 * V)  # clamped to the head's rows
    assert (state.capacity, state.rows, state.vocab_size) == (V, V, V)


def test_explain_of_a_state_says_what_it_takes():
    import nanospec_fx

    vocabs = RequestVocabs(torch.randn(V, H), max_requests=2, capacity=8)
    with pytest.raises(TypeError, match=r"explain\(\) takes a model .* got RequestVocabs: print\(\) it .*active_count"):
        nanospec_fx.explain(vocabs)
