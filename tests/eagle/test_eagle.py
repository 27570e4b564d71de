"""The EAGLE-2-style drafter and draft loop (nanospec_fx/eagle/__init__.py).

Greedy speculative decoding with the nanospec-compiled drafter must give exactly the target's
greedy output, and every token the drafter proposes must be active when it is proposed. The
drafter copies the target's only layer (plus noise) so that drafts are often accepted and the
accept/reject paths of the loop are all exercised.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

transformers = pytest.importorskip("transformers")

import nanospec_fx  # noqa: E402
from nanospec_fx.eagle import DraftTree, EagleConfig, EagleDrafter, draft_chain, draft_tree, feed  # noqa: E402
from nanospec_fx.eagle.speculative import greedy_generate, hf_target_forward, speculative_generate  # noqa: E402
from nanospec_fx.testing import assert_equivalent  # noqa: E402
from helpers import tiny_llama  # noqa: E402

V = 1000


def models(noise: float = 0.1, init: float = 0.02):
    """A one-layer target and a drafter copying its layer. ``init`` 0.3 gives peaked distributions
    (draft scores that depend visibly on attention); the default gives long accepted runs."""
    target = tiny_llama(V, 1, 0, initializer_range=init)
    drafter = EagleDrafter(EagleConfig.from_target(target.config), target.model.embed_tokens, target.lm_head)
    return target, drafter.copy_target_layer(target.model.layers[0], noise).eval()


def prompt(length: int = 12):
    return torch.randint(0, V, (1, length), generator=torch.Generator().manual_seed(2))


@torch.inference_mode()
def root_of(target, drafter, ids, cache_len=64):
    """Prefill: the drafter's cache over the prompt and the root of the first round."""
    logits, features = hf_target_forward(target)(ids)
    seq = ids[0].tolist() + [int(logits[0, -1].argmax())]
    cache = drafter.new_cache(cache_len)
    root_logits, root_hidden = feed(drafter, cache, torch.tensor(seq[1:]), features[0], 0)
    return cache, root_logits, root_hidden


class CheckedDrafter:
    """The compiled drafter, checking at every call that only active tokens get a finite logit."""

    def __init__(self, module, **options):
        self._orig_mod = module
        self.compiled = torch.compile(module, backend="nanospec", options={"inductor": False, **options})
        self.calls = 0

    def __call__(self, *args):
        logits, hidden = self.compiled(*args)
        scored = torch.isfinite(logits).flatten(0, -2).any(0).nonzero().flatten()
        assert nanospec_fx.active_vocab(self._orig_mod).contains(scored).all(), "an inactive token got a logit"
        self.calls += 1
        return logits, hidden


# ----------------------------------------------------------------------------- drafting
def test_tree_with_top_k_one_is_the_chain():
    target, drafter = models(init=0.3)
    cache, root_logits, root_hidden = root_of(target, drafter, prompt())
    with torch.inference_mode():
        chain = draft_chain(drafter, cache, root_logits, root_hidden, 12, depth=4)
        tree = draft_tree(drafter, cache, root_logits, root_hidden, 12, depth=4, top_k=1)
    assert torch.equal(chain.tokens, tree.tokens) and torch.equal(chain.parents, tree.parents)
    torch.testing.assert_close(chain.scores, tree.scores)
    assert chain.paths() == [chain.tokens.tolist()]


def test_tree_scores_are_log_probs_of_each_path_drafted_one_token_at_a_time():
    """Tree attention (frontier rows sharing one call, masked to their ancestors) == plain chains."""
    target, drafter = models(init=0.3)
    ids = prompt()
    cache, root_logits, root_hidden = root_of(target, drafter, ids)
    with torch.inference_mode():
        tree = draft_tree(drafter, cache, root_logits, root_hidden, 12, depth=3, top_k=3)
    assert tree.tokens.shape == (3 + 2 * 9,)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    for index in range(len(tokens)):
        path, node = [], index
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        path.reverse()
        cache, logits, hidden = root_of(target, drafter, ids)  # a fresh cache for each chain
        score = 0.0
        with torch.inference_mode():
            for d, token in enumerate(path):
                score += torch.log_softmax(logits.float(), -1)[token].item()
                slot = torch.tensor([12 + d])
                mask = (torch.arange(cache.max_len) <= slot)[None]
                out, h = drafter(
                    torch.tensor([[token]]), hidden.view(1, 1, -1), slot.view(1, 1), slot, mask, cache.k, cache.v
                )
                logits, hidden = out[0, -1], h[0, -1]
        assert tree.scores[index].item() == pytest.approx(score, abs=1e-4), f"candidate {index}, path {path}"
    # The frontier kept at each depth is the best top_k by cumulative score.
    depth2 = tree.scores[3:12]
    expanded = set(tree.parents[12:].tolist())
    assert expanded == {3 + i for i in depth2.topk(3).indices.tolist()}


