"""The Model Runner V2 hooks, shared by the adapters of the releases that have that runner (``v0_33`` behind
``NANOSPEC_VLLM_V2=1``, ``v0_34`` always: 0.34 removed V1).

V2 runs the draft loop in a captured CUDA graph and calls no V1 proposer method. The hooks:

* ``DraftModelSpeculator.load_model`` (every V2 drafter's load, ``AutoRegressiveSpeculator`` and DFlash included):
  the drafter's ``lm_head`` becomes a :class:`~nanospec_fx.integrations.vllm.head.CompactLMHead` whose rows come
  from the speculator's slot buffer (``idx_mapping``; DFlash: ``sample_idx_mapping``) on the device. EAGLE-3's draft
  vocabulary: the state maps target ids to draft rows (``draft_id_to_target_id``, as the V1 head does), so the
  fed target ids land on their draft rows and an id with no draft row is skipped;
* ``GPUModelRunner.add_requests`` / ``_remove_request``: a request slot gets (seeded with the prompt) and releases
  its row, on the host between steps;
* ``GPUModelRunner.postprocess_sampled`` and ``RejectionSampler.__call__``: the accepted and bonus tokens, and the
  target's top-k, join the sets as device ops;
* ``Worker.execute_model``: counts steps ("never silently inactive"), with the adapter's remedy.

Each adapter lists these in its ``PATCHED`` (a subset of its ``CONTRACT``). vLLM 0.34's
``register_speculative_method`` was weighed as a supported seam and not taken: it registers a *new* method name
whose speculator the runner builds, so the built-in ``eagle``/``eagle3``/``mtp``/``draft_model``/``dflash`` a user
configures would not go through it, and its speculator interface (``add_request(req_index)``,
``on_requests_finished``) carries neither a request's prompt nor its sampled tokens (docs/vllm.md).
"""
from __future__ import annotations

import weakref

from nanospec_fx.integrations.vllm import config, metrics, v0_32
from nanospec_fx.integrations.vllm.head import CompactLMHead, SlotRows, build_vocabs
from nanospec_fx.integrations.vllm.metrics import warn

