"""Runs vLLM (CPU build) with the NanoSpec plugin on tiny checkpoints and prints what the tests check, as JSON.

    python vllm_worker.py SCENARIO ROOT    # SCENARIO: methods | preemption | eagle_export | tensor_parallel; ROOT: a dir

A subprocess of tests/integrations/test_vllm.py: vLLM owns process-wide state (its plugins, torch's threads, a
process group), so each scenario gets a fresh interpreter. The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor): the plugin's heads are readable here.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import vllm_checkpoints  # noqa: E402

NUM_SPEC = 3
# Prompts with disjoint tokens, so a token fed only to one request is easy to name.
PROMPTS = [[5, 17, 300, 42, 99, 5, 17], [700, 3, 3, 800, 11], [512, 256, 128, 64, 1000, 901, 77, 78]]
# The static policy's list: the even ids from 1000 down (half the vocabulary; PROMPTS[1]'s 3 and 11 are not in it).
STATIC_LIST = list(range(1000, 0, -2))
TP_TOKENS = 16  # tokens per request under tensor parallelism


def run(dirs, spec, prompts, max_tokens, target="target", **engine):
    """Generate greedily; return outputs, the plugin heads' counters and released sets, and vLLM's counters."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from nanospec_fx.integrations.vllm.head import STATIC_ROW
    from nanospec_fx.integrations.vllm.metrics import heads as plugin_heads
    from nanospec_fx.integrations.vllm.metrics import status as plugin_status

    engine = {"max_model_len": 128, "max_num_seqs": 4, **engine}
    llm = LLM(model=str(dirs[target]), skip_tokenizer_init=True, speculative_config=spec, dtype="float32",
              enforce_eager=True, seed=0, distributed_executor_backend="uni", disable_log_stats=False, **engine)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        ids = [o.request_id for o in outs]
        # One more step: vLLM tells the runner which requests finished at the next schedule, where rows are released.
        llm.generate([TokensPrompt(prompt_token_ids=[1])], SamplingParams(temperature=0, max_tokens=1,
                                                                          detokenize=False))
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    status = plugin_status()[-1:]  # this engine's runner: the newest (earlier engines were collected)
    heads = [{"compact_calls": h.compact_calls, "dense_calls": h.dense_calls, "assigned": h.assigned,
              "checked": h.checked, "disabled": h.disabled, "parallel": h.parallel, "model": h.model_name,
              "prepared": h.prepare is not None,
              "static": h.vocabs.token_ids(STATIC_ROW).tolist() if h.static else None,
              "released": h.released, "holding": list(h.vocabs.request_ids),
              "sets": [_released_set(h, i) for i in ids]} for h in plugin_heads()]
    result = {"outputs": [list(o.outputs[0].token_ids) for o in outs], "heads": heads,
              "preemptions": metrics.get("vllm:num_preemptions"),
              "accepted": metrics.get("vllm:spec_decode_num_accepted_tokens"),
              "drafted": metrics.get("vllm:spec_decode_num_draft_tokens"), "status": status,
              "warnings": [str(w.message) for w in caught if "nanospec" in str(w.message)]}
    del llm
    gc.collect()
    return result


def _released_set(head, request_id: str):
    """The set of a request when it released its row (the engine core's id is the output's id plus a suffix)."""
    released = head["released_sets"] if isinstance(head, dict) else head.released_sets
    sets = [s for key, s in released.items() if key == request_id or key.startswith(f"{request_id}-")]
    return sets[-1] if sets else None


