"""transformers' assisted generation with do_sample=True through speculative_pair keeps the target's distribution.

transformers verifies drafts with ``transformers.generation.utils._speculative_sampling``: q is the softmax
of the assistant's *processed* scores (``output_scores`` of its ``generate``: after temperature,
top-k, top-p), acceptance is ``rand <= p(x) / q(x)`` and the residual is ``clamp(p - q, 0)``
normalised over the whole vocabulary. With a nanospec drafter the scores are -inf outside the
active set, so q is 0 there: a drafted token always has q > 0 (no 0/0), and the residual keeps
the target's mass outside the active set. The tests check those facts on the tensors transformers
uses, and the output distribution with a chi-square test.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

transformers = pytest.importorskip("transformers")

import transformers.generation.utils as generation_utils  # noqa: E402

import nanospec_fx  # noqa: E402
from nanospec_fx.sampling import SpeculativeSampler  # noqa: E402
from nanospec_fx.testing import chi_square_test, sequence_distribution  # noqa: E402

V, CAPACITY, TEMPERATURE = 12, 4, 1.5
PROMPT = torch.tensor([[1, 2, 3]])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is faster, and much faster on a loaded machine
    yield
    torch.set_num_threads(threads)


def tiny_llama(seed: int):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.3,
                                      max_position_embeddings=64, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def pair():
    """A target and a drafter with the target's weights (drafts are accepted often), compiled by speculative_pair."""
    target, drafter = tiny_llama(0), tiny_llama(0)
    probs = lambda ids: SpeculativeSampler(TEMPERATURE).probs(target(ids).logits[:, -1])  # noqa: E731
    exact = sequence_distribution(probs, PROMPT, 2)  # before compiling: the target alone
    state = nanospec_fx.speculative_pair(target, drafter, capacity=CAPACITY, inductor=False)
    return target, drafter, state, exact


def sample(target, drafter, state, n, seed=0, **kwargs):
    torch.manual_seed(seed)  # transformers draws from the global generator
    out = []
    with torch.inference_mode():
        for _ in range(n):
            with state.request():
                ids = target.generate(PROMPT, max_new_tokens=2, do_sample=True, temperature=TEMPERATURE,
                                      assistant_model=drafter, **kwargs)
            out.append(ids[0, PROMPT.shape[1]:])
    return torch.stack(out)


class Spy:
    """Wraps transformers' _speculative_sampling and checks the q it is given."""

    def __init__(self, state):
        self.state, self.calls, self.empty_rounds = state, [], 0
        self.original = generation_utils._speculative_sampling

    def __call__(self, candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs):
        finite = torch.isfinite(candidate_logits)
        assert (finite.sum(-1) <= CAPACITY).all(), "q is not pruned: more finite drafter scores than the capacity"
        drafted = candidate_input_ids[:, -candidate_length:]
        assert finite.gather(-1, drafted[..., None]).all(), "a drafted token has q = 0"
        assert not torch.isnan(candidate_logits).any() and not torch.isnan(new_logits).any()
        out = self.original(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs)
        self.calls.append(int(out[1]))
        return out


def test_assisted_sampling_uses_the_pruned_q_and_keeps_the_target_distribution(pair, monkeypatch):
    target, drafter, state, exact = pair
    spy = Spy(state)
    monkeypatch.setattr(generation_utils, "_speculative_sampling", spy)
    samples = sample(target, drafter, state, 200)
    result = chi_square_test(samples, exact)
    assert not result.rejected, str(result)
    assert len(spy.calls) >= 200, "every request verified a draft with speculative sampling"
    assert spy.calls.count(0) > 20 and sum(spy.calls) > 30, "both the reject and the accept paths ran"
    print(result, f"; drafts accepted per round: {sum(spy.calls) / len(spy.calls):.2f}")


def test_assisted_sampling_with_verification_against_the_unpruned_q_fails_the_test(pair, monkeypatch):
    """Broken on purpose: the drafter samples from its pruned scores, q comes from its dense logits."""
    target, drafter, state, exact = pair
    original = generation_utils._speculative_sampling
    warp = SpeculativeSampler(TEMPERATURE).warp

    def unpruned_q(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs):
        dense = drafter.forward(candidate_input_ids).logits[:, -candidate_length - 1:-1]  # eager: no nanospec
        return original(candidate_input_ids, warp(dense), candidate_length, new_logits, **kwargs)

    monkeypatch.setattr(generation_utils, "_speculative_sampling", unpruned_q)
    result = chi_square_test(sample(target, drafter, state, 150), exact)
    assert result.rejected, str(result)
    print(f"unpruned q: {result}")


def test_top_k_and_top_p_with_a_small_active_set_give_no_nan_and_valid_tokens(pair, monkeypatch):
    """top-k / top-p filter the pruned scores further (q may be one-hot); rounds at the length limit draft nothing."""
    target, drafter, state, _ = pair
    rounds, kwargs = [], {}
    original = generation_utils._speculative_sampling

    def checked(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kw):
        finite = torch.isfinite(candidate_logits).sum(-1)
        assert ((finite >= 1) & (finite <= min(CAPACITY, kwargs.get("top_k", V)))).all()
        out = original(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kw)
        assert ((out[0] >= 0) & (out[0] < V)).all()
        rounds.append(candidate_length)
        return out

    monkeypatch.setattr(generation_utils, "_speculative_sampling", checked)
    torch.manual_seed(0)
    with torch.inference_mode():
        for kwargs in (dict(top_k=3), dict(top_p=0.7), dict(top_k=2, top_p=0.9)):
            for _ in range(10):  # max_new_tokens=2 as above: the same compiled graphs (no recompile)
                with state.request():
                    ids = target.generate(PROMPT, max_new_tokens=2, do_sample=True, temperature=0.8, **kwargs,
                                          assistant_model=drafter)
                assert ids.shape == (1, PROMPT.shape[1] + 2) and ((ids >= 0) & (ids < V)).all()
    assert len(rounds) == 30, "every request ran one speculative sampling round"
