"""``nanospec_fx.explain(module)``: what the pass did to a drafter and what it should gain."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import TextIO

import torch
import torch.nn as nn

from nanospec_fx.vocab import reports as pass_reports
from nanospec_fx.diagnostics.calibration import CalibrationError, MachineConstants
from nanospec_fx.diagnostics.calibration import calibrate as measure_constants
from nanospec_fx.diagnostics.diagnosis import Diagnosis, argument_heads, diagnose, target_observers
from nanospec_fx.diagnostics.cost_model import ALPHA, GPU_HBM, NVLINK4, CollectiveCost, HeadCost, tp
from nanospec_fx.kernels.dispatch import path_for
from nanospec_fx.vocab.module_heads import state_names, unwrap
from nanospec_fx.vocab.state import ActiveVocab
from nanospec_fx.diagnostics.warning import warn_once


@dataclass
class HeadExplanation:
    name: str
    module_path: str | None
    vocab_size: int
    hidden_size: int
    state: ActiveVocab
    graphs: int
    post_ops: list[str] = field(default_factory=list)
    consumers: list[str] = field(default_factory=list)
    exits: list[str] = field(default_factory=list)
    observers: int = 0
    cost: HeadCost | None = None
    names: list[str] = field(default_factory=list)  # every name active_vocab(m, head=...) accepts
    path: str = "reference"  # the kernels that run its ops (kernels.dispatch.path_for)
    constants: str = ""  # where the cost model's constants come from (calibration.MachineConstants.describe)
    world_size: int = 1  # a vocabulary-parallel head: the ranks its rows are split over
    collective: CollectiveCost | None = None  # and the alpha-beta model of its draft step
    target_observers: list[int] = field(default_factory=list)  # observe_topk of each target observer feeding it

    def collective_lines(self, n_rows: int = 10) -> list[str]:
        """The alpha-beta model of a vocabulary-parallel head's draft step, at this head's tp."""
        c, t = self.collective, self.world_size
        lines = [f"    tensor parallel: tp={t}, {self.vocab_size // t} rows per rank; draft step, alpha-beta model "
                 f"(not a measurement; alpha={ALPHA * 1e6:.0f} us per ring step assumed, link={NVLINK4 / 1e9:.0f} "
                 "GB/s per direction, NVLink 4):",
                 f"      dense TP (shard read + all-gather of [rows, V]): {c.dense.subs(tp, t)}",
                 f"      nanospec (cache read + all-reduce of the fed ids' rows [fed, H]): {c.nanospec.subs(tp, t)}"]
        for gpu, bandwidth in GPU_HBM.items():
            v = dict(tp=t, rows=n_rows, fed=n_rows, alpha=ALPHA, link=NVLINK4, hbm=bandwidth)
            lines.append(f"      {gpu}, rows=fed={n_rows}: dense {c.at(c.dense, **v) * 1e6:.1f} us, nanospec "
                         f"{c.at(c.nanospec, **v) * 1e6:.1f} us ({c.at(c.nanospec_outside, **v) * 1e6:.1f} us "
                         "with the ids observed outside the step)")
        return lines

    @property
    def rewritten(self) -> bool:
        """A graph compiled with the nanospec backend runs this head (else it has only a state)."""
        return self.graphs > 0

    def predictions(self, rows=(1, 10)) -> dict[int, float]:
        active = max(len(self.state), 1)
        return {r: self.cost.predict(r, active) for r in rows}


_PATHS = {
    "host": "CPU host path: computes the active rows only, bucket(active) of them (the active count rounded up "
            "to one of 4 sizes per power of two, at least 16, at most the capacity: fewer recompiled shapes)",
    "triton": "Triton kernels: skip the tiles past the active count",
    "reference": "torch reference: computes all capacity rows whatever the active count",
}


@dataclass
class Explanation:
    """The report of :func:`explain`: ``str()`` is the full text (what ``explain`` prints), ``repr()`` one line."""

    heads: list[HeadExplanation]
    diagnosis: Diagnosis

    @property
    def wrapper(self) -> bool:
        """explain() was given a torch.compile wrapper."""
        return self.diagnosis.wrapper

    def __repr__(self) -> str:
        done = sum(h.rewritten for h in self.heads)
        return f"<nanospec Explanation of {self.diagnosis.model}: {done} of {len(self.heads)} head(s) rewritten>"

    def __str__(self) -> str:
        d = self.diagnosis
        observer = (f"nanospec: {d.model} is a target observer (its own head stays dense, by design): it observes "
                    f"{d.feeds_text()}") if d.feeds else None
        if not self.heads:
            return observer or f"nanospec: no head rewritten in {d.model}: {d.text()}"
        done = sum(h.rewritten for h in self.heads)
        lines = [f"nanospec: {done} head(s) rewritten"
                 + (f", {len(self.heads) - done} not rewritten" if done < len(self.heads) else "")]
        for h in self.heads:
            s = h.state
            lines += [
                f"  head {public_names([h.name, *h.names])[0]}"
                + (f" (module {h.module_path})" if h.module_path else "")
                + f": V={h.vocab_size}, H={h.hidden_size}"
                + (f", {s.cache_w.shape[1]} heads stacked in one weight (Medusa), one active set for all of them"
                   if getattr(s, "stacked", ()) else ""),
                f"    names: {', '.join(public_names(h.names))}",
                f"    active vocabulary: {len(s)} / {s.capacity} slots, policy={s.policy}, pinned={s.num_pinned}, "
                f"device={s.ids.device}",
                f"    graphs compiled: {h.graphs} (torch._dynamo.utils.counters['nanospec'] counts this head once "
                f"per graph: heads_rewritten is a count of graphs); input observers: {h.observers}",
            ]
            if h.target_observers:
                lines.append(f"    fed by {len(h.target_observers)} target observer graph(s) (observe_topk="
                             f"{', '.join(map(str, h.target_observers))})")
            if not h.rewritten:
                lines.append("    NOT REWRITTEN: no graph compiled with backend='nanospec' has run this head: it runs "
                             "dense, and its active vocabulary only fills from observe() calls and target observers. "
                             + d.text())
                continue
            lines += [
                f"    post-ops on compact logits: {', '.join(h.post_ops) or 'none'}",
                f"    consumers on compact logits: {', '.join(h.consumers) or 'none'}",
                f"    read the [..., V] logits: {', '.join(h.exits) or 'nothing'}",
                f"    kernels: {_PATHS[h.path]}",
                f"    bytes dense:    {h.cost.dense_bytes}",
                f"    bytes nanospec: {h.cost.nanospec_bytes}",
                f"    FLOPs dense / nanospec: {h.cost.dense_flops} / {h.cost.nanospec_flops}",
                f"    cost model: {h.constants}",
                "    predicted head speedup at the current active size: "
                + ", ".join(f"{speedup(v)} for {r} row(s)" for r, v in h.predictions().items())
                + (" (below 1x: at this vocabulary the dense head is faster; the rewrite pays on vocabularies far "
                   "wider than the active set)" if min(h.predictions().values()) < 1 else ""),
            ]
            if h.collective is not None:
                lines += h.collective_lines()
        if d.dense and done:
            lines += ["  dense elsewhere:"] + [f"    {m}" for m in d.dense]
        return "\n".join(lines + ([observer] if observer else []))


def explain(module: nn.Module, calibrate: bool = False, *, quiet: bool = False,
            file: TextIO | None = None) -> Explanation:
    """Print the report (to ``file``, by default ``sys.stdout``; nothing with ``quiet=True``) and return it
    (:class:`Explanation`: its ``str()`` is the report, its ``repr()`` one line, so an interactive session does not
    show it twice). It reports every head of ``module`` (compiled or original) that has an active vocabulary, wherever
    its weight is held (parameter, buffer, tensor attribute): the nodes matched, the post-ops and
    consumers kept in compact space, the active set, and the cost model of the kernels that run it.
    A head with an active vocabulary but no compiled graph (``attach`` without a compiled call, or a
    ``torch.compile`` wrapper that generate() bypassed) is reported as not rewritten, with the reason.
    ``calibrate=True`` measures the cost model's constants on this CPU first
    (:mod:`nanospec_fx.diagnostics.calibration`,
    about a second per head width); by default they are those fitted on the project's test machine."""
    if not isinstance(unwrap(module), nn.Module):
        raise TypeError(f"explain() takes a model (the torch.compile wrapper or the module compiled in place), got "
                        f"{type(module).__name__}: print() it to see its active sets"
                        + (", active_count(request_id) gives one request's size"
                           if hasattr(module, "active_count") else ""))
    diagnosis = diagnose(module)
    module = unwrap(module)
    heads = []
    for state, names in {**state_names(module), **argument_heads(module)}.items():
        name = names[0]
        reports = pass_reports.reports(state)
        compact_only = bool(reports) and all(not r.exits for r in reports)
        path = path_for(state.cache_w.device)
        size = torch.empty((), dtype=state.cache_w.dtype).element_size()
        # K stacked heads (one weight, one set) read K rows of H per token: a row of K * H for the cost model
        width = state.hidden_size * (state.cache_w.shape[1] if getattr(state, "stacked", ()) else 1)
        machine = _constants(path, width, state.cache_w.dtype, calibrate)
        cost = HeadCost.for_path(state.rows, width, size, compact_only, path, state.capacity, machine)
        shard = getattr(state, "shard", None)  # a vocabulary-parallel head (sharded_state.ShardedActiveVocab)
        world = shard.world_size if shard is not None else 1
        collective = CollectiveCost(state.rows, state.hidden_size, state.capacity, size) if shard is not None else None
        heads.append(HeadExplanation(
            name=name,
            module_path=next((r.module_path for r in reports if r.module_path), None),
            vocab_size=state.rows,
            hidden_size=state.hidden_size,
            state=state,
            graphs=len(reports),
            post_ops=_unique(op for r in reports for op in r.post_ops),
            consumers=_unique(op for r in reports for op in r.consumers),
            exits=_unique(op for r in reports for op in r.exits),
            observers=max((r.observers for r in reports), default=0),
            cost=cost,
            names=names,
            path=path,
            constants=machine.describe(),
            world_size=world,
            collective=collective,
            target_observers=target_observers(state),
        ))
    report = Explanation(heads, diagnosis)
    if not quiet:
        print(report, file=file if file is not None else sys.stdout)
    return report


def _constants(path: str, hidden_size: int, dtype: torch.dtype, calibrate: bool) -> MachineConstants:
    if calibrate and path in ("host", "reference"):
        try:
            return measure_constants(hidden_size, dtype)
        except CalibrationError as error:  # a busy machine: say so, predict with the fitted constants
            warn_once(f"nanospec: {error}; the report uses the constants fitted on the project's test machine")
            fitted = MachineConstants.fitted(path)
            return replace(fitted, source=f"{fitted.source} (this machine's calibration was implausible)")
    return MachineConstants.fitted(path)


def speedup(value: float) -> str:
    """A predicted speedup with the precision it has: two significant digits (``0.012x``, ``0.75x``, ``3.2x``,
    ``41x``), never ``0.0x``."""
    return f"{value:.0f}x" if value >= 10 else f"{value:.2g}x"


def public_names(names: list[str]) -> list[str]:
    """The names a user can use: none through a private attribute (``_nanospec_mtp.shared_head.weight``, held by
    nanospec's own integration), unless there is no other."""
    public = [n for n in names if not any(part.startswith("_") for part in n.split("."))]
    return public or names[:1]


def _unique(items) -> list[str]:
    return list(dict.fromkeys(items))
