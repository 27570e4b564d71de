"""The Model Runner V2 head's engine-agnostic pieces (nanospec_fx/integrations/vllm/head.py), without vLLM: the
compact head in a drafter's ``lm_head`` slot, read the way vLLM 0.33's ``LogitsProcessor`` reads a head, over
``RequestVocabs`` with the request of each batch row named by a device buffer of request slots (V2's
``idx_mapping``, -1 for padding), and the observe of sampled and top-k tokens, with no host read."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanospec_fx.integrations.vllm.head import CompactLMHead, SlotRows
from nanospec_fx.vocab.request_vocab import RequestVocabs

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
    """The V2 hooks (runner_v2, installed by v0_33 with NANOSPEC_VLLM_V2=1 and by v0_34) driven by stand-ins shaped
    like 0.33.0's objects (read in its source; no vLLM here; tests/integrations/test_vllm_v2_classes.py drives them with
    vLLM 0.34.0's real classes): the
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


class _Processor(SimpleNamespace):
    """What the V2 hooks read of vLLM's LogitsProcessor, and what its forward does at tp_size 1 with no bias:
    ``lm_head.quant_method.apply`` then the vocabulary-padding columns cut (vllm/model_executor/layers/
    logits_processor.py)."""

    def __call__(self, lm_head, hidden_states):
        return lm_head.quant_method.apply(lm_head, hidden_states, bias=None)[..., : self.org_vocab_size]


def _eagle3(draft_rows_to_target, target_vocab=100, seed=0):
    """A stand-in EAGLE-3 drafter shaped like vLLM's ``Eagle3LlamaForCausalLM``: a head over the draft vocabulary
    (padded to 64 rows), ``draft_id_to_target_id`` holding offsets (head row r scores target id r + d2t[r]), and its
    ``compute_logits`` (the draft logits scattered into the target vocabulary, -inf elsewhere)."""
    draft = len(draft_rows_to_target)
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Module()
    model.lm_head = SimpleNamespace(weight=torch.randn(64, HIDDEN, generator=g), tp_size=1, org_vocab_size=draft,
                                    num_embeddings_per_partition=64, quant_method=None, shard_indices=None)
    model.logits_processor = _Processor(org_vocab_size=draft, logits_as_input=False, head_dtype=None)
    model.config = SimpleNamespace(vocab_size=target_vocab, draft_vocab_size=draft)
    targets = torch.tensor(draft_rows_to_target)
    model.draft_id_to_target_id = targets - torch.arange(draft)

    def compute_logits(hidden_states):
        logits = model.logits_processor(model.lm_head, hidden_states)
        out = logits.new_full((logits.shape[0], target_vocab), float("-inf"))
        out[:, targets] = logits
        return out

    model.compute_logits = compute_logits
    return model


def _speculator(model, method="eagle3", quantization=None):
    return SimpleNamespace(model=model, max_num_reqs=SLOTS, idx_mapping=torch.full((SLOTS,), -1, dtype=torch.int64),
                           use_local_argmax_reduction=False,
                           speculative_config=SimpleNamespace(method=method, draft_lm_head_quantization=quantization))


def _runner(speculator):
    class Runner:  # V2's GPUModelRunner: what the hooks read of it
        pass

    runner = Runner()
    runner.speculator, runner.req_states = speculator, SimpleNamespace(req_id_to_index={})
    return runner


def _seat(runner, req_id, slot, prompt):
    from nanospec_fx.integrations.vllm import runner_v2

    runner.req_states.req_id_to_index[req_id] = slot
    new = SimpleNamespace(req_id=req_id, prefill_token_ids=prompt)
    runner_v2.after_add_requests(lambda *a, **k: None, runner, SimpleNamespace(scheduled_new_reqs=[new]))


