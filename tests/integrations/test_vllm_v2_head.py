"""The Model Runner V2 head's engine-agnostic pieces (nanospec_fx/integrations/vllm/head.py), without vLLM: the
compact head in a drafter's ``lm_head`` slot, read the way vLLM 0.33's ``LogitsProcessor`` reads a head, over
``RequestVocabs`` with the request of each batch row named by a device buffer of request slots (V2's
``idx_mapping``, -1 for padding), and the observe of sampled and top-k tokens, with no host read."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanospec_fx.integrations.vllm.head import CompactLMHead, SlotRows
from nanospec_fx.request_vocab import RequestVocabs

VOCAB, PADDED, HIDDEN, SLOTS = 30, 32, 8, 4


class HostReads(TorchDispatchMode):
    """Records every op that reads a device value on the host (``.item()``, ``bool(t)``, ``nonzero``...)."""

    HOST = {"_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.HOST:
            self.reads.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _setup(positions=1):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(PADDED, HIDDEN, generator=g)  # a vocabulary-padded head: rows VOCAB.. are padding
    source = SimpleNamespace(weight=weight, org_vocab_size=VOCAB, shard_indices=SimpleNamespace(
        num_org_vocab_padding=PADDED - VOCAB, org_vocab_start_index=0))
    vocabs = RequestVocabs(weight[:VOCAB], None, SLOTS + 1, capacity=8)
    slot_rows = SlotRows(vocabs, SLOTS)
    slots = torch.full((SLOTS,), -1, dtype=torch.int32)  # the engine's buffer, rewritten every step
    return weight, slot_rows, slots, CompactLMHead(source, vocabs, slot_rows, slots, positions)


def _processor_logits(head, x):
    """What vLLM 0.33's LogitsProcessor._get_logits does with a head at tp_size 1 (no bias, no head_dtype cast)."""
    assert head.tp_size == 1
    return head.quant_method.apply(head, x, bias=None)[..., : head.org_vocab_size]


def _masked_dense(weight, x, sets):
    dense = x @ weight[:VOCAB].T
    out = torch.full_like(dense, float("-inf"))
    for i, tokens in enumerate(sets):
        out[i, tokens] = dense[i, tokens]
    return out


def test_request_rows_from_the_device_buffer_give_masked_dense_logits():
    weight, slot_rows, slots, head = _setup()
    prompts = {2: [3, 4, 5], 0: [7], 3: [29, 0]}
    for slot, prompt in prompts.items():
        slot_rows.add(slot, f"req-{slot}", prompt)
    x = torch.randn(SLOTS, HIDDEN, generator=torch.Generator().manual_seed(1))
    for step in ([2, 0, 3, -1], [3, 2, -1, -1]):  # the engine writes the step's slots in place; padding is -1
        slots.copy_(torch.tensor(step, dtype=torch.int32))
        sets = [prompts.get(s, []) for s in step]
        torch.testing.assert_close(_processor_logits(head, x), _masked_dense(weight, x, sets))
    full = head.quant_method.apply(head, x)
    assert full.shape == (SLOTS, PADDED) and torch.isneginf(full[:, VOCAB:]).all()  # padding columns never win


def test_observe_sampled_and_topk_on_the_device_then_release():
    weight, slot_rows, slots, head = _setup()
    slot_rows.add(1, "a", [1])
    slot_rows.add(2, "b", [2])
    # a verify step: 3 sampled slots per request, num_sampled says how many are real; a padded batch row (-1)
    step = torch.tensor([2, 1, -1])
    sampled = torch.tensor([[10, 11, 12], [20, 21, 22], [5, 6, 7]])
    valid = torch.arange(3)[None, :] < torch.tensor([1, 3, 3])[:, None]
    with HostReads() as mode:
        slot_rows.observe(step, sampled, valid)
        slot_rows.observe(step[:2], torch.tensor([[13], [23]]))  # e.g. the target's top-1
    assert mode.reads == []
    vocabs = slot_rows.vocabs
    assert sorted(vocabs.token_ids("b").tolist()) == [2, 10, 13]
    assert sorted(vocabs.token_ids("a").tolist()) == [1, 20, 21, 22, 23]
    assert vocabs.token_ids(("nanospec", "padding")).tolist() == []  # the padding row stays empty
    slot_rows.remove(2)
    assert "b" not in vocabs and int(slot_rows.map[2]) == slot_rows.pad
    slot_rows.add(2, "c", [4])
    slots.copy_(torch.tensor([2, 1, -1, -1], dtype=torch.int32))
    x = torch.randn(SLOTS, HIDDEN)
    torch.testing.assert_close(_processor_logits(head, x), _masked_dense(weight, x, [[4], [1, 20, 21, 22, 23], [], []]))


