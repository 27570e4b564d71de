"""What runs at every call of a compiled graph, apart from the compile that made it.

A graph whose heads all run dense is a :class:`DenseCall` (its warnings said again for every other model that runs
it); a rewritten graph is a :class:`StatefulCall`, which appends the tensors of its bindings - one
:class:`DrafterBinding` per rewritten head, or the :class:`TargetBinding` of a target observer - to every call,
after the host checks that keep them current (no device sync). :class:`TargetObserverCall` follows the drafter's
state to a new dtype or device.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from nanospec_fx.diagnostics import diagnosis

from nanospec_fx.vocab import reports as pass_reports
from nanospec_fx.vocab import prefill as prefill_ids
from nanospec_fx.compiler.head_kind import DenseHeadKind, kind_of_state
from nanospec_fx.passes import patterns
from nanospec_fx.vocab.state import ActiveVocab, state_for
from nanospec_fx.vocab.config import StateConfig
from nanospec_fx.diagnostics.warning import warn_once


class DenseCall:
    """A graph that runs a head dense, shared by several instances of one class (Dynamo compiles it once):
    each instance that runs it is told so once. An instance is told apart by its parameters and buffers, all of
    them: two drafters may share some (one ``nn.Embedding``), so a call with any tensor not seen before is another
    model's."""

    def __init__(self, compiled: Callable, said: list[str], positions: list[int], example_inputs: list):
        self.compiled, self.said, self.positions = compiled, said, positions
        # by identity: tensors compare by value
        self.seen = WeakIdKeyDictionary({example_inputs[i]: True for i in positions})

    def __call__(self, *args: Any) -> Any:
        held = [args[i] for i in self.positions]
        if any(t not in self.seen for t in held):
            for t in held:
                self.seen[t] = True
            diagnosis.record_dense(held, self.said)
            for message in self.said:
                warn_once(f"{message} (another model runs this compiled graph: the same holds for it)", stacklevel=2)
        return self.compiled(*args)


