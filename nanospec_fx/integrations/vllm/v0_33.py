"""The adapter for vLLM 0.33.x.

Checked against the 0.33.0 source (the contract test): the V1 model runner's hooked methods, their parameters and
every attribute the 0.32 adapter reads are unchanged (0.33's new ``SchedulerOutput.skip_drafts`` is read only by
Model Runner V2), so this adapter reuses the 0.32 hooks and declares its own contract. Model Runner V2, which 0.33
picks by default where Triton is available, has no such hooks: by default the adapter asks for V1
(``choose_v1_runner``) and the step counter reports the plugin inactive where V2 runs anyway.

``NANOSPEC_VLLM_V2=1`` (experimental, **source-checked only: no V2 engine has run it**) keeps V2 and installs the V2
hooks instead: after ``DraftModelSpeculator.load_model`` the drafter's ``lm_head`` (and MTP layers'
``shared_head.head``, where vLLM puts its own quantized draft head) becomes a
:class:`~nanospec_fx.integrations.vllm.head.CompactLMHead` whose rows come from the speculator's slot buffer
(``idx_mapping``; DFlash: ``sample_idx_mapping``) on the device; request slots get and release rows at
``add_requests`` / ``_remove_request`` (host, between steps); the sampled tokens join the sets at
``postprocess_sampled`` and the target's top-k at ``RejectionSampler.__call__``, as device ops.
"""
from __future__ import annotations

import os
import weakref

from nanospec_fx.integrations.vllm import config, metrics, v0_32
from nanospec_fx.integrations.vllm.contract import Symbol, attributes, method
from nanospec_fx.integrations.vllm.head import CompactLMHead, SlotRows, build_vocabs
from nanospec_fx.integrations.vllm.metrics import warn

RELEASE = "0.33.0"
WHEEL = "vllm"  # the CUDA build's wheel (~340 MB); only the contract's .py files are read from it
SUPPORTED_METHODS = v0_32.SUPPORTED_METHODS
ENV_V2 = "NANOSPEC_VLLM_V2"

V2 = "vllm/v1/worker/gpu"
V2_SPECULATOR = f"{V2}/spec_decode/speculator.py"
V2_RUNNER = f"{V2}/model_runner.py"
LOGITS = v0_32.LOGITS
#: what the V2 hooks touch (model runner V2, its speculators, and what LogitsProcessor reads of a head)
V2_CONTRACT: tuple[Symbol, ...] = (
    method(V2_SPECULATOR, "DraftModelSpeculator", "load_model", "target_model"),
    method(V2_SPECULATOR, "DraftModelSpeculator", "compute_draft_logits", "hidden_states", "spec_step_idx"),
    method(V2_SPECULATOR, "DraftModelSpeculator", "sample_draft", "hidden_states", "sample_src_positions",
           "idx_mapping"),
    *attributes(V2_SPECULATOR, "DraftModelSpeculator", "model", "idx_mapping", "max_num_reqs", "speculative_config",
                "use_local_argmax_reduction"),
    *attributes(f"{V2}/spec_decode/dflash/speculator.py", "DFlashSpeculator", "sample_idx_mapping"),
    method(V2_RUNNER, "GPUModelRunner", "add_requests", "scheduler_output"),
    method(V2_RUNNER, "GPUModelRunner", "_remove_request", "req_id"),
    method(V2_RUNNER, "GPUModelRunner", "postprocess_sampled", "idx_mapping", "sampled_tokens", "num_sampled",
           "num_rejected"),
    *attributes(V2_RUNNER, "GPUModelRunner", "speculator", "req_states"),
    *attributes(f"{V2}/states.py", "RequestState", "req_id_to_index"),
    method(f"{V2}/spec_decode/rejection_sampler.py", "RejectionSampler", "__call__", "logits", "input_batch"),
    *attributes(f"{V2}/input_batch.py", "InputBatch", "expanded_idx_mapping"),
    *attributes("vllm/v1/core/sched/output.py", "SchedulerOutput", "scheduled_new_reqs"),
    *attributes("vllm/v1/core/sched/output.py", "NewRequestData", "req_id", "prefill_token_ids"),
    method(LOGITS, "LogitsProcessor", "_apply_head", "lm_head", "hidden_states", "embedding_bias"),
    method(LOGITS, "LogitsProcessor", "get_top_tokens", "lm_head", "hidden_states"),
    *attributes(LOGITS, "LogitsProcessor", "head_dtype"),
    *attributes(v0_32.EMBED, "VocabParallelEmbeddingShardIndices", "num_org_vocab_padding",
                "org_vocab_start_index"),
    Symbol("vllm/model_executor/layers/quantization/online/lm_head.py", None, "quantized_lm_head_copy", "function"),
)
CONTRACT = v0_32.CONTRACT + V2_CONTRACT