def test_paths_keep_the_best_nodes_with_their_ancestors_and_skip_missing_ones():
    inf = float("-inf")
    #            0     1     2     3     4     5
    tree = DraftTree(tokens=torch.tensor([10, 11, 12, 13, 14, 15]), parents=torch.tensor([-1, -1, 0, 0, 1, 2]),
                     scores=torch.tensor([-1.0, -2.0, -1.5, -5.0, inf, -1.6]))
    assert tree.paths(3) == [[10, 12, 15]]  # nodes 0, 2, 5
    assert sorted(tree.paths(4)) == [[10, 12, 15], [11]]
    assert sorted(tree.paths()) == [[10, 12, 15], [10, 13], [11]]  # node 4 does not exist
    tie = DraftTree(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1, 0]), scores=torch.tensor([-1.0, -1.0]))
    assert tie.paths(1) in ([[1]], [[1, 2]])  # a chosen child brings its parent along


# ----------------------------------------------------------------------------- losslessness
def test_full_vocabulary_drafter_is_lossless():
    target, drafter = models()
    forward = hf_target_forward(target)
    expected = greedy_generate(forward, prompt(), 20)
    out, stats = speculative_generate(forward, drafter, prompt(), 20, depth=4, top_k=4)
    assert torch.equal(out, expected)
    assert sum(stats.accepted) > 0 and stats.mean_accept_length > 1


@pytest.mark.parametrize("chain", [False, True], ids=["tree", "chain"])
def test_nanospec_drafter_is_lossless_and_only_drafts_active_tokens(chain):
    target, module = models()
    drafter = CheckedDrafter(module, capacity=256)
    forward, ids = hf_target_forward(target), prompt()
    expected = greedy_generate(forward, ids, 20)

    def only_active(tree):
        drafted = tree.tokens[torch.isfinite(tree.scores)]
        assert nanospec_fx.active_vocab(module).contains(drafted).all(), "a drafted token was not active"

    out, stats = speculative_generate(forward, drafter, ids, 20, depth=4, top_k=4, chain=chain, on_draft=only_active)
    assert torch.equal(out, expected), "speculative output differs from the target's greedy output"
    assert sum(stats.accepted) > 0, "no draft was ever accepted: the accept path went untested"
    assert drafter.calls >= stats.rounds * 3
    state = nanospec_fx.active_vocab(module)
    assert state.contains(ids).all()
    assert len(state) < V // 5, "the drafter's head computes a small set, not the vocabulary"


def test_drafter_step_keeps_the_nanospec_contract():
    """The drafter itself, checked with nanospec_fx.testing on a tree-shaped step."""
    target, drafter = models()
    cache = drafter.new_cache(16)
    k, start = 4, 6
    ids = torch.randint(0, V, (1, k), generator=torch.Generator().manual_seed(3))
    features = torch.randn(1, k, 32)
    slots = start + torch.arange(k)
    mask = (torch.arange(16) < start) | (torch.arange(16) == slots[:, None])
    inputs = (ids, features, torch.full((1, k), start), slots, mask, cache.k, cache.v)
    state = assert_equivalent(drafter, inputs, options={"capacity": 64}, active_ids=[1, 2, 3], token_inputs=[0])
    assert state.contains(ids).all()


def _step_inputs(drafter, k: int = 4, start: int = 6, length: int = 16):
    cache = drafter.new_cache(length)
    ids = torch.randint(0, V, (1, k), generator=torch.Generator().manual_seed(3))
    slots = start + torch.arange(k)
    mask = (torch.arange(length) < start) | (torch.arange(length) <= slots[:, None])
    return (ids, torch.randn(1, k, 32), (start + torch.arange(k))[None], slots, mask, cache.k, cache.v)