def test_eagle3_draft_vocabulary_maps_fed_target_ids_to_draft_rows(monkeypatch):
    """EAGLE-3 on the V2 path: the head's rows are the draft vocabulary (32 rows) of a 100-token target. The fed
    ids are target ids; the active rows must be exactly the draft rows of those ids (the issue's probe: target ids
    whose draft rows are 3, 10, 26, 30), and a target id with no draft row (here 99, and 5) is skipped, never read
    as a row. The drafter's logits over the target vocabulary are finite exactly at the fed ids that have a row."""
    from nanospec_fx.integrations.vllm import runner_v2
    from nanospec_fx.integrations.vllm.config import ENV_HEAD, ENV_TOPK

    monkeypatch.setenv(ENV_HEAD, "compact")
    monkeypatch.setenv(ENV_TOPK, "1")
    draft_to_target = [2 * r + 1 for r in range(32)]  # odd target ids 1..63 have draft rows; even ids, 64.. none
    model = _eagle3(draft_to_target)
    speculator = _speculator(model)
    runner_v2.after_speculator_load(lambda *a, **k: None, speculator, object())
    head = model.lm_head
    assert isinstance(head, CompactLMHead) and head.vocabs.vocab_size == 100
    runner = _runner(speculator)
    fed = [draft_to_target[r] for r in (3, 10, 26, 30)] + [99, 4]  # 99 and 4: no draft row
    _seat(runner, "r", 2, fed)
    speculator.idx_mapping.copy_(torch.tensor([2, -1, -1, -1]))
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(3))
    rows = torch.isfinite(model.logits_processor(head, x[:1]))[0].nonzero().flatten().tolist()
    assert rows == [3, 10, 26, 30]
    logits = model.compute_logits(x)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [7, 21, 53, 61]
    dense = x[:1] @ model.lm_head.weight[[3, 10, 26, 30]].T
    torch.testing.assert_close(logits[0, [7, 21, 53, 61]], dense[0])
    assert torch.isneginf(logits[1]).all()  # the padded slot reads the empty row
    # the target's top-1 (target ids, beyond the draft vocabulary's 32) and a sampled token join by their rows
    target_logits = torch.full((1, 100), -5.0)
    target_logits[0, 63] = 1.0  # draft row 31
    runner_v2._HEADS.clear()
    runner_v2._head(runner)
    runner_v2.before_rejection_sample(lambda *a, **k: None, None, target_logits,
                                      SimpleNamespace(expanded_idx_mapping=torch.tensor([2])))
    runner_v2.before_postprocess_sampled(lambda *a, **k: None, runner, torch.tensor([2]), torch.tensor([[1, 80]]),
                                         torch.tensor([2]), torch.tensor([0]))
    rows = torch.isfinite(model.logits_processor(head, x[:1]))[0].nonzero().flatten().tolist()
    assert rows == [0, 3, 10, 26, 30, 31]  # 1 -> row 0, 63 -> row 31; 80 has no row
    runner_v2._HEADS.clear()


@pytest.mark.parametrize("quantization, method", [("fp8", "Fp8PtpcOnlineLinearMethod"),
                                                  ("nvfp4", "_LMHeadNvfp4Method"),
                                                  (None, "CompressedTensorsW8A8Fp8")])
def test_a_quantized_draft_head_keeps_the_full_head_with_its_quantization_named(monkeypatch, quantization, method):
    """vLLM's draft_lm_head_quantization (fp8, nvfp4) or a checkpoint's quantized head: the V2 hook and V1's
    check name the quantisation (not a dtype), and the drafter keeps vLLM's head object."""
    from nanospec_fx.integrations.vllm import runner_v2, v0_32
    from nanospec_fx.integrations.vllm.config import ENV_HEAD
    from nanospec_fx.diagnostics.warning import NanoSpecWarning

    monkeypatch.setenv(ENV_HEAD, "compact")
    model = _eagle3([2 * r + 1 for r in range(32)])
    model.lm_head.quant_method = type(method, (), {})()
    model.lm_head.weight = model.lm_head.weight.to(torch.float8_e4m3fn)
    source = model.lm_head
    named = (f"draft_lm_head_quantization={quantization!r} ({method}, weight float8_e4m3fn)" if quantization else
             f"the checkpoint's quantization ({method}, weight float8_e4m3fn)")
    with pytest.warns(NanoSpecWarning, match=r"Model Runner V2\): a quantized draft head, " + named.replace(
            "(", r"\(").replace(")", r"\)")):
        runner_v2.after_speculator_load(lambda *a, **k: None, _speculator(model, quantization=quantization), object())
    assert model.lm_head is source
    assert v0_32.quantization_of(source, SimpleNamespace(draft_lm_head_quantization=quantization)).startswith(
        f"a quantized draft head, {named}")