def test_head_call_reads_nothing_on_the_host_and_parallel_rows_are_request_major():
    weight, slot_rows, slots, head = _setup(positions=3)  # a parallel drafter: 3 positions per request
    slot_rows.add(0, "a", [1, 2])
    slot_rows.add(3, "b", [9])
    slots.copy_(torch.tensor([3, 0, -1, -1], dtype=torch.int32))
    x = torch.randn(6, HIDDEN)
    with HostReads() as mode:
        out = _processor_logits(head, x)
    assert mode.reads == []
    torch.testing.assert_close(out, _masked_dense(weight, x, [[9]] * 3 + [[1, 2]] * 3))
    assert (head.compact_calls, head.dense_calls) == (1, 0)


@pytest.mark.parametrize("bad", ["bias", "rows"])
def test_what_the_head_cannot_serve_runs_dense(bad):
    weight, slot_rows, slots, head = _setup(positions=3)
    x = torch.randn(6 if bad == "bias" else 5, HIDDEN)  # 5 rows: not whole requests of 3 positions
    bias = torch.randn(PADDED) if bad == "bias" else None
    torch.testing.assert_close(head.quant_method.apply(head, x, bias=bias),
                               torch.nn.functional.linear(x, weight, bias))
    assert (head.compact_calls, head.dense_calls) == (0, 1)


def test_slot_rows_need_a_padding_row():
    with pytest.raises(ValueError, match="4 request slots need 5 request rows"):
        SlotRows(RequestVocabs(torch.randn(VOCAB, HIDDEN), None, SLOTS, capacity=8), SLOTS)


def test_v2_hooks_on_a_simulated_step(monkeypatch):
    """v0_33's V2 hooks driven by stand-ins shaped like 0.33.0's objects (read in its source; no vLLM here): the
    speculator's load puts a CompactLMHead in the drafter's lm_head slot (the target's head object untouched), a new
    request's slot gets a row seeded with its prompt, the rejection sampler's logits give their top-k and
    postprocess_sampled the sampled tokens (up to num_sampled) to the request in each row's slot, the drafter's
    logits processor then reads masked logits through the slot buffer, and a removed request frees its row."""
    from nanospec_fx.integrations.vllm import v0_33
    from nanospec_fx.integrations.vllm.config import ENV_HEAD, ENV_TOPK

    monkeypatch.setenv(ENV_HEAD, "compact")
    monkeypatch.setenv(ENV_TOPK, "1")
    g = torch.Generator().manual_seed(0)
    target_head = SimpleNamespace(weight=torch.randn(PADDED, HIDDEN, generator=g), tp_size=1, org_vocab_size=VOCAB,
                                  quant_method=None, shard_indices=None)
    model = torch.nn.Module()
    model.lm_head = target_head
    model.logits_processor = SimpleNamespace(org_vocab_size=VOCAB, logits_as_input=False, head_dtype=None)
    model.config = SimpleNamespace(vocab_size=VOCAB)
    speculator = SimpleNamespace(model=model, speculative_config=SimpleNamespace(method="eagle"), max_num_reqs=SLOTS,
                                 idx_mapping=torch.full((SLOTS,), -1, dtype=torch.int32),
                                 use_local_argmax_reduction=False)
    v0_33.after_speculator_load(lambda *a, **k: None, speculator, object())
    head = model.lm_head
    assert isinstance(head, CompactLMHead) and head.weight is target_head.weight
    class Runner:  # V2's GPUModelRunner: what the hooks read of it
        pass

    runner = Runner()
    runner.speculator, runner.req_states = speculator, SimpleNamespace(req_id_to_index={})

    def add(original, req_id, slot, prompt):
        runner.req_states.req_id_to_index[req_id] = slot
        new = SimpleNamespace(req_id=req_id, prefill_token_ids=prompt)
        v0_33.after_add_requests(lambda *a, **k: None, runner, SimpleNamespace(scheduled_new_reqs=[new]))

    add(None, "r1", 3, [4, 5])
    add(None, "r2", 0, [9])
    # the verify step of batch [r2, r1]: 2 logits rows for r2 (1 draft), 1 for r1; expanded_idx_mapping names slots
    logits = torch.full((3, PADDED), -5.0)
    logits[0, 11], logits[1, 12], logits[2, 13] = 1.0, 1.0, 1.0
    v0_33.before_rejection_sample(lambda *a, **k: None, None, logits,
                                  SimpleNamespace(expanded_idx_mapping=torch.tensor([0, 0, 3])))
    v0_33.before_postprocess_sampled(lambda *a, **k: None, runner, torch.tensor([0, 3]),
                                     torch.tensor([[20, 21], [22, 23]]), torch.tensor([2, 1]), torch.tensor([0, 0]))
    speculator.idx_mapping.copy_(torch.tensor([3, 0, -1, -1], dtype=torch.int32))
    x = torch.randn(2, HIDDEN, generator=g)
    torch.testing.assert_close(_processor_logits(head, x),
                               _masked_dense(target_head.weight, x, [[4, 5, 13, 22], [9, 11, 12, 20, 21]]))
    v0_33.before_remove_request(lambda *a, **k: None, runner, "r1")
    assert "r1" not in head.vocabs and "r2" in head.vocabs
    from nanospec_fx.integrations.vllm.metrics import activity_of

    assert activity_of(runner).status() == "active"  # a sampled step went through the V2 head