def test_logits_to_keep_scores_only_the_last_positions():
    _, drafter = models()
    with torch.inference_mode():
        every, hidden = drafter(*_step_inputs(drafter))
        last, hidden_kept = drafter(*_step_inputs(drafter), logits_to_keep=1)
    assert every.shape[:2] == (1, 4) and last.shape[:2] == (1, 1)
    torch.testing.assert_close(last[:, 0], every[:, -1])
    torch.testing.assert_close(hidden_kept, hidden)  # the hidden state of every position is still returned


def test_the_mtp_layout_normalises_both_inputs_and_keeps_the_contract():
    target = tiny_llama(V, 1, 0)
    config = EagleConfig.from_target(target.config)
    config.layout = "mtp"
    drafter = EagleDrafter(config, target.model.embed_tokens, target.lm_head, target.model.norm).eval()
    assert drafter.fc.bias is None and drafter.trained_modules() == ("enorm", "hnorm", "fc", "layer")
    inputs = _step_inputs(drafter)
    with torch.inference_mode():
        base, _ = drafter(*inputs)
        scaled, _ = drafter(inputs[0], 1000 * inputs[1], *inputs[2:])  # hnorm: the feature's scale does not matter
    torch.testing.assert_close(scaled, base, rtol=1e-4, atol=1e-4)
    state = assert_equivalent(drafter, _step_inputs(drafter), options={"capacity": 64}, active_ids=[1, 2, 3],
                              token_inputs=[0])
    assert len(state) > 0


def test_a_drafter_picking_its_tokens_reads_no_vocabulary_wide_row():
    """``draft_topk``: compiled with nanospec, the log-softmax and top-k run on the compact logits and the ids are
    mapped back (no [V] fill or scatter, counted by the profiler on the graph's aten ops), with the tokens and
    log-probs the [V] logits give; the logits path, which a caller that needs [V] gets, still writes the row."""
    _, module = models()
    drafter = torch.compile(module, backend="nanospec", options={"inductor": False, "capacity": 256})
    inputs = _step_inputs(module)

    def vocabulary_wide_ops(**keywords):
        with torch.inference_mode():
            drafter(*inputs, **keywords)  # compiled before it is profiled
            with torch.profiler.profile(record_shapes=True) as prof:
                out = drafter(*inputs, **keywords)
        # the observe's own [V] membership lookups (inside nanospec::observe) are not a row of logits
        return out, {e.name for e in prof.events() if e.name.startswith("aten::") and not _inside_observe(e)
                     and any(shape and shape[-1] == V for shape in e.input_shapes)}

    vocabulary_wide_ops(logits_to_keep=1, draft_topk=3)  # the first call makes the set
    nanospec_fx.active_vocab(module).observe(torch.arange(0, V, 7))
    ((scores, tokens), _), wide = vocabulary_wide_ops(logits_to_keep=1, draft_topk=3)
    (logits, _), wide_logits = vocabulary_wide_ops(logits_to_keep=1)
    assert not wide, f"the choice read a [V] row: {wide}"
    assert "aten::scatter_" in wide_logits or "aten::index_put_" in wide_logits, wide_logits
    best = torch.log_softmax(logits[0, -1], -1).topk(3)
    assert torch.equal(tokens[0, -1], best.indices)
    torch.testing.assert_close(scores[0, -1], best.values)
    assert nanospec_fx.active_vocab(module).contains(tokens).all()


def _inside_observe(event) -> bool:
    while event is not None:
        if event.name.startswith("nanospec::observe"):
            return True
        event = event.cpu_parent
    return False


@pytest.mark.parametrize("chain", [False, True], ids=["tree", "chain"])
def test_a_compiled_drafter_picking_its_tokens_is_lossless(chain):
    """The draft loop hands an EagleDrafter ``draft_topk`` (its chain's top-1, its tree's top-k): the output is
    the target's greedy output and every drafted token is active."""
    target, module = models()
    drafter = torch.compile(module, backend="nanospec", options={"inductor": False, "capacity": 256})
    forward, ids = hf_target_forward(target), prompt()
    drafted = []
    out, stats = speculative_generate(forward, drafter, ids, 20, depth=4, top_k=4, chain=chain,
                                      on_draft=lambda tree: drafted.append(tree.tokens[torch.isfinite(tree.scores)]))
    assert torch.equal(out, greedy_generate(forward, ids, 20))
    assert sum(stats.accepted) > 0
    assert nanospec_fx.active_vocab(module).contains(torch.cat(drafted)).all()
