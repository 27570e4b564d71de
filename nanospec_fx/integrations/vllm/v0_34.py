"""The adapter for vLLM 0.34.x, where Model Runner V2 is the only runner.

0.34.0 removed Model Runner V1 (``vllm/v1/worker/gpu_model_runner.py``, ``gpu_input_batch.py`` and the V1
proposers are gone; ``VLLM_USE_V2_MODEL_RUNNER=0`` is a ``ValueError``), so this adapter installs the V2 hooks of
:mod:`~nanospec_fx.integrations.vllm.runner_v2` and nothing of V1: no V1 import, no runner switch.
``NANOSPEC_VLLM_V2`` has no meaning here (V2 is always on); a value that asks for anything else is said once.

What changed in 0.34's V2 and what the hooks rely on, pinned in ``CONTRACT``: EAGLE, MTP and draft-model
speculators derive from ``AutoRegressiveSpeculator`` (a ``DraftModelSpeculator``, whose ``load_model`` is wrapped);
the drafter's greedy tokens come from ``greedy_argmax`` over the head's logits (the compact head's ``-inf`` outside
a request's set never wins); ``RejectionSampler.__call__`` takes a ``DraftLogitsCache`` (the hook reads only
``logits`` and ``input_batch``); ``CPUModelRunner`` is a V2 ``GPUModelRunner`` (the hooks reach it);
``NewRequestData.prefill_token_ids`` is always set, resumed requests included (a resumed request is seeded with its
prompt and output). Class-tested against the real 0.34.0 classes on CPU (no 0.34 engine runs here: its wheel is a
CUDA build): tests/integrations/test_vllm_v2_classes.py.
"""
from __future__ import annotations

from nanospec_fx.integrations.vllm import config, runner_v2, v0_32, v0_33
from nanospec_fx.integrations.vllm.contract import Symbol, attributes, class_, method
from nanospec_fx.integrations.vllm.metrics import warn

RELEASE = "0.34.0"
WHEEL = "vllm"  # the CUDA build's wheel (~240 MB); the contract's .py files are read from it
#: no 0.34 CPU build exists: the fetch keeps the wheel's Python package, which tests import over a CPU torch
CLASS_TESTED_FROM_WHEEL = True
SUPPORTED_METHODS = runner_v2.SUPPORTED_METHODS
ENV_V2 = config.ENV_V2

V2 = v0_33.V2
SPEC = f"{V2}/spec_decode"
LOGITS, EMBED, MODELS = v0_32.LOGITS, v0_32.EMBED, v0_32.MODELS
#: the private methods the hooks wrap (each in CONTRACT with its parameters)
PATCHED: tuple[Symbol, ...] = v0_33.PATCHED[len(v0_32.PATCHED):] + (
    method(v0_32.WORKER, "Worker", "execute_model", "scheduler_output"),
)
CONTRACT: tuple[Symbol, ...] = (
    *v0_33.V2_CONTRACT,
    *PATCHED[-1:],
    # new in 0.34, or changed
    class_(f"{SPEC}/autoregressive/speculator.py", "AutoRegressiveSpeculator", "DraftModelSpeculator"),
    class_(f"{SPEC}/eagle/speculator.py", "EagleSpeculator", "TargetDependentARSpeculator"),
    class_(f"{SPEC}/target_dependent_ar/speculator.py", "TargetDependentARSpeculator", "AutoRegressiveSpeculator"),
    class_(f"{SPEC}/dflash/speculator.py", "DFlashSpeculator", "DraftModelSpeculator"),
    Symbol(f"{V2}/sample/greedy_argmax.py", None, "greedy_argmax", "function"),
    class_(f"{SPEC}/draft_logits.py", "DraftLogitsCache"),
    method(f"{SPEC}/rejection_sampler.py", "RejectionSampler", "__call__", "logits", "input_batch", "draft_logits"),
    class_("vllm/v1/worker/cpu/model_runner.py", "CPUModelRunner", "GPUModelRunner"),
    Symbol(f"{SPEC}/speculator_config.py", None, "register_speculative_method", "function"),
    # what the hooks and the remedy read besides
    *attributes(v0_32.WORKER, "Worker", "model_runner"),
    *attributes("vllm/v1/worker/worker_base.py", "WorkerBase", "vllm_config"),
    *attributes("vllm/config/vllm.py", "VllmConfig", "speculative_config"),
    *attributes("vllm/config/speculative.py", "SpeculativeConfig", "method", "draft_lm_head_quantization"),
    *attributes(v0_32.SCHED, "SchedulerOutput", "total_num_scheduled_tokens"),
    *attributes(LOGITS, "LogitsProcessor", "org_vocab_size", "logits_as_input"),
    *attributes(EMBED, "VocabParallelEmbedding", "tp_size", "quant_method"),
    *attributes(f"{MODELS}/llama_eagle3.py", "Eagle3LlamaForCausalLM", "lm_head", "logits_processor",
                "draft_id_to_target_id"),
)


def install() -> None:
    """The V2 hooks (the only runner of 0.34); never a V1 import or a runner switch."""
    value = config.v2_setting()
    if value is not None and not config.v2_requested():
        warn(f"{ENV_V2}={value} is ignored on vLLM 0.34: Model Runner V2 is its only model runner, and the plugin's "
             f"V2 head is always installed there. Unset {ENV_V2}, or unset NANOSPEC_VLLM to run without NanoSpec")
    runner_v2.install("0.34", remedy)


def remedy(worker, runner) -> str:
    """The inactivity remedy on 0.34: Model Runner V2 things only."""
    return runner_v2.remedy(worker, runner, "0.34") or (
        "The V2 speculator's steps never reached the NanoSpec head (another code path drafts in this vLLM); "
        "unset NANOSPEC_VLLM to run without NanoSpec")
