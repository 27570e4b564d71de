"""End to end: transformers' assisted generation with a self-speculative drafter and each head.

:func:`run_e2e` times target-only greedy decoding, then ``generate(assistant_model=drafter)`` for
each drafter (full head, FR-Spec :class:`StaticHead`, nanospec), and checks every output against
the target's greedy output token for token.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import nanospec_fx
from nanospec_fx.eval.bench.timing import Stopwatch
from nanospec_fx.eagle.speculative import drafter_state


class StaticHead(nn.Module):
    """FR-Spec as a drop-in head: logits for a fixed table of ids, -inf elsewhere."""

    def __init__(self, weight: torch.Tensor, table: torch.Tensor):
        super().__init__()
        self.vocab = weight.shape[0]
        self.register_buffer("table", table.to(weight.device), persistent=False)
        self.weight_static = nn.Parameter(weight[self.table].clone(), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = h.new_full((*h.shape[:-1], self.vocab), float("-inf"))
        out[..., self.table] = F.linear(h, self.weight_static)
        return out


def truncated_drafter(target: nn.Module, layers: int, head: nn.Module | None = None) -> nn.Module:
    """A self-speculative drafter: the target's first ``layers`` layers, final norm and (shared) head.

    Every parameter is the target's own tensor, so the drafter costs no memory; ``head`` replaces
    the LM head (e.g. a :class:`StaticHead`).
    """
    import copy

    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    with torch.device("meta"):
        drafter = type(target)(cfg)
    base, tbase = getattr(drafter, drafter.base_model_prefix), getattr(target, target.base_model_prefix)
    for name, child in tbase.named_children():
        setattr(base, name, nn.ModuleList(list(child)[:layers]) if name == "layers" else child)
    drafter.lm_head = head if head is not None else target.lm_head
    for name, t in list(drafter.named_parameters()) + list(drafter.named_buffers()):
        if t.is_meta:
            raise RuntimeError(f"truncated drafter: {name} was not taken from the target")
    drafter.generation_config = copy.deepcopy(target.generation_config)
    return drafter.eval()


class DraftTimer:
    """Wraps ``drafter.generate`` (what assisted generation calls each round): rounds and seconds."""

    def __init__(self, drafter: nn.Module):
        self.drafter, self.rounds, self.watch, self.inside = drafter, 0, Stopwatch(), False
        self._generate = drafter.generate
        drafter.generate = self

    @property
    def seconds(self) -> float:
        return self.watch.seconds

    def __call__(self, *args, **kwargs):
        self.inside = True
        try:
            with self.watch:
                return self._generate(*args, **kwargs)
        finally:
            self.rounds += 1
            self.inside = False

    def reset(self) -> None:
        self.rounds, self.watch = 0, Stopwatch()


class TargetTopK:
    """LogitsProcessor for the target: its top-k at every position it verifies joins the drafter's set.

    Unlike ``nanospec_fx.speculative_pair`` (which compiles the target in place as the observer and
    also sees the prefill), this keeps the target eager, so every variant runs the same target.
    Assisted generation hands the same processors to the drafter: calls made while it drafts are ignored.
    """

    def __init__(self, drafter: nn.Module, timer: DraftTimer, k: int = 3):
        self.drafter, self.timer, self.k = drafter, timer, k

    def __call__(self, input_ids, scores):
        if not self.timer.inside:
            state = drafter_state(self.drafter)
            if state is not None:  # None: not compiled / not called yet
                state.observe(scores.topk(self.k, dim=-1).indices, validate=False)
        return scores


@dataclass
class E2EResult:
    variant: str
    tokens: int
    seconds: float
    tokens_per_s: float
    rounds: int
    tokens_per_round: float
    draft_share: float
    identical: bool
    active_size: float


def run_e2e(target: nn.Module, prompts: list[list[int]], drafters: dict[str, nn.Module], max_new: int = 64,
            draft_tokens: int = 6, observe_topk: int = 3, progress=None, pair: dict | None = None,
            requests: list | None = None, active: set[str] | None = None) -> list[E2EResult]:
    """Target-only greedy decoding, then ``generate(assistant_model=d)`` for each drafter.

    Drafters whose head has an active vocabulary (compiled with nanospec) are reset before each
    request and fed the target's top-``observe_topk`` at every verified position. Each variant's
    output is compared token for token with the target's greedy output.

    With ``pair`` (backend options) the last drafter is set up with ``nanospec_fx.speculative_pair``
    instead: the target is compiled in place as the observer (so it must come last).
    ``requests`` (a list) receives one row per decoded request: variant, seconds, tokens, output check.
    ``active``: the drafters with an active vocabulary (default: those named ``nanospec...``). Only they are
    fed the target's top-k and report a mean |A|: the full and static heads share the head weight (and so
    its active vocabulary) but must not be charged for keeping it.
    """
    from transformers import LogitsProcessorList

    kw = dict(do_sample=False, max_new_tokens=max_new, pad_token_id=target.generation_config.pad_token_id or 0)
    results, reference = [], []
    with torch.inference_mode():
        for p in prompts[:2]:  # warm-up, as for the drafters
            target.generate(torch.tensor([p]), **kw)
        per = requests if requests is not None else []
        n, secs, _, _ = _decode_requests("target only", lambda p: target.generate(torch.tensor([p]), **kw)[0, len(p):],
                                         prompts, reference, per)
        results.append(E2EResult("target only", n, secs, n / secs, n, 1.0, 0.0, True, float("nan")))
        if progress:
            progress("target only")
        active = {n for n in drafters if n.startswith("nanospec")} if active is None else set(active)
        for name, drafter in drafters.items():
            g = drafter.generation_config
            g.num_assistant_tokens, g.num_assistant_tokens_schedule, g.assistant_confidence_threshold = (
                draft_tokens, "constant", 0.0)
            if pair is not None and name == list(drafters)[-1]:
                nanospec_fx.speculative_pair(target, drafter, observe_topk=observe_topk, **pair)
                procs = LogitsProcessorList()
                timer = DraftTimer(drafter)
            else:
                timer = DraftTimer(drafter)
                procs = LogitsProcessorList(
                    [TargetTopK(drafter, timer, observe_topk)] if observe_topk and name in active else [])
            def run(p, drafter=drafter, procs=procs):
                out = target.generate(torch.tensor([p]), assistant_model=drafter, logits_processor=procs, **kw)
                return out[0, len(p):]
            for p in prompts[:2]:  # warm-up: a compiled drafter recompiles once for dynamic lengths, then settles
                run(p)
            timer.reset()
            n, secs, same, sizes = _decode_requests(name, run, prompts, reference, per, timer,
                                                    drafter if name in active else None)
            results.append(E2EResult(name, n, secs, n / secs, timer.rounds, n / max(timer.rounds, 1),
                                     timer.seconds / secs, bool(same),
                                     statistics.mean(sizes) if sizes else float("nan")))
            drafter.generate = timer._generate
            if progress:
                progress(name)
    return results


def _decode_requests(name: str, run, prompts: list[list[int]], reference: list[torch.Tensor], per: list,
                     timer: DraftTimer | None = None, drafter: nn.Module | None = None):
    """Decode every prompt with ``run`` on one stopwatch; returns (new tokens, seconds, all identical, |A| per
    request). ``reference`` (the target's outputs) is filled while empty and checked against after. A ``drafter``
    with an active vocabulary has it reset before each request (a new request) and its size read after."""
    n, watch, same, sizes = 0, Stopwatch(), True, []
    for i, p in enumerate(prompts):
        state = drafter_state(drafter) if drafter is not None else None
        if state is not None:
            state.reset()
        before, rounds_before = watch.seconds, timer.rounds if timer is not None else 0
        with watch:
            out = run(p)
        if len(reference) == i:
            reference.append(out)
        identical = bool(torch.equal(out, reference[i]))
        same, n = same and identical, n + out.numel()
        row = {"variant": name, "request": i, "seconds": round(watch.seconds - before, 6), "new_tokens": out.numel()}
        if timer is not None:
            row["rounds"] = timer.rounds - rounds_before
        per.append({**row, "identical": identical})
        state = drafter_state(drafter) if drafter is not None else None
        if state is not None:
            sizes.append(len(state))
    return n, watch.seconds, same, sizes
