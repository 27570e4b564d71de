"""One diagnosis behind every "not rewritten" message: heads nanospec never sees, frames Dynamo skips, dense
fallbacks, bypassed wrappers (nanospec_fx.diagnostics.diagnosis; explain, active_vocab, assert_equivalent and the warnings).

Each drafter below states in its code why its head is or is not seen; the tests check that every message names
that cause, that the warnings come once per model, and that legitimate prefill and hidden-state drafters are
never warned about.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import nanospec_fx
from nanospec_fx.diagnostics.diagnosis import HEADLESS_CALLS
from nanospec_fx.testing import assert_equivalent
from helpers import compile_nanospec
from loop_drafter import H, V, DraftLoop, Engine  # beside this file

class DisabledHead(Engine):
    """The head in a @torch.compiler.disable helper: Dynamo never hands it to nanospec."""

    def forward(self, ids):
        return self._head(torch.tanh(self.body(self.embed(ids))))

    @torch.compiler.disable
    def _head(self, h):
        return self.lm_head(h)


class Prefill(Engine):
    """A legitimate prefill: a prefill call returns hidden states, a decode call the head's logits."""

    def forward(self, ids, prefill: bool = False):
        h = torch.tanh(self.body(self.embed(ids)))
        return h if prefill else self.lm_head(h[:, -1])


class HiddenHead(Engine):
    """Prefill embeds ids; the head graph reads hidden states only (fed by a target observer or observe())."""

    def forward(self, ids=None, hidden=None):
        if ids is not None:
            return torch.tanh(self.body(self.embed(ids)))
        return self.lm_head(hidden)


class Broken(Engine):
    """A graph break between the embedding and the head: the head runs dense (one warning)."""

    def forward(self, ids):
        h = torch.tanh(self.body(self.embed(ids)))
        torch._dynamo.graph_break()
        return self.lm_head(h)


def _calls(model, n: int, **kwargs) -> list[str]:
    """Call ``model`` n times; the NanoSpecWarnings given."""
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(n):
            out = model(torch.tensor([[1, 2, 4 + i]]), **kwargs)
            module = getattr(model, "_orig_mod", model)
            if type(module) is Engine:
                module.compute_logits(out)  # the engine's head, outside the compiled call
    return [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]


@pytest.mark.parametrize("cls", [Engine, DisabledHead])
def test_a_head_the_backend_never_sees_is_said_once_with_the_remedy(cls):
    model = cls().eval()
    compiled = compile_nanospec(model)
    assert _calls(compiled, HEADLESS_CALLS - 1) == []  # a few head-less calls may be prefills
    said = _calls(compiled, 3 * HEADLESS_CALLS)
    assert len(said) == 1, said  # once per model
    assert f"{cls.__name__}'s head is not rewritten" in said[0]
    for remedy in ("compute_logits(h)", "@torch.compiler.disable", "compile the function that computes the logits",
                   "RequestVocabs"):
        assert remedy in said[0]
    with pytest.raises(LookupError, match="looked up token ids and scored no head") as error:
        nanospec_fx.active_vocab(compiled)
    assert "compute_logits(h)" in str(error.value)
    report = str(nanospec_fx.explain(compiled, quiet=True))
    assert "scored no head" in report and "compile the function that computes the logits" in report
    assert "call the module once" not in report and "bypasses" not in report


def test_prefill_calls_followed_by_decode_calls_are_not_warned_about():
    torch.manual_seed(0)
    model = Prefill().eval()
    compiled = compile_nanospec(model, capacity=64)
    # conftest turns a NanoSpecWarning into an error: none may come
    _calls(compiled, HEADLESS_CALLS - 1, prefill=True)
    _calls(compiled, 2)
    _calls(compiled, 3 * HEADLESS_CALLS, prefill=True)
    assert nanospec_fx.explain(compiled, quiet=True).heads[0].rewritten


def test_a_head_graph_that_reads_hidden_states_only_is_not_warned_about():
    """The model's head is rewritten (in a graph that looks up no ids): its head-less prefill calls are fine."""
    model = HiddenHead().eval()
    compiled = compile_nanospec(model, capacity=32)
    with torch.no_grad():
        compiled(hidden=torch.randn(1, 2, H))
        for i in range(3 * HEADLESS_CALLS):
            compiled(ids=torch.tensor([[1, 2, i]]))
    assert nanospec_fx.explain(compiled, quiet=True).heads[0].rewritten


