"""The adapter for vLLM 0.33.x.

Checked against the 0.33.0 source (the contract test): the V1 model runner's hooked methods, their parameters and
every attribute the 0.32 adapter reads are unchanged (0.33's new ``SchedulerOutput.skip_drafts`` is read only by
Model Runner V2), so this adapter reuses the 0.32 hooks and declares its own contract. Model Runner V2, which 0.33
picks by default where Triton is available, has no such hooks: by default the adapter asks for V1
(``choose_v1_runner``) and the step counter reports the plugin inactive where V2 runs anyway.

``NANOSPEC_VLLM_V2=1`` (experimental: no V2 engine has run it) keeps V2 and installs the Model Runner V2 hooks of
:mod:`~nanospec_fx.integrations.vllm.runner_v2` instead (the same hooks the 0.34 adapter installs, class-tested
against vLLM 0.34.0's real classes). The inactivity warning's remedy names the switch and the runner that ran.
"""
from __future__ import annotations

from nanospec_fx.integrations.vllm import config, runner_v2, v0_32
from nanospec_fx.integrations.vllm.contract import Symbol, attributes, method

RELEASE = "0.33.0"
WHEEL = "vllm"  # the CUDA build's wheel (~340 MB); the contract's .py files are read from it
#: no 0.33 CPU build exists: the fetch keeps the wheel's Python package, whose V2 classes tests import over a CPU torch
CLASS_TESTED_FROM_WHEEL = True
SUPPORTED_METHODS = v0_32.SUPPORTED_METHODS
ENV_V2 = config.ENV_V2

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

#: the private methods the hooks wrap: V1's (default) or, with NANOSPEC_VLLM_V2=1, V2's
PATCHED: tuple[Symbol, ...] = v0_32.PATCHED + (
    method(V2_SPECULATOR, "DraftModelSpeculator", "load_model", "target_model"),
    method(V2_RUNNER, "GPUModelRunner", "add_requests", "scheduler_output"),
    method(V2_RUNNER, "GPUModelRunner", "_remove_request", "req_id"),
    method(V2_RUNNER, "GPUModelRunner", "postprocess_sampled", "idx_mapping", "sampled_tokens", "num_sampled",
           "num_rejected"),
    method(f"{V2}/spec_decode/rejection_sampler.py", "RejectionSampler", "__call__", "logits", "input_batch"),
)
# the V2 hooks' names, where earlier releases of the plugin had them
after_speculator_load = runner_v2.after_speculator_load
after_add_requests = runner_v2.after_add_requests
before_remove_request = runner_v2.before_remove_request
before_postprocess_sampled = runner_v2.before_postprocess_sampled
before_rejection_sample = runner_v2.before_rejection_sample


def install() -> None:
    """The V1 hooks (0.32's, with V1 asked for), or with ``NANOSPEC_VLLM_V2=1`` the V2 hooks (V2 kept)."""
    if not config.v2_requested():
        v0_32.install_v1(remedy)
        return
    runner_v2.install("0.33", remedy, note=(
        f"{ENV_V2}=1: the Model Runner V2 head is experimental on vLLM 0.33 (its hooks are checked against 0.33.0's "
        "source; the same hooks are class-tested against vLLM 0.34.0's classes, docs/vllm.md)"))


def remedy(worker, runner) -> str:
    """The inactivity remedy on 0.33, naming the switch that chose the hooks and the runner that ran instead."""
    V2Runner = runner_v2.v2_runner_class()
    on_v2 = V2Runner is not None and isinstance(runner, V2Runner)
    name = type(runner).__name__
    if config.v2_requested() and not on_v2:
        return (f"{ENV_V2}=1 installed the Model Runner V2 hooks, but vLLM runs its V1 model runner here ({name}: "
                f"the CPU build, or {v0_32.ENV_RUNNER}=0). Unset {ENV_V2} to use the V1 hooks, or run Model Runner V2 "
                f"(a GPU build with Triton, {v0_32.ENV_RUNNER} unset)")
    if on_v2 and not config.v2_requested():
        return (f"vLLM runs Model Runner V2 here ({name}; a feature that requires it, or {v0_32.ENV_RUNNER}=1), but "
                f"the plugin installed the V1 hooks ({ENV_V2} unset). Set {ENV_V2}=1 for the experimental V2 head, or "
                f"{v0_32.ENV_RUNNER}=0 for the V1 runner")
    if on_v2:
        return runner_v2.remedy(worker, runner, "0.33") or (
            f"{ENV_V2}=1: the V2 speculator's steps never reached the NanoSpec head; unset {ENV_V2} to use the V1 "
            "hooks, or NANOSPEC_VLLM to run without NanoSpec")
    return v0_32.remedy(worker, runner)
