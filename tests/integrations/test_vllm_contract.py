"""Each vLLM adapter's CONTRACT against its release's source (by ``ast``: classes, method names and parameters,
attribute assignments; vLLM is never imported), and the checker itself on a small synthetic source.

The release sources: ``NANOSPEC_VLLM_SOURCES=DIR`` (``DIR/<version>/``, filled by
``python -m nanospec_fx.integrations.vllm.contract fetch DIR``; .ci/vllm_tests.sh does so; a missing release is then a
failure), else the installed vLLM when it is the adapter's release, else the test skips."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from nanospec_fx.integrations.vllm import ADAPTERS, adapter_module
from nanospec_fx.integrations.vllm.contract import Symbol, attributes, check, class_, installed_root, method, reader

SOURCE = '''
import dataclasses

class Runner(Base):
    step: int = 0

    def __init__(self, config):
        self.drafter = None
        self.batch: list = []

    def _sample(self, logits, metadata=None, *, extra=False):
        pass

    @property
    def req_ids(self):
        return []

def helper():
    pass

FLAG = "VLLM_SOME_SWITCH"
'''
CONTRACT = (
    method("runner.py", "Runner", "_sample", "logits", "metadata"),
    *attributes("runner.py", "Runner", "step", "drafter", "batch", "req_ids"),
    Symbol("runner.py", None, "helper", "function"),
    Symbol("runner.py", None, "VLLM_SOME_SWITCH", "env"),
    class_("runner.py", "Runner", "Base"),
)


def _check(text: str, contract=CONTRACT) -> list[str]:
    return check(contract, lambda path: text if path == "runner.py" else None)


def test_checker_accepts_the_source_it_describes():
    assert _check(SOURCE) == []


@pytest.mark.parametrize("edit, named", [
    (("def _sample(", "def _sample_tokens("), "method Runner._sample(self, logits, metadata, ...)"),
    (("self, logits, metadata=None", "self, logits, spec_metadata=None"), "parameters are (self, logits, spec_metadata"),
    (("self.drafter = None", "self._drafter = None"), "attribute Runner.drafter in runner.py: no such attribute"),
    (("    step: int = 0", "    steps: int = 0"), "attribute Runner.step in runner.py: no such attribute"),
    (("def req_ids(", "def request_ids("), "attribute Runner.req_ids in runner.py: no such attribute"),
    (("def helper(", "def helper2("), "function helper in runner.py: no such module-level function"),
    (('"VLLM_SOME_SWITCH"', '"VLLM_OTHER"'), "env VLLM_SOME_SWITCH in runner.py: not read by this release"),
    (("class Runner(", "class ModelRunner("), "method Runner._sample(self, logits, metadata, ...) in runner.py: no "
                                             "class Runner"),
    (("class Runner(Base)", "class Runner(Other)"), "class Runner(Base) in runner.py: bases are (Other)"),
])
def test_checker_names_each_changed_piece(edit, named):
    problems = _check(SOURCE.replace(*edit))
    assert any(named in p for p in problems), problems
    assert len(problems) == (6 if "class Runner(" == edit[0] else 1)  # a missing class fails each of its pieces


def test_checker_names_a_missing_file():
    assert _check(SOURCE, (Symbol("other.py", "Runner", "drafter"),)) == [
        "attribute Runner.drafter in other.py: the file is missing"]


def test_every_adapter_declares_its_release_and_contract():
    for key in ADAPTERS:
        adapter = adapter_module(key)
        assert tuple(int(x) for x in adapter.RELEASE.split(".")[:2]) == key
        assert adapter.CONTRACT and all(isinstance(s, Symbol) for s in adapter.CONTRACT)
        assert callable(adapter.install)


def _release_root(adapter) -> Path | None:
    sources = os.environ.get("NANOSPEC_VLLM_SOURCES")
    if sources and (Path(sources) / adapter.RELEASE).is_dir():
        return Path(sources) / adapter.RELEASE
    installed = installed_root(adapter)
    if installed is None and sources:
        pytest.fail(f"NANOSPEC_VLLM_SOURCES={sources} has no {adapter.RELEASE}/ (run "
                    "`python -m nanospec_fx.integrations.vllm.contract fetch DIR`)")
    return installed


@pytest.mark.parametrize("key", list(ADAPTERS), ids=lambda k: "vllm-%d.%d" % k)
def test_release_source_has_what_the_adapter_touches(key):
    adapter = adapter_module(key)
    root = _release_root(adapter)
    if root is None:
        pytest.skip(f"no source of vLLM {adapter.RELEASE} here (set NANOSPEC_VLLM_SOURCES, see the module docstring)")
    problems = check(adapter.CONTRACT, reader(root))
    assert not problems, f"vLLM {adapter.RELEASE} ({root}) lacks what {adapter.__name__} touches:\n" + "\n".join(
        problems)