def run_tp(dirs, spec, prompts, max_tokens, record_dir: Path):
    """:func:`run` under vLLM tensor parallelism (2 CPU workers, ``mp`` executor, one core each): the plugin's heads
    live in the worker processes, which write their snapshots to ``record_dir`` (NANOSPEC_VLLM_RECORD_DIR)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    record_dir.mkdir(parents=True)
    os.environ["NANOSPEC_VLLM_RECORD_DIR"] = str(record_dir)  # the workers inherit it
    llm = LLM(model=str(dirs["target"]), skip_tokenizer_init=True, speculative_config=spec, dtype="float32",
              enforce_eager=True, seed=0, tensor_parallel_size=2, distributed_executor_backend="mp",
              disable_log_stats=False, max_model_len=128, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    ids = [o.request_id for o in outs]
    llm.generate([TokensPrompt(prompt_token_ids=[1])], SamplingParams(temperature=0, max_tokens=1, detokenize=False))
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    llm.llm_engine.engine_core.shutdown()  # stops the workers before the next engine binds the same cores
    del llm
    gc.collect()
    heads = sorted((json.loads(f.read_text()) for f in record_dir.glob("nanospec-head-*.json")),
                   key=lambda h: h["rank"])
    for head in heads:
        head["sets"] = [_released_set(head, i) for i in ids]
    del os.environ["NANOSPEC_VLLM_RECORD_DIR"]
    return {"outputs": [list(o.outputs[0].token_ids) for o in outs], "heads": heads,
            "drafted": metrics.get("vllm:spec_decode_num_draft_tokens")}


def tensor_parallel(dirs):
    """vLLM with tensor_parallel_size=2 on 2 CPU workers: the target alone, then draft_model with the plugin and
    sets of fed tokens only (NANOSPEC_VLLM_TOPK=0: what each request holds is known exactly), then eagle (the target's
    top-k observed too)."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one NUMA node here: bind one core per worker by hand
    root = dirs["target"].parent.parent
    out = {"target": run_tp(dirs, None, PROMPTS, TP_TOKENS + NUM_SPEC + 1, root / "record-target")}
    os.environ["NANOSPEC_VLLM_TOPK"] = "0"
    spec = {"method": "draft_model", "model": str(dirs["draft_model"]), "num_speculative_tokens": NUM_SPEC}
    out["draft_model_topk0"] = run_tp(dirs, spec, PROMPTS, TP_TOKENS, root / "record-draft_model")
    del os.environ["NANOSPEC_VLLM_TOPK"]
    spec = {"method": "eagle", "model": str(dirs["eagle"]), "num_speculative_tokens": NUM_SPEC}
    out["eagle"] = run_tp(dirs, spec, PROMPTS, TP_TOKENS, root / "record-eagle")
    return out


def _shifted_drafter(dirs) -> dict:
    """A draft model whose compute_logits adds a post-op of its own after vLLM's logits processor."""
    import json as _json
    import shutil

    import torch
    from vllm import ModelRegistry
    from vllm.model_executor.models.llama import LlamaForCausalLM

    class ShiftedLlamaForCausalLM(LlamaForCausalLM):
        def compute_logits(self, hidden_states):
            logits = super().compute_logits(hidden_states)
            return logits + 0.01 * torch.arange(logits.shape[-1], device=logits.device)

    ModelRegistry.register_model("ShiftedLlamaForCausalLM", ShiftedLlamaForCausalLM)
    shifted = dirs["draft_model"].parent / "shifted"
    shutil.copytree(dirs["draft_model"], shifted, dirs_exist_ok=True)
    config = _json.loads((shifted / "config.json").read_text()) | {"architectures": ["ShiftedLlamaForCausalLM"]}
    (shifted / "config.json").write_text(_json.dumps(config))
    return {"method": "draft_model", "model": str(shifted), "num_speculative_tokens": NUM_SPEC}