def test_every_remedy_answers_and_names_the_switch(monkeypatch):
    """The inactivity remedy never raises on any release (0.34 has no V1 runner module; here no vLLM at all), and
    on 0.33 it names NANOSPEC_VLLM_V2 and its fix: set with the V1 runner running, unset with Model Runner V2."""
    from nanospec_fx.integrations.vllm import ADAPTERS, adapter_module, runner_v2, v0_33
    from nanospec_fx.integrations.vllm.config import ENV_V2

    class CPUModelRunner:
        pass

    worker = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=SimpleNamespace(method="eagle")))
    for key in ADAPTERS:
        for v2 in ("", "1"):
            monkeypatch.setenv(ENV_V2, v2)
            said = adapter_module(key).remedy(worker, CPUModelRunner())
            assert isinstance(said, str) and "CPUModelRunner" in said
    monkeypatch.setenv(ENV_V2, "1")
    said = v0_33.remedy(worker, CPUModelRunner())
    assert "NANOSPEC_VLLM_V2=1 installed the Model Runner V2 hooks, but vLLM runs its V1 model runner" in said
    assert "Unset NANOSPEC_VLLM_V2 to use the V1 hooks" in said and "supported vLLM release" not in said
    monkeypatch.setattr(runner_v2, "v2_runner_class", lambda: CPUModelRunner)  # now the runner is V2's
    monkeypatch.setenv(ENV_V2, "")
    said = v0_33.remedy(worker, CPUModelRunner())
    assert "runs Model Runner V2 here (CPUModelRunner" in said and "Set NANOSPEC_VLLM_V2=1" in said
    from nanospec_fx.integrations.vllm import v0_34

    runner = CPUModelRunner()
    runner.speculator = SimpleNamespace(_nanospec_refused="x")
    assert "no NanoSpec head" in v0_34.remedy(worker, runner) and "V1" not in v0_34.remedy(worker, runner)


def test_the_v2_switch_is_said_where_it_is_ignored(monkeypatch):
    """NANOSPEC_VLLM_V2=1 on 0.32 (no V2 head there) is said, not silently ignored; on 0.34 (V2 only) a value that
    asks for V1 is said, and the 0.34 adapter never touches V1's runner switch."""
    from nanospec_fx.integrations.vllm import runner_v2, v0_32, v0_34
    from nanospec_fx.diagnostics.warning import NanoSpecWarning

    installed = []
    monkeypatch.setattr(v0_32, "install_v1", lambda remedy: installed.append(("v1", remedy)))
    monkeypatch.setattr(runner_v2, "install", lambda release, remedy, note=None: installed.append((release, remedy)))
    monkeypatch.setattr(v0_32, "choose_v1_runner", lambda: pytest.fail("0.34 has no V1 runner to choose"))
    monkeypatch.setenv("NANOSPEC_VLLM_V2", "1")
    with pytest.warns(NanoSpecWarning, match="NANOSPEC_VLLM_V2=1 is ignored on vLLM 0.32: .*V1 model runner's hooks"):
        v0_32.install()
    monkeypatch.setenv("NANOSPEC_VLLM_V2", "0")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    with pytest.warns(NanoSpecWarning, match="NANOSPEC_VLLM_V2=0 is ignored on vLLM 0.34: Model Runner V2 is its only"):
        v0_34.install()
    assert installed == [("v1", v0_32.remedy), ("0.34", v0_34.remedy)]
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ


def test_a_remedy_that_fails_is_said_not_raised(recwarn):
    from nanospec_fx.integrations.vllm.metrics import Activity

    def broken():
        raise ModuleNotFoundError("No module named 'vllm.v1.worker.gpu_model_runner'")

    activity = Activity()
    activity.step("CPUModelRunner", limit=1, remedy=broken)
    assert activity.status() == "inactive" and "could not work out the remedy here: ModuleNotFoundError" in \
        activity.reason


def test_each_adapter_lists_its_private_patches_in_its_contract():
    from nanospec_fx.integrations.vllm import ADAPTERS, adapter_module

    for key in ADAPTERS:
        adapter = adapter_module(key)
        assert adapter.PATCHED and set(adapter.PATCHED) <= set(adapter.CONTRACT), adapter.__name__
    v0_34 = adapter_module((0, 34))
    assert not any("gpu_model_runner.py" in s.path or "llm_base_proposer" in s.path for s in v0_34.CONTRACT)