def test_a_drafter_fed_hidden_states_with_a_target_observer_is_not_warned_about():
    class Target(Engine):
        def forward(self, ids):
            return self.lm_head(torch.tanh(self.body(self.embed(ids))))

    class Drafter(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(H, H)
            self.lm_head = nn.Linear(H, V, bias=False)

        def forward(self, hidden):
            return self.lm_head(torch.tanh(self.body(hidden)))

    drafter, target = Drafter().eval(), Target().eval()
    compiled = compile_nanospec(drafter, capacity=32)
    state = nanospec_fx.attach(drafter, head="lm_head", capacity=32)
    target.compile(backend="nanospec", options={"observe_topk": 2, "vocab": state, "inductor": False})
    with torch.no_grad():
        for i in range(2 * HEADLESS_CALLS):
            target(torch.tensor([[1, 2, i]]))
            compiled(torch.randn(1, 1, H))
    assert len(state) > 0
    report = nanospec_fx.explain(drafter, quiet=True)
    assert report.heads[0].rewritten and report.heads[0].target_observers == [2]
    assert "fed by 1 target observer graph(s) (observe_topk=2)" in str(report)
    # the target's own report says what it is and what it feeds, not that its head was not rewritten
    text = str(nanospec_fx.explain(target, quiet=True))
    assert text.startswith("nanospec: Target is a target observer (its own head stays dense, by design)")
    assert f"its top-2 into an active vocabulary of V={V} ({len(state)} / 32 active" in text
    assert "not compiled" not in text and "NOT REWRITTEN" not in text


@pytest.mark.parametrize("in_place", [False, True])
def test_a_frame_dynamo_skips_is_named_by_every_message(in_place):
    model = DraftLoop().eval()
    if in_place:
        model.compile(backend="nanospec", options={"inductor": False})
        compiled = model
    else:
        compiled = torch.compile(model, backend="nanospec", options={"inductor": False})
    with torch.no_grad():
        compiled(torch.tensor([[1, 2]]))
    with pytest.raises(LookupError, match="compiled no graph of it") as error:
        nanospec_fx.active_vocab(compiled)
    text = str(error.value)
    assert "graph break inside a for/while loop" in text and "move the break out of the loop" in text
    report = str(nanospec_fx.explain(compiled, quiet=True))
    assert "compiled no graph of it" in report and "call the module once" not in report
    with pytest.raises(AssertionError, match="move the break out of the loop") as failed:
        assert_equivalent(model, (torch.tensor([[1, 2]]),))
    assert "reset_dynamo" not in str(failed.value), "the known cause alone, no second, unrelated remedy"


def test_a_frame_dynamo_skips_is_warned_about_once_in_a_fresh_process(tmp_path):
    """The user's flow: import, torch.compile(..., backend="nanospec"), call. A warning names the skip."""
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(f"""
        import sys, warnings
        sys.path[:0] = [{str(Path(__file__).parent)!r}]
        import torch
        import nanospec_fx
        from loop_drafter import DraftLoop  # in a process Dynamo was never reset in

        compiled = torch.compile(DraftLoop().eval(), backend="nanospec", options={{"inductor": False}})
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            for _ in range(3):
                compiled(torch.tensor([[1, 2]]))
        said = [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]
        print(len(said))
        print(said[0] if said else "")
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    count, message = run.stdout.split("\n", 1)
    assert count == "1", run.stdout
    assert "Dynamo skipped 'forward'" in message and "graph break in a for/while loop" in message
    assert "move the break out of the loop" in message


@pytest.mark.parametrize("in_place", [False, True])
def test_a_frame_dynamo_skips_is_warned_about_at_the_first_call_after_every_reset(in_place):
    """``torch._dynamo.reset()`` drops Dynamo's compile callbacks, and a model whose forward breaks in a loop hands
    nanospec no graph that would install them again: each model of the class, compiled after a reset, is still said to
    run eager at its first call (issue 40: the second one ran dense with no warning), and the reset forgets the skip
    of the model before it (explain no longer names it)."""
    before = None
    for _ in range(2):
        torch._dynamo.reset()  # the subject: a user's reset before each model (the first is the fixture's too)
        if before is not None:
            assert "(graph break in a for/while loop" not in str(nanospec_fx.explain(before, quiet=True))
        model = DraftLoop().eval()
        if in_place:
            model.compile(backend="nanospec", options={"inductor": False})
            compiled = model
        else:
            compiled = torch.compile(model, backend="nanospec", options={"inductor": False})
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            compiled(torch.tensor([[1, 2]]))
        said = [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]
        assert len(said) == 1 and "Dynamo skipped 'forward'" in said[0], said
        assert "graph break in a for/while loop" in said[0]
        assert "(graph break in a for/while loop" in str(nanospec_fx.explain(compiled, quiet=True))
        before = compiled


def test_after_a_graph_break_every_message_gives_the_warning_s_diagnosis():
    model = Broken().eval()
    compiled = compile_nanospec(model)
    with pytest.warns(nanospec_fx.NanoSpecWarning, match="one piece of a call split by graph breaks") as caught, \
            torch.no_grad():
        compiled(torch.tensor([[1, 2]]))
    warning = next(str(w.message) for w in caught if "one piece" in str(w.message))
    report = str(nanospec_fx.explain(compiled, quiet=True))
    assert warning in report and "call the module once" not in report
    with pytest.raises(LookupError) as error:
        nanospec_fx.active_vocab(compiled)
    assert warning in str(error.value)
    with pytest.warns(nanospec_fx.NanoSpecWarning, match="one piece"), \
            pytest.raises(AssertionError, match="one piece of a call split by graph breaks"):
        assert_equivalent(model, (torch.tensor([[1, 2]]),))


def test_a_bypassed_wrapper_fed_by_a_target_observer_is_warned_about_once():
    """transformers' generate(assistant_model=wrapper) runs the original drafter: the target observer says so."""

    class Target(Engine):
        def forward(self, ids):
            return self.lm_head(torch.tanh(self.body(self.embed(ids))))

    drafter, target = Engine().eval(), Target().eval()
    wrapper = torch.compile(drafter, backend="nanospec", options={"inductor": False})
    nanospec_fx.attach(drafter, head="lm_head")
    observer = torch.compile(target, backend="nanospec", options={"observe_topk": 2, "vocab": wrapper,
                                                                    "inductor": False})
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(2 * HEADLESS_CALLS):
            observer(torch.tensor([[1, 2, i]]))
            drafter.compute_logits(drafter(torch.tensor([[i]])))  # what wrapper.generate() runs
    said = [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]
    assert len(said) == 1, said
    assert "target observer fed Engine's active vocabulary" in said[0]
    assert "drafter.compile(backend='nanospec')" in said[0] and "bypasses the wrapper" in said[0]
    report = str(nanospec_fx.explain(wrapper, quiet=True))
    assert "fed by 1 target observer graph(s) (observe_topk=2)" in report and "bypasses the wrapper" in report


def test_explain_prints_its_report_and_returns_it(capsys):
    model = Prefill().eval()
    compiled = compile_nanospec(model, capacity=16)
    with torch.no_grad():
        compiled(torch.tensor([[1, 2]]))
    report = nanospec_fx.explain(compiled)
    printed = capsys.readouterr().out
    assert printed == str(report) + "\n" and "1 head(s) rewritten" in printed
    assert repr(report) == "<nanospec Explanation of Prefill: 1 of 1 head(s) rewritten>"
    assert str(nanospec_fx.explain(compiled, quiet=True)) == str(report)
    assert capsys.readouterr().out == ""


def test_active_vocab_lists_the_candidate_heads_of_a_name_it_does_not_know():
    model = Prefill()
    with pytest.raises(KeyError, match="nope") as error:
        nanospec_fx.active_vocab(model, head="nope")
    assert "body.weight" in str(error.value) and "lm_head.weight" in str(error.value)
    assert "embed.weight" in str(error.value)


def test_active_vocab_lists_stacked_head_weights_among_the_candidates():
    """A 3-D weight is K heads stacked in one tensor, so a name that matches nothing lists it; a 4-D one is no head."""
    model = torch.nn.Module()
    model.heads = torch.nn.Parameter(torch.randn(2, 16, 8))
    model.conv = torch.nn.Parameter(torch.randn(1, 2, 3, 4))
    with pytest.raises(KeyError, match="nope") as error:
        nanospec_fx.active_vocab(model, head="nope")
    assert "'heads'" in str(error.value) and "conv" not in str(error.value)


def test_a_failed_compile_is_no_diagnosis_of_another_instance():
    """A bad option raises to its caller: it is not said later as another never-compiled instance's cause."""
    failed, other = Prefill().eval(), Prefill().eval()
    with pytest.raises(nanospec_fx.OptionError), torch.no_grad():
        torch.compile(failed, backend="nanospec", options={"capacty": 8})(torch.tensor([[1, 2]]))
    for model in (failed, other):
        assert "capacty" not in str(nanospec_fx.explain(model))
    assert "not compiled with backend='nanospec'" in str(nanospec_fx.explain(other))


def test_a_skipped_frame_is_its_instances():
    """A frame Dynamo skipped is that instance's, not its class's (a reset forgetting it: the test of a skip after
    every reset)."""
    nanospec_fx.explain(Prefill().eval(), quiet=True)  # installs the skip watcher before any backend call
    looping, sibling = DraftLoop().eval(), DraftLoop().eval()
    said = "(graph break in a for/while loop"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        looping = torch.compile(looping, backend="nanospec", options={"inductor": False})
        looping(torch.tensor([[1, 2]]))
    assert said in str(nanospec_fx.explain(looping))
    assert said not in str(nanospec_fx.explain(torch.compile(sibling, backend="nanospec")))


class NoHead(nn.Module):
    """Token embedding and a body, no LM head anywhere: its hidden states are all it computes."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.body = nn.Linear(H, H)

    def forward(self, ids):
        return torch.tanh(self.body(self.embed(ids)))


def test_a_model_without_any_head_is_said_naming_the_missing_head():
    """A plain module with no head: said by name at the threshold (its table could be a tied head of another call);
    a transformers base model says it has no head (get_output_embeddings() is None): said at its first call."""
    compiled = compile_nanospec(NoHead().eval())
    assert _calls(compiled, HEADLESS_CALLS - 1) == []
    said = _calls(compiled, 2 * HEADLESS_CALLS)
    assert len(said) == 1 and "it has no LM head" in said[0] and f"vocabulary's {V} rows" in said[0], said
    assert "it has no LM head" in str(nanospec_fx.explain(compiled, quiet=True))

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    base = compile_nanospec(transformers.LlamaModel(config).eval())
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        base(input_ids=torch.tensor([[1, 2, 3]]))
    said = [str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)]
    assert len(said) == 1 and "LlamaModel has no LM head" in said[0] and "prefill" not in said[0], said


def test_which_models_have_no_head():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    from nanospec_fx.diagnostics.diagnosis import no_head

    assert no_head(transformers.LlamaModel(config)) is not None
    assert no_head(transformers.LlamaForCausalLM(config)) is None  # tied: the embedding is its head
    assert no_head(Engine()) is None and no_head(Prefill()) is None
    assert no_head(NoHead()) is not None and no_head(NoHead(), (torch.randn(V, H),)) is None  # a head_weight argument


class CentroidHead(nn.Module):
    """An in-house centroid head (Gemma-4's kind): the top clusters' tokens (an int64 ordering table), those rows of the
    tied table scored, every other token at a floor read with ``.item()``."""

    V, C, K = 64, 8, 2

    def __init__(self):
        super().__init__()
        self.embed, self.body = nn.Embedding(self.V, 16), nn.Linear(16, 16)
        self.centroids = nn.Linear(16, self.C, bias=False)
        self.register_buffer("ordering", torch.randperm(self.V, generator=torch.Generator().manual_seed(0)))

    def forward(self, ids):
        h = torch.tanh(self.body(self.embed(ids)))
        top = self.centroids(h).topk(self.K, -1).indices
        rows = self.ordering.view(self.C, self.V // self.C)[top].flatten(-2)
        z = (h.unsqueeze(-2) @ self.embed.weight[rows].transpose(-1, -2)).squeeze(-2)
        out = torch.full((*ids.shape, self.V), z.min().item() - 1.0)
        return out.scatter(-1, rows, z)


@pytest.mark.parametrize("capture_scalars", [False, True], ids=["item-breaks-the-graph", "item-captured"])
def test_a_centroid_head_is_warned_at_the_first_call_naming_its_graph_break(capture_scalars):
    """With Dynamo's default capture_scalar_outputs=False the ``.item()`` splits the call: the piece that chooses the
    rows says so at the first call, naming the break (issue 40: said only at the 8th call, by the head-less count)."""
    torch.manual_seed(0)
    model = CentroidHead().eval()
    with torch._dynamo.config.patch(capture_scalar_outputs=capture_scalars):
        compiled = torch.compile(model, backend="nanospec", options={"capacity": 8, "inductor": False})
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            ids = torch.tensor([[3, 9, 27, 40]])
            out = compiled(ids)
    said = {str(w.message) for w in caught if issubclass(w.category, nanospec_fx.NanoSpecWarning)}
    assert len(said) == 1, said
    (message,) = said
    assert "no LM head found" in message and "rows are chosen in the graph" in message and "embed.weight" in message
    if not capture_scalars:
        assert "graph break" in message and ".item()" in message
    with torch.no_grad():
        assert torch.equal(out, model(ids)), "left unchanged and exact"