def _bypassed(dirs) -> dict:
    """A runner whose drafter hook is never reached (as on a runner the plugin does not hook): the plugin's patched
    propose_draft_token_ids is put back to vLLM's own for one eagle run."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patched = GPUModelRunner.propose_draft_token_ids
    GPUModelRunner.propose_draft_token_ids = patched.__wrapped__
    try:
        spec = {"method": "eagle", "model": str(dirs["eagle"]), "num_speculative_tokens": NUM_SPEC}
        return run(dirs, spec, PROMPTS, 16)
    finally:
        GPUModelRunner.propose_draft_token_ids = patched


def methods(dirs):
    out = {"target": run(dirs, None, PROMPTS, 24)}
    for method in ("draft_model", "eagle", "eagle3", "dflash"):
        spec = {"method": method, "model": str(dirs[method]), "num_speculative_tokens": NUM_SPEC}
        out[method] = run(dirs, spec, PROMPTS, 24)
    # MTP: the MiMo target's own MTP layer (vLLM's `mtp` method reads it from the target's checkpoint)
    out["mimo_target"] = run(dirs, None, PROMPTS, 24, target="mimo")
    out["mtp"] = run(dirs, {"method": "mtp", "num_speculative_tokens": NUM_SPEC}, PROMPTS, 24, target="mimo")
    # vLLM's asynchronous scheduling (sampled tokens reach the runner one step late on the host side)
    spec = {"method": "eagle", "model": str(dirs["eagle"]), "num_speculative_tokens": NUM_SPEC}
    out["eagle_async"] = run(dirs, spec, PROMPTS, 24, async_scheduling=True)
    out["shifted"] = run(dirs, _shifted_drafter(dirs), PROMPTS, 8)
    os.environ["NANOSPEC_VLLM_TOPK"] = "0"  # sets of fed tokens only: what each request holds is known exactly
    spec = {"method": "draft_model", "model": str(dirs["draft_model"]), "num_speculative_tokens": NUM_SPEC}
    out["draft_model_topk0"] = run(dirs, spec, PROMPTS, 24)
    del os.environ["NANOSPEC_VLLM_TOPK"]
    out["bypassed"] = _bypassed(dirs)
    # last: ngram imports numba (llvmlite), and vLLM 0.32's CPU worker then fails to start another engine in this
    # process (its Triton-override scan calls vars() on llvmlite's _lib_fn_wrapper)
    out["ngram"] = run(dirs, {"method": "ngram", "num_speculative_tokens": NUM_SPEC, "prompt_lookup_max": 2},
                       PROMPTS, 8)
    import vllm

    import nanospec_fx.integrations.vllm as plugin

    vllm.__version__ = "0.31.0"  # what register() does on a vLLM it was not tested with
    try:
        plugin.register()
        out["old_version_error"] = None
    except RuntimeError as e:
        out["old_version_error"] = str(e)
    return out


def deepseek_mtp(dirs):
    """vLLM's `mtp` method on a DeepSeek-V3 target (MLA, the MTP layer's shared_head: norm then the target's head):
    the target alone, the MTP drafter without the plugin (vLLM's own output: the oracle), then with it."""
    dirs = dirs | {"deepseek": vllm_checkpoints.build_deepseek_mtp(dirs["target"].parent)}
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    out = {"target": run(dirs, None, PROMPTS, 16, target="deepseek")}
    os.environ["NANOSPEC_VLLM"] = "0"  # register() ran at start: take the hooks back out for the plugin-less run
    out["no_plugin"] = _without_plugin(lambda: run(dirs, spec, PROMPTS, 16, target="deepseek"))
    os.environ["NANOSPEC_VLLM"] = "1"
    out["plugin"] = run(dirs, spec, PROMPTS, 16, target="deepseek")
    return out


def _without_plugin(call):
    """Run ``call`` with vLLM's own proposer load_model (the plugin's hook put back to the original)."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    patched = SpecDecodeBaseProposer.load_model
    SpecDecodeBaseProposer.load_model = patched.__wrapped__
    try:
        return call()
    finally:
        SpecDecodeBaseProposer.load_model = patched


def preemption(dirs):
    """Four requests in a KV cache of three 32-token blocks: vLLM preempts (and later resumes) requests."""
    prompts = [[5 + i, 17, 300 + i, 42, 99, 7 + i] for i in range(4)]
    engine = {"max_model_len": 64, "block_size": 32, "num_gpu_blocks_override": 3}
    spec = {"method": "draft_model", "model": str(dirs["draft_model"]), "num_speculative_tokens": NUM_SPEC}
    out = {"target": run(dirs, None, prompts, 40, **engine), "draft_model": run(dirs, spec, prompts, 40, **engine)}
    os.environ["NANOSPEC_VLLM_MAX_REQUESTS"] = "2"  # fewer request rows than requests in the batch
    out["two_rows"] = run(dirs, spec, prompts, 16)
    del os.environ["NANOSPEC_VLLM_MAX_REQUESTS"]
    return out


def _capture_drafter_calls(calls: list) -> None:
    """Record the drafter model's forward inputs and its compute_logits in- and outputs while ``calls[0]`` is True
    (vLLM's warm-up runs are left out)."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    load_model = SpecDecodeBaseProposer.load_model

    def capturing_load_model(self, *args, **kwargs):
        result = load_model(self, *args, **kwargs)
        model = self.model.unwrap() if hasattr(self.model, "unwrap") else self.model

        def on_forward(module, args, kwargs):
            if calls[0]:
                calls.append(("forward", {k: kwargs[k].detach().clone() for k in
                                          ("input_ids", "positions", "hidden_states")}))

        model.register_forward_pre_hook(on_forward, with_kwargs=True)
        compute_logits = model.compute_logits

        def recorded_compute_logits(hidden_states):
            logits = compute_logits(hidden_states)
            if calls[0]:
                calls.append(("logits", {"hidden_states": hidden_states.detach().clone(), "logits": logits.clone()}))
            return logits

        model.compute_logits = recorded_compute_logits
        return result

    SpecDecodeBaseProposer.load_model = capturing_load_model


def eagle_export(dirs):
    """A drafter of ours in vLLM's layout (nanospec_fx.eval.vllm_eagle) run by vLLM's `eagle` method: without the
    plugin (its first draft step's inputs and logits are saved for the test's oracle), then with it."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from nanospec_fx.eval import train_eagle as T
    from nanospec_fx.eval.vllm_eagle import export_vllm_eagle

    target = LlamaForCausalLM.from_pretrained(dirs["target"], dtype=torch.float32).eval()
    drafter = T.new_drafter(target, seed=1, layout="vllm")
    with torch.no_grad():  # not the copy-the-feature start: every weight matters in the comparison
        for p in [*drafter.layer.parameters(), drafter.fc.weight]:
            p.add_(0.05 * torch.randn_like(p))
    root = dirs["target"].parent
    T.save_drafter(drafter, root / "ours", {})
    export = export_vllm_eagle(drafter, root / "eagle_export", max_position_embeddings=512)
    spec = {"method": "eagle", "model": str(export), "num_speculative_tokens": NUM_SPEC}

    out = {"target": run(dirs, None, PROMPTS, 24)}
    calls = [False]
    _capture_drafter_calls(calls)
    calls[0] = True
    out["no_plugin"] = run(dirs, spec, PROMPTS[:1], 24)
    calls[0] = False
    forward = next(c for kind, c in calls[1:] if kind == "forward")
    logits = next(c for kind, c in calls[1:] if kind == "logits")
    tensors = {**forward, **{f"compute_logits.{k}": v for k, v in logits.items()}}
    save_file(tensors, str(root / "first_step.safetensors"))

    import nanospec_fx.integrations.vllm as plugin

    os.environ["NANOSPEC_VLLM"] = "1"  # vLLM ran its plugins already in this process: install by hand
    plugin.register()
    out["plugin"] = run(dirs, spec, PROMPTS, 24)
    # FR-Spec's static head: every request's set is this list (most frequent first), nothing observed
    static = root / "static.txt"
    static.write_text("\n".join(str(t) for t in STATIC_LIST + [3, 4]))  # NANOSPEC_VLLM_STATIC_SIZE cuts the tail
    os.environ.update(NANOSPEC_VLLM_POLICY="static", NANOSPEC_VLLM_STATIC=str(static),
                      NANOSPEC_VLLM_STATIC_SIZE=str(len(STATIC_LIST)))
    out["static"] = run(dirs, spec, PROMPTS, 24)
    return out


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    scenario, root = sys.argv[1], Path(sys.argv[2])
    if scenario != "eagle_export":  # it starts without the plugin
        os.environ["NANOSPEC_VLLM"] = "1"
    os.environ["NANOSPEC_VLLM_RECORD"] = "1"
    os.environ["NANOSPEC_VLLM_HEAD"] = "compact"  # these heads are tiny: the cost model would keep them dense
    checkpoints = vllm_checkpoints.build(root / "checkpoints") | vllm_checkpoints.build_mtp(root / "checkpoints")
    scenarios = {"methods": methods, "preemption": preemption, "eagle_export": eagle_export,
                 "tensor_parallel": tensor_parallel, "deepseek_mtp": deepseek_mtp}
    result = scenarios[scenario](checkpoints)
    (root / f"{scenario}.json").write_text(json.dumps(result))