def weight_positions(gm: fx.GraphModule, example_inputs: list) -> list[int]:
    """Inputs that are tensors the model holds: parameters, buffers and plain tensor attributes (a head
    ``F.linear(h, self.W)`` after a graph break receives no parameter at all): what tells one instance's call
    from another's."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, (n, v) in enumerate(zip(placeholders, example_inputs)) if isinstance(v, torch.Tensor)
            and patterns.is_weight_like(n, v)]



def held_tensors(gm: fx.GraphModule, example_inputs: list) -> list[torch.Tensor]:
    """The parameters and buffers a graph receives (what ties it to the model that runs it)."""
    return [example_inputs[i] for i in weight_positions(gm, example_inputs)]




class Binding:
    """What every call checks on the host before it runs the compiled graph (no device sync):

    * the head weight or bias was written in place since its rows were cached (``load_state_dict``,
      an optimizer step, ``w.mul_()``: their version counters moved) -> re-copy the active rows;
    * the state was rebuilt in place by a compile with other options (``state_for``) -> use its new
      tensors if they have the layout this graph was compiled for, else a clear error.
    The state records the binding (weakly): while it lives, another compile may not change the
    state's options, so no wrapper is ever left on a state that ``observe()`` no longer reaches.
    """

    state: ActiveVocab
    kind: DenseHeadKind  # what a call passes and checks for the head's kind (compiler/head_kind.py)

    layout: list | None = None  # of the state tensors this graph was compiled for
    config: StateConfig | None = None  # and the vocabulary options it was compiled with

    def track(self, state: ActiveVocab) -> None:
        """Read ``state`` from now on (another instance's head: the compiled graph is shared)."""
        if self.layout is None:
            self.layout, self.config = state.layout(), state.config()
        elif state.layout() != self.layout:
            raise RuntimeError(
                f"nanospec: this compiled graph was made for an active vocabulary of another capacity or layout than "
                f"{state!r}; compile every instance of this head with the same vocabulary options"
            )
        self.state, self.generation = state, state.generation
        state.bind(self)

    def sync(self) -> bool:
        """Returns whether the state's tensors changed (the call's extra inputs must be rebuilt)."""
        changed = self.generation != self.state.generation
        if changed:
            if (self.state.layout() != self.layout and self.config is not None
                    and not self.state.fits(self.state.weight)):
                # The weight changed dtype/device back to this graph's (Dynamo guards chose it): rebuild for it.
                state_for(self.state.weight, self.state.bias, self.config)
            if self.state.layout() != self.layout:
                raise RuntimeError(
                    f"nanospec: the active vocabulary this compiled graph reads was rebuilt with another capacity, "
                    f"dtype or layout ({self.state!r}); give every compile of this head the same vocabulary options "
                    "(or use nanospec_fx.speculative_pair), or call torch._dynamo.reset() and compile again"
                )
            self.generation = self.state.generation
        self.state.refresh_if_stale()
        return changed


class DrafterBinding(Binding):
    """Extra inputs for one rewritten head: its ActiveVocab's tensors.

    If the head weight was replaced by another tensor since compiling (Dynamo does not guard on
    parameter identity, e.g. a second instance of the same class), the new weight's state is used.
    """

    def __init__(self, state: ActiveVocab, weight_pos: int | None, bias_pos: int | None,
                 ids_node: fx.Node | None = None, table_positions: list[int] = (), weight_positions: list[int] = (),
                 kind: DenseHeadKind | None = None):
        self.weight_pos, self.bias_pos = weight_pos, bias_pos
        self.kind = kind or kind_of_state(state)
        self.ids_node = ids_node  # the graph input of the slot table (which outputs are this head's logits)
        self.table_positions = table_positions  # inputs that are token tables this graph observes lookups into
        self.weight_positions = weight_positions  # inputs that are the model's parameters and buffers
        self.track(state)

    def observe_prefill(self, args: tuple) -> None:
        """Ids a head-less call of this model embedded in its tables since (:mod:`nanospec_fx.vocab.prefill`): a
        prefill call whose parameters and buffers all reach this call too (the same model, not another that
        shares the table)."""
        for position in self.table_positions:
            ids = prefill_ids.claim(args[position], self.state, lambda: [args[p] for p in self.weight_positions])
            if ids is not None:
                self.state.observe(ids, validate=False)

    def tensors(self) -> list[torch.Tensor]:
        return state_inputs(self.state) + self.kind.graph_inputs(self.state)

    def update(self, args: tuple) -> bool:
        bias = args[self.bias_pos] if self.bias_pos is not None else self.state.bias
        if self.weight_pos is None or self.state.is_weight(args[self.weight_pos]):
            self.state.set_bias(bias)  # a replaced bias (same shape) is followed; another shape raises clearly
            changed = self.sync()
        else:
            old = self.state
            self.track(state_for(args[self.weight_pos], bias, old.config(), factory=old._fresh_factory(),
                                 transposed=old.transposed, stacked=getattr(old, "stacked", ())))
            pass_reports.carry(old, self.state)
            self.sync()
            changed = True
        return changed


# ----------------------------------------------------------------------------- target role

class TargetObserverCall:
    """A target observer that follows its drafter's state to a new dtype or device.

    The observer copies the drafter's head rows into the drafter's ActiveVocab, so its graph is made for the
    state's dtype; ``drafter.to(dtype)`` changes the weight (Dynamo recompiles the drafter, not the target).
    Before each call: a weight that no longer fits the state rebuilds it in place (same object, tokens kept,
    as the drafter's own recompile would), and a state whose layout changed rebuilds this graph for it.
    """

    def __init__(self, compiled: "StatefulCall", build: Callable[[], Callable], vocab: Any = None):
        self.compiled, self.build = compiled, build
        self.binding = compiled.bindings[0]
        self.state = self.binding.state
        # What options['vocab'] was, held weakly: a torch.compile wrapper transformers may bypass (diagnosis)
        self.vocab = weakref.ref(vocab) if isinstance(vocab, nn.Module) else None
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        state = self.state
        self.calls += 1
        vocab = self.vocab() if self.vocab is not None else None
        if vocab is not None:
            diagnosis.note_target_call(state, vocab, self.calls)
        if not state.fits(state.weight):
            state_for(state.weight, state.bias, state.config())
        if state.layout() != self.binding.layout:
            self.compiled = self.build()
            self.binding = self.compiled.bindings[0]
        return self.compiled(*args)


class TargetBinding(Binding):
    """Extra inputs of a target observer: the drafter's head weight and bias (a vocabulary-parallel drafter's: its
    shard), its ActiveVocab tensors, then what its kind's observers read (``compiler/head_kind.py``)."""

    def __init__(self, state: ActiveVocab):
        self.kind = kind_of_state(state)
        self.track(state)
        # The state holds its weight weakly; this graph reads it, so it keeps it alive while it can run.
        self.weight = state.weight

    def tensors(self) -> list[torch.Tensor]:
        s = self.state
        return self.kind.head_inputs(s)[1] + state_inputs(s) + self.kind.graph_inputs(s)

    def update(self, args: tuple) -> bool:
        return self.sync()


def state_inputs(state: ActiveVocab) -> list[torch.Tensor]:
    """The state's tensors a graph reads, in its placeholders' order."""
    return state.tensors() + ([state.token_to_row] if state.token_to_row is not None else [])



class StatefulCall:
    """Calls the compiled graph with the bindings' tensors appended to the user's inputs."""

    def __init__(self, compiled: Callable, bindings: list):
        self.compiled, self.bindings = compiled, bindings
        self.extra = [t for b in bindings for t in b.tensors()]

    def __call__(self, *args: Any) -> Any:
        try:  # a vocabulary-parallel head: its collectives' failures and its fetches' checks are the group's
            if any([b.update(args) for b in self.bindings]):
                self.extra = [t for b in self.bindings for t in b.tensors()]
            self.observe_prefill(args)
            out = self.compiled(*args, *self.extra)
        except Exception as error:
            for b in self.bindings:
                b.kind.explain_failure(b.state, error)  # another rank's nanospec error, if any
            raise
        for b in self.bindings:
            b.kind.after_call(b.state)
        return out

    def observe_prefill(self, args: tuple) -> None:
        """Prefill ids of this model, into every head's set that reads them (each head reads a prefill's log once,
        whatever the order the heads run in: :mod:`nanospec_fx.vocab.prefill`)."""
        for b in self.bindings:
            if hasattr(b, "observe_prefill"):
                b.observe_prefill(args)