_HEADS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(runner) -> its V2 head (the sampler's)


def v2_requested() -> bool:
    return os.environ.get(ENV_V2, "").strip().lower() in ("1", "true", "yes", "on")


def install() -> None:
    """The V1 hooks (0.32's), or with ``NANOSPEC_VLLM_V2=1`` the V2 hooks (V2 kept: never run here)."""
    if not v2_requested():
        v0_32.install()
        return
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator
    from vllm.v1.worker.gpu_worker import Worker

    with v0_32._INSTALL_LOCK:
        if getattr(GPUModelRunner, "_nanospec_installed", False):
            return
        warn(f"{ENV_V2}=1: the Model Runner V2 head is experimental and was checked against vLLM 0.33.0's source "
             "only (no V2 engine has run it here)")
        v0_32.wrap(DraftModelSpeculator, "load_model", after_speculator_load)
        v0_32.wrap(GPUModelRunner, "add_requests", after_add_requests)
        v0_32.wrap(GPUModelRunner, "_remove_request", before_remove_request)
        v0_32.wrap(GPUModelRunner, "postprocess_sampled", before_postprocess_sampled)
        v0_32.wrap(RejectionSampler, "__call__", before_rejection_sample)
        v0_32.wrap(Worker, "execute_model", v0_32.count_step)  # never silently inactive, as on V1
        GPUModelRunner._nanospec_installed = True


def after_speculator_load(original, speculator, target_model, *args, **kwargs):
    result = original(speculator, target_model, *args, **kwargs)
    model = speculator.model
    method_name = speculator.speculative_config.method
    lm_head, processor, prepare = v0_32.head_parts(model)
    reason = None
    if method_name not in SUPPORTED_METHODS:
        reason = f"not supported (supported: {', '.join(SUPPORTED_METHODS)})"
    elif lm_head is None or processor is None or prepare is not None:
        reason = f"{type(model).__name__}'s head is not a plain lm_head + logits_processor"  # MTP shared_head: V1 only
    elif speculator.use_local_argmax_reduction or getattr(lm_head, "tp_size", 1) != 1:
        reason = "local argmax reduction and tensor-parallel heads are not supported by the V2 head"
    elif processor.logits_as_input or processor.head_dtype not in (None, lm_head.weight.dtype):
        reason = "a logits processor with logits_as_input or a head_dtype of its own is not supported"
    else:
        reason = v0_32.not_worth_it(model)
    if reason:
        warn(f"method {method_name!r} (Model Runner V2): {reason}; the drafter keeps vLLM's full head")
        return result
    slots = getattr(speculator, "sample_idx_mapping", None)  # DFlash: one slot per sampled row
    slots = speculator.idx_mapping if slots is None else slots
    settings = config.settings(int(model.config.vocab_size), speculator.max_num_reqs + 1)
    vocabs = build_vocabs(lm_head.weight, settings, processor.org_vocab_size)
    head = CompactLMHead(lm_head, vocabs, SlotRows(vocabs, speculator.max_num_reqs), slots)
    head.topk = settings.topk
    model.lm_head = head  # the target keeps its own head object: it verifies dense
    speculator._nanospec_head = head
    return result


def _head(runner, step: bool = False):
    """The runner's V2 head (None: none installed); ``step``: a decoding step reached it (the plugin is active)."""
    head = getattr(getattr(runner, "speculator", None), "_nanospec_head", None)
    if head is not None:
        _HEADS[id(runner)] = head
        if step:
            metrics.activity_of(runner).hooked()
    return head


def after_add_requests(original, runner, scheduler_output, *args, **kwargs):
    result = original(runner, scheduler_output, *args, **kwargs)
    head = _head(runner)
    if head is not None:
        for new in scheduler_output.scheduled_new_reqs:
            slot = runner.req_states.req_id_to_index.get(new.req_id)
            if slot is not None:
                head.slot_rows.add(slot, new.req_id, new.prefill_token_ids)
    return result


def before_remove_request(original, runner, req_id, *args, **kwargs):
    head = _head(runner)
    if head is not None:
        slot = runner.req_states.req_id_to_index.get(req_id)
        if slot is not None:
            head.slot_rows.remove(slot)
    return original(runner, req_id, *args, **kwargs)


def before_postprocess_sampled(original, runner, idx_mapping, sampled_tokens, num_sampled, num_rejected, *args,
                               **kwargs):
    head = _head(runner, step=True)
    if head is not None:  # device ops: the accepted tokens and the bonus token of each request
        import torch

        width = sampled_tokens.shape[-1] if sampled_tokens.dim() == 2 else 1
        valid = torch.arange(width, device=sampled_tokens.device)[None, :] < num_sampled.reshape(-1, 1)
        head.slot_rows.observe(idx_mapping, sampled_tokens.reshape(num_sampled.numel(), -1), valid)
    return original(runner, idx_mapping, sampled_tokens, num_sampled, num_rejected, *args, **kwargs)


def before_rejection_sample(original, sampler, logits, input_batch, *args, **kwargs):
    heads = list(_HEADS.values())
    if len(heads) == 1 and heads[0].topk > 0:  # one V2 drafter in this process: its requests are this batch's
        import torch

        head = heads[0]
        top = torch.topk(logits[:, : head.org_vocab_size], min(head.topk, logits.shape[-1]), dim=-1).indices
        head.slot_rows.observe(input_batch.expanded_idx_mapping[: logits.shape[0]], top)
    return original(sampler, logits, input_batch, *args, **kwargs)
