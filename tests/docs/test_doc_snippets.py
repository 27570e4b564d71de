"""The Python blocks of README.md, docs/testing.md and docs/reference.md run as written.

Each ```python block there is preceded by ``<!-- snippet: NAME -->``: NAME is the setup below that defines
the names the block uses (a tiny target and drafter, ids...). A block without a marker fails this test,
so a new snippet is either tested or says in its marker why it is not (``<!-- snippet: not run: why -->``).
Inductor is switched off (the rewritten graph runs eagerly): these tests are about the API as documented.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import nanospec_fx
import nanospec_fx.compiler.lowering
from helpers import tiny_llama

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/testing.md", "docs/reference.md")
BLOCK = re.compile(r"(?:<!-- snippet: (?P<name>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)
V = 300


def snippets():
    for doc in DOCS:
        for i, m in enumerate(BLOCK.finditer((ROOT / doc).read_text())):
            # a tiny target + drafter pair generating text: seconds each
            slow = [pytest.mark.slow] if m["name"] == "tiny-pair" else []
            yield pytest.param(m["name"], m["code"], id=f"{doc}#{i}", marks=slow)


class PickingDrafter(nn.Module):
    """A drafter that runs log-softmax + top-k itself (docs/testing.md's 'Drafters that pick tokens')."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, 16)
        self.lm_head = nn.Linear(16, V, bias=False)

    def head_logits(self, ids):
        return self.lm_head(torch.tanh(self.embed(ids))) / 0.7

    def forward(self, ids):
        return torch.log_softmax(self.head_logits(ids), -1).topk(4)


def setup(name: str) -> dict:
    ns = {"torch": torch, "nanospec_fx": nanospec_fx}
    ids = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(0))
    if name == "tiny-pair":
        ns.update(target=tiny_llama(V, 2, 0), drafter=tiny_llama(V, 1, 1), input_ids=ids, token_ids=ids[0, :3])
        ns["target"].generation_config.max_new_tokens = 6  # a few assisted rounds are enough here
    elif name == "testing-hypothesis":
        torch.manual_seed(0)
        from drafters import TinyDrafter

        ns["MY_DRAFTER"] = TinyDrafter(32000, 8).eval()
    elif name == "testing-reference":
        torch.manual_seed(0)
        ns.update(drafter=PickingDrafter().eval(), ids=ids, my_head_logits=lambda d, x: d.head_logits(x))
        from nanospec_fx.testing import assert_equivalent

        ns["assert_equivalent"] = assert_equivalent
    else:
        raise AssertionError(f"unknown snippet setup {name!r}")
    return ns


@pytest.mark.parametrize("name,code", list(snippets()))
def test_doc_snippet_runs(name, code, monkeypatch):
    assert name is not None, "a ```python block without a <!-- snippet: NAME --> marker"
    if name.startswith("not run:"):
        pytest.skip(name)
    monkeypatch.setattr(nanospec_fx.compiler.lowering, "compile_graph", lambda gm, example_inputs, inductor, patches: gm.forward)
    ns = setup(name)
    exec(compile(code, name, "exec"), ns)
    for fn in [v for k, v in ns.items() if k.startswith("test_") and callable(v)]:
        fn()  # a test the snippet defines (hypothesis runs its examples)
    if "out" in ns and "target" in ns and "do_sample=True" in code:  # sampled: the prompt, then new tokens
        prompt = ns["input_ids"]
        assert torch.equal(ns["out"][:, : prompt.shape[1]], prompt) and ns["out"].shape[1] > prompt.shape[1]
    elif "out" in ns and "target" in ns:  # assisted generation: exactly the target's greedy output
        with torch.inference_mode():
            expected = ns["target"].generate(ns["input_ids"], do_sample=False)
        assert torch.equal(ns["out"], expected)
    if "drafter" in ns and name == "tiny-pair" and "request()" not in code:  # a request resets the set when it ends
        state = nanospec_fx.active_vocab(ns["drafter"])
        assert state.contains(ns["input_ids"]).all() or "token_ids" in code
