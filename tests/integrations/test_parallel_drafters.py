"""Parallel drafters (K positions per forward, [B, K, H] -> [B, K, V]) that score the target's own head.

* DFlash in transformers (``generate(assistant_model=drafter, speculation_type="dflash")``, the drafter a
  ``MuseGlimmerAssistantModel``): ``nanospec_fx.speculative_pair(target, drafter)`` makes the generator's call of
  the target's output embedding compact; greedy output equals the target alone.
* A P-EAGLE-style drafter written by hand and compiled with nanospec: one compact head call of ``B*K`` rows per
  step, the target's top-k observed once per verification (not once per position).

Head calls and observes are counted on the reference kernels (``use_kernels("reference")``), which every
nanospec op runs through, compiled or eager.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn

transformers = pytest.importorskip("transformers")
from transformers.generation import candidate_generator  # noqa: E402

import nanospec_fx  # noqa: E402
from nanospec_fx.eagle.speculative import greedy_generate, hf_target_forward  # noqa: E402

V, H, CAPACITY = 96, 32, 16  # V wider than every other axis of the tiny models
HEAD_OPS = ("compact_logits", "head_logits")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def op_calls(monkeypatch, use_kernels):
    """Every nanospec kernel call as (op, shape of its first argument), in order (not the calls one kernel makes
    of another: head_logits computes compact_logits)."""
    import nanospec_fx.kernels.reference  # noqa: F401

    use_kernels("reference")
    module, calls, depth = sys.modules["nanospec_fx.kernels.reference"], [], [0]
    for name in ("observe", *HEAD_OPS):
        def counted(*args, _name=name, _original=getattr(module, name), **kwargs):
            if not depth[0]:
                calls.append((_name, tuple(args[0].shape)))
            depth[0] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1
        monkeypatch.setattr(module, name, counted)
    return calls


def tiny_target(seed=0, layers=3):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                      pad_token_id=0, eos_token_id=None, bos_token_id=None, initializer_range=0.3)
    return transformers.LlamaForCausalLM(config).eval()


# ----------------------------------------------------------------------------- DFlash (transformers)
BLOCK = 4  # DFlash drafts block_size - 1 tokens per step: K = 3


def dflash_checkpoints(path):
    """A tiny Llama target and a DFlash drafter (MuseGlimmerAssistantModel), saved and loaded back from disk."""
    target = tiny_target()
    config = transformers.MuseGlimmerAssistantConfig(
        hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, block_size=BLOCK, mask_token_id=V - 1, target_layer_ids=[0, 2], max_position_embeddings=128,
        sliding_window=64, pad_token_id=0, eos_token_id=None, bos_token_id=None, initializer_range=0.3)
    torch.manual_seed(1)
    target.save_pretrained(path / "target")
    transformers.MuseGlimmerAssistantModel(config).save_pretrained(path / "drafter")
    return (transformers.AutoModelForCausalLM.from_pretrained(path / "target").eval(),
            transformers.MuseGlimmerAssistantModel.from_pretrained(path / "drafter").eval())


def test_dflash_drafts_with_one_compact_head_call_per_step_and_keeps_greedy_output(tmp_path, op_calls, monkeypatch):
    target, drafter = dflash_checkpoints(tmp_path)
    assert drafter.get_output_embeddings() is None, "a DFlash drafter scores the target's head"
    prompts = [torch.randint(1, V - 1, (1, n), generator=torch.Generator().manual_seed(n)) for n in (8, 5)]
    run = dict(do_sample=False, assistant_model=drafter, speculation_type="dflash")
    with torch.inference_mode():
        plain = [target.generate(p, max_new_tokens=12, do_sample=False) for p in prompts]
        dense = [target.generate(p, max_new_tokens=12, **run) for p in prompts]
    state = nanospec_fx.speculative_pair(target, drafter, capacity=CAPACITY, inductor=False)
    assert getattr(target, "_compiled_call_impl", None) is None, "the target (verification) is not compiled"
    steps, original, seen = [], candidate_generator.DFlashTokenCandidateGenerator.get_candidates, [0]

    def spy(self, *a, **k):  # runs inside the pair's wrapper: the ops since the last step are this step's
        out = original(self, *a, **k)
        if out[1] is not None:
            steps.append((out[1].clone(), state.token_ids().clone(), op_calls[seen[0]:]))
        seen[0] = len(op_calls)
        return out

    monkeypatch.setattr(candidate_generator.DFlashTokenCandidateGenerator, "get_candidates", spy)
    resets, reset = [], state.reset
    monkeypatch.setattr(state, "reset", lambda: (resets.append(1), reset())[1])
    with torch.inference_mode():
        outs = [target.generate(p, max_new_tokens=12, **run) for p in prompts]
    assert all(torch.equal(o, p) for o, p in zip(outs, plain)) and all(torch.equal(d, p) for d, p in zip(dense, plain))
    assert len(resets) == 2, "each generate call (one request) starts from a reset set"
    assert steps, "DFlash drafted"
    for logits, active, calls in steps:
        assert logits.shape == (1, BLOCK - 1, V)
        finite = torch.isfinite(logits)
        assert (finite.sum(-1) <= CAPACITY).all() and finite.any(-1).all(), "the drafting head is compact"
        assert set(finite.nonzero()[:, -1].tolist()) <= set(active.tolist())
        heads = [shape for name, shape in calls if name in HEAD_OPS]
        assert len(heads) == 1 and heads[0][:-1] == (1, BLOCK - 1), f"one head call of B*K rows per step: {calls}"
        # before drafting: the tokens committed since the last step, then the target's top-k at the verified positions
        assert [name for name, _ in calls].count("observe") == 2, calls
    nanospec_fx.detach(target)
    before = len(op_calls)
    with torch.inference_mode():
        assert torch.equal(target.generate(prompts[0], max_new_tokens=12, **run), plain[0])
    assert len(op_calls) == before, "detached: the generator calls the dense head again"


# ----------------------------------------------------------------------------- P-EAGLE style, written by hand
K = 4


class ParallelDrafter(nn.Module):
    """P-EAGLE style: K positions in one forward, the anchor token then K-1 mask tokens, each with the target's
    feature at the anchor; the positions see each other (a mean over K); the target's own head scores all of them,
    [B, K, H] -> [B, K, V]. ``gate[0] = 0``: position 0 is the target's own read of the feature (often accepted),
    the others are random drafts."""

    def __init__(self, target):
        super().__init__()
        self.embed, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        self.fc, self.mix = nn.Linear(2 * H, H), nn.Linear(H, H)
        self.register_buffer("gate", (torch.arange(K) > 0).float()[:, None])

    def forward(self, ids, feature):  # ids [B, K], feature [B, H]
        f = feature[:, None].expand(-1, ids.shape[1], -1)
        x = self.fc(torch.cat([self.embed(ids), f], -1))
        x = x + self.mix(x.mean(1, keepdim=True))
        return self.lm_head(f + self.gate * x)


@torch.inference_mode()
def parallel_decode(target, drafter, prompts, new_tokens, state, op_calls, rounds):
    """Greedy speculative decoding of a batch: one drafter call per round for all rows, each row verified by its
    own target forward (the rows accept different numbers of drafts), the target's top-k at every verified position
    of every row observed in one call."""
    forward = hf_target_forward(target)
    seqs = [p[0].tolist() for p in prompts]
    state.observe(torch.cat([p[0] for p in prompts]))
    accepted = []
    while any(len(s) - p.shape[1] < new_tokens for s, p in zip(seqs, prompts)):
        features = torch.stack([forward(torch.tensor([s]))[1][0, -1] for s in seqs])  # the target at each anchor
        ids = torch.tensor([[s[-1]] + [V - 1] * (K - 1) for s in seqs])  # anchor, then mask tokens
        before = len(op_calls)
        drafts = drafter(ids, features).argmax(-1).tolist()
        verified = []
        for b, s in enumerate(seqs):
            logits = forward(torch.tensor([s + drafts[b]]))[0][0, len(s) - 1:]
            greedy, m = logits.argmax(-1).tolist(), 0
            while m < K and drafts[b][m] == greedy[m]:
                m += 1
            s += drafts[b][:m] + [greedy[m]]
            accepted.append(m)
            verified.append(logits.topk(3, dim=-1).indices)
        state.observe(torch.cat(verified))  # once per verification
        rounds.append(op_calls[before:])
    return [s[: p.shape[1] + new_tokens] for s, p in zip(seqs, prompts)], accepted


def test_parallel_drafter_one_compact_head_call_of_b_times_k_rows_per_step(op_calls):
    target = tiny_target(seed=2, layers=2)
    drafter = ParallelDrafter(target).eval()
    state = nanospec_fx.attach(drafter, head="lm_head.weight", capacity=CAPACITY)
    compiled = torch.compile(drafter, backend="nanospec", options={"capacity": CAPACITY, "inductor": False})
    prompts = [torch.randint(1, V - 1, (1, n), generator=torch.Generator().manual_seed(n)) for n in (6, 9)]
    rounds = []
    out, accepted = parallel_decode(target, compiled, prompts, 10, state, op_calls, rounds)
    for o, p in zip(out, prompts):
        assert o == greedy_generate(hf_target_forward(target), p, 10)[0].tolist(), "greedy output of the target alone"
    assert sum(accepted) > 0, "drafts were accepted: the commit of several tokens per round ran"
    assert rounds
    for calls in rounds:
        heads = [shape for name, shape in calls if name in HEAD_OPS]
        assert len(heads) == 1 and heads[0][:-1] in ((2, K), (2 * K,)), f"one head call of B*K rows per step: {calls}"
        observes = [shape for name, shape in calls if name == "observe"]
        # the drafter's fed ids [B, K] (the pass's input observer), then the target's top-k: once, not per position
        assert len(observes) == 2 and observes[1][-1] == 3, calls
    (head,) = nanospec_fx.explain(compiled, quiet=True).heads
    assert head.rewritten and head.state is state
