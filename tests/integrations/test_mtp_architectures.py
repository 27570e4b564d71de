"""speculative_pair(target, mtp=...) on every architecture whose MTP layers transformers' generate(use_mtp=True)
drives (tests/integrations/mtp_architectures.py says which, on the installed transformers), tied and untied heads:
the head the MTP layers' logits read is found from the model (the target's output embedding), the drafts are compact
and the output is plain greedy's. Depth 1 through each class's own checkpoint load (mtp=True); depths 2-3, which no
class's load pattern finds in transformers 5.25, as mtp=MtpModel(target, depth). And the errors a wrong route gets."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.generation.candidate_generator import MTPCandidateGenerator  # noqa: E402

import nanospec_fx  # noqa: E402
from nanospec_fx.vocab import reports as pass_reports  # noqa: E402
from nanospec_fx.vocab.state import registered_state  # noqa: E402
import mtp_architectures as arch  # noqa: E402 - beside this file
from test_mtp import check_greedy_drafts  # noqa: E402 - beside this file

V, CAPACITY = 96, 32

# (kind, tied head, depth, through the checkpoint): the 61/46-layer checkpoints of DeepSeek-V3 / GLM-4-MoE are slow;
# their untied depth-1 load is also test_mtp.py's
CASES = [
    ("ernie4_5_moe", True, 1, True), ("ernie4_5_moe", False, 1, True),
    ("mellum", True, 1, True), ("mellum", False, 1, True),
    pytest.param("deepseek_v3", True, 1, True, marks=pytest.mark.slow),
    pytest.param("glm4_moe", True, 1, True, marks=pytest.mark.slow),
    ("deepseek_v3", True, 2, False), ("deepseek_v3", False, 3, False),
    ("glm4_moe", True, 3, False), ("glm4_moe", False, 2, False),
]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kind, tied, depth, from_checkpoint", CASES)
def test_mtp_pair_finds_the_head_of_every_architecture(kind, tied, depth, from_checkpoint, tmp_path, one_thread,
                                                       monkeypatch):
    if from_checkpoint:
        path, written = arch.checkpoint(tmp_path / kind, kind, V, depth, tied)
        target = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        route = True
    else:
        target = arch.model(kind, V, depth, tied)
        route = arch.mtp_layers(target, depth)
    head = target.get_output_embeddings()
    assert (head.weight is target.get_input_embeddings().weight) == tied
    ids = torch.randint(1, V, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = target.generate(ids, max_new_tokens=8, do_sample=False)
    state = nanospec_fx.speculative_pair(target, mtp=route, capacity=CAPACITY, inductor=False)
    assert state is nanospec_fx.active_vocab(target)
    layers = target._nanospec_mtp
    if from_checkpoint:  # the layers transformers loads from the checkpoint are the ones written
        loaded = layers.state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in written.items())
    assert layers.shared_head is head and len(layers.layers) == depth

    checks, spy = check_greedy_drafts(state, V)
    monkeypatch.setattr(MTPCandidateGenerator, "get_candidates", spy)
    with torch.inference_mode():
        out = target.generate(ids, max_new_tokens=8, do_sample=False, use_mtp=True)
    assert torch.equal(out, plain)
    drafts = [d for c in checks for d in c.drafts]
    assert drafts, "the MTP layers drafted (greedy: the token-only call)"
    for got, want, logits in drafts:  # every MTP depth's draft: the argmax over the set, no logits handed out
        assert got.shape[1] == depth and torch.equal(got, want) and logits is None
    graphs = pass_reports.reports(state)
    assert graphs and all(r.consumers and not r.exits and not r.materialised for r in graphs), \
        "every MTP depth's head is read through a compact selection: no [V] row"
    assert "1 head(s) rewritten" in str(nanospec_fx.explain(target._nanospec_drafters["mtp"][3]))
    nanospec_fx.detach(target)


def test_mtp_true_on_a_model_built_in_memory_names_the_mtp_model_route():
    target = arch.model("ernie4_5_moe", V)
    with pytest.raises(ValueError, match=r"built in memory.*mtp=MtpModel\(target, 1\)"):
        nanospec_fx.speculative_pair(target, mtp=True)
    assert "_nanospec_drafters" not in vars(target)
    assert registered_state(target.get_output_embeddings().weight) is None, "nothing set up before the error"


def test_mtp_layers_deeper_than_the_config_are_named_as_such():
    target = arch.model("deepseek_v3", V, depth=1)
    with pytest.raises(ValueError, match=r"3 MTP layers but DeepseekV3ForCausalLM's config holds 1 "
                                         r"\(num_mtp_layers=1\)"):
        nanospec_fx.speculative_pair(target, mtp=arch.mtp_layers(target, 3))


def test_mtp_on_a_config_without_mtp_layers_says_so():
    target = arch.model("ernie4_5_moe", V, depth=1)
    target.config.num_mtp_layers = None
    with pytest.raises(ValueError, match=r"config holds no MTP layers"):
        nanospec_fx.speculative_pair(target, mtp=True)