SUPPORTED_METHODS = v0_32.SUPPORTED_METHODS
_HEADS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id(runner) -> its V2 head (the sampler's)


def install(release: str, remedy_of, note: str | None = None) -> None:
    """Wrap V2's speculator, runner, rejection sampler and worker (once per process). ``release``: the vLLM release
    named in messages; ``remedy_of(worker, runner)``: the inactivity warning's remedy; ``note``: said once at
    install (0.33: the V2 head is experimental there)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator
    from vllm.v1.worker.gpu_worker import Worker

    with v0_32._INSTALL_LOCK:
        if getattr(GPUModelRunner, "_nanospec_installed", False):
            return
        if note:
            warn(note)
        v0_32.wrap(DraftModelSpeculator, "load_model", after_speculator_load)
        v0_32.wrap(GPUModelRunner, "add_requests", after_add_requests)
        v0_32.wrap(GPUModelRunner, "_remove_request", before_remove_request)
        v0_32.wrap(GPUModelRunner, "postprocess_sampled", before_postprocess_sampled)
        v0_32.wrap(RejectionSampler, "__call__", before_rejection_sample)
        v0_32.wrap(Worker, "execute_model", v0_32.step_counter(remedy_of))  # never silently inactive
        GPUModelRunner._nanospec_installed = True
        GPUModelRunner._nanospec_release = release


def unsupported(speculator, model, lm_head, processor, prepare) -> str | None:
    """Why this V2 drafter keeps vLLM's full head (None: the compact head can serve it)."""
    method_name = speculator.speculative_config.method
    if method_name not in SUPPORTED_METHODS:
        return f"not supported (supported: {', '.join(SUPPORTED_METHODS)})"
    if lm_head is None or processor is None or prepare is not None or not hasattr(lm_head, "weight"):
        return f"{type(model).__name__}'s head is not a plain lm_head + logits_processor"  # MTP shared_head: V1 only
    quantization = v0_32.quantization_of(lm_head, speculator.speculative_config)
    if quantization:  # before the dtype check: a quantized weight's dtype is not the head's
        return quantization
    if speculator.use_local_argmax_reduction or getattr(lm_head, "tp_size", 1) != 1:
        return "local argmax reduction and tensor-parallel heads are not supported by the V2 head"
    if processor.logits_as_input or getattr(processor, "head_dtype", None) not in (None, lm_head.weight.dtype):
        return "a logits processor with logits_as_input or a head_dtype of its own is not supported"
    return v0_32.not_worth_it(model)


def draft_to_target(model):
    """EAGLE-3's head row -> target id map (row ``r`` scores target token ``r + d2t[r]``), on the host; None for a
    head over the target vocabulary."""
    d2t = getattr(model, "draft_id_to_target_id", None)
    if d2t is None:
        return None
    import torch

    return (torch.arange(d2t.numel(), device=d2t.device) + d2t.detach()).cpu()


def after_speculator_load(original, speculator, target_model, *args, **kwargs):
    result = original(speculator, target_model, *args, **kwargs)
    model = speculator.model
    lm_head, processor, prepare = v0_32.head_parts(model)
    reason = unsupported(speculator, model, lm_head, processor, prepare)
    if reason:
        warn(f"method {speculator.speculative_config.method!r} (Model Runner V2): {reason}; the drafter keeps "
             "vLLM's full head (output unchanged)")
        speculator._nanospec_refused = reason
        return result
    slots = getattr(speculator, "sample_idx_mapping", None)  # DFlash: one slot per sampled row
    slots = speculator.idx_mapping if slots is None else slots
    # EAGLE-3: model.config.vocab_size is the target's; the head's rows are the draft vocabulary's
    settings = config.settings(int(model.config.vocab_size), speculator.max_num_reqs + 1, draft_to_target(model))
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
    """Seat each new request (0.34: also a resumed one, whose ``prefill_token_ids`` hold its prompt and output)."""
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
    if head is None:
        _explain_no_head(runner)
    else:  # device ops: the accepted tokens and the bonus token of each request
        import torch

        width = sampled_tokens.shape[-1] if sampled_tokens.dim() == 2 else 1
        valid = torch.arange(width, device=sampled_tokens.device)[None, :] < num_sampled.reshape(-1, 1)
        head.slot_rows.observe(idx_mapping, sampled_tokens.reshape(num_sampled.numel(), -1), valid)
    return original(runner, idx_mapping, sampled_tokens, num_sampled, num_rejected, *args, **kwargs)


def _explain_no_head(runner) -> None:
    """A V2 step with a speculator but no NanoSpec head: the plugin is inactive for a reason said once (at load for
    a supported method it could not serve, here for a method it has no head for), never warned again as inactive."""
    speculator = getattr(runner, "speculator", None)
    activity = metrics.activity_of(runner)
    if speculator is None or activity.reason is not None:
        return
    refused = getattr(speculator, "_nanospec_refused", None)
    if refused is None:
        spec = getattr(speculator, "speculative_config", None) or getattr(
            getattr(runner, "vllm_config", None), "speculative_config", None)
        method_name = getattr(spec, "method", None)
        refused = f"speculative method {method_name!r} ({type(speculator).__name__}) has no drafter LM head to compact"
        warn(f"{refused} (supported: {', '.join(SUPPORTED_METHODS)}); vLLM runs it unchanged")
    activity.explained(f"the drafter has no NanoSpec head: {refused} (warned above)")


def before_rejection_sample(original, sampler, logits, input_batch, *args, **kwargs):
    heads = list(_HEADS.values())
    if len(heads) == 1 and heads[0].topk > 0:  # one V2 drafter in this process: its requests are this batch's
        import torch

        head = heads[0]
        # the target's logits are over target ids (EAGLE-3: more than the head's draft rows)
        vocab = min(head.vocabs.vocab_size, logits.shape[-1])
        top = torch.topk(logits[:, :vocab], min(head.topk, vocab), dim=-1).indices
        head.slot_rows.observe(input_batch.expanded_idx_mapping[: logits.shape[0]], top)
    return original(sampler, logits, input_batch, *args, **kwargs)


def v2_runner_class():
    """Model Runner V2's ``GPUModelRunner`` (None where the release has none)."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    except ImportError:
        return None
    return GPUModelRunner


def remedy(worker, runner, release: str) -> str | None:
    """What a user whose V2 hooks are not reached can do (None: the runner is V2 with a drafter, and the reason is
    not known here)."""
    V2Runner = v2_runner_class()
    if V2Runner is None or not isinstance(runner, V2Runner):
        return (f"The plugin's hooks on vLLM {release} are on Model Runner V2 (vllm.v1.worker.gpu.model_runner."
                f"GPUModelRunner and its CPU subclass CPUModelRunner); this is {type(runner).__module__}."
                f"{type(runner).__name__}, which the plugin does not hook. Unset NANOSPEC_VLLM to run it without "
                "NanoSpec")
    missing = v0_32.no_speculative_config(worker)
    if missing:
        return missing
    if getattr(runner, "speculator", None) is not None and getattr(runner.speculator, "_nanospec_head", None) is None:
        return ("The drafter's speculator has no NanoSpec head (load_model kept vLLM's full head: a warning at load "
                "says why, or this speculator's load was never reached); drafting runs unchanged")
    return None
