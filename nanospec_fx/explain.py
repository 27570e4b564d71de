"""``nanospec_fx.explain(module)``: what the pass did to a drafter and what it should gain."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from nanospec_fx.cost_model import HeadCost
from nanospec_fx.lookup import state_names, unwrap
from nanospec_fx.state import ActiveVocab


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

    def predictions(self, rows=(1, 10)) -> dict[int, float]:
        active = max(len(self.state), 1)
        return {r: self.cost.predict(r, active) for r in rows}


@dataclass
class Explanation:
    heads: list[HeadExplanation]

    def __str__(self) -> str:
        if not self.heads:
            return "nanospec: no head rewritten yet (compile with backend='nanospec' and call the module once)"
        lines = [f"nanospec: {len(self.heads)} head(s) rewritten"]
        for h in self.heads:
            s = h.state
            lines += [
                f"  head {h.name}" + (f" (module {h.module_path})" if h.module_path else "") + f": V={h.vocab_size}, H={h.hidden_size}",
                f"    names: {', '.join(h.names)}",
                f"    active vocabulary: {len(s)} / {s.capacity} slots, policy={s.policy}, pinned={s.num_pinned}, device={s.ids.device}",
                f"    graphs compiled: {h.graphs}; input observers: {h.observers}",
                f"    post-ops on compact logits: {', '.join(h.post_ops) or 'none'}",
                f"    consumers on compact logits: {', '.join(h.consumers) or 'none'}",
                f"    read the [..., V] logits: {', '.join(h.exits) or 'nothing'}",
                f"    bytes dense:    {h.cost.dense_bytes}",
                f"    bytes nanospec: {h.cost.nanospec_bytes}",
                f"    FLOPs dense / nanospec: {h.cost.dense_flops} / {h.cost.nanospec_flops}",
                "    predicted head speedup at the current active size: "
                + ", ".join(f"{v:.1f}x for {r} row(s)" for r, v in h.predictions().items()),
            ]
        return "\n".join(lines)


def explain(module: nn.Module) -> Explanation:
    """Report every head of ``module`` (compiled or original) that has an active vocabulary, wherever
    its weight is held (parameter, buffer, tensor attribute): the nodes matched, the post-ops and
    consumers kept in compact space, the active set, and the cost model."""
    module = unwrap(module)
    heads = []
    for state, names in state_names(module).items():
        name = names[0]
        reports = state.rewrites
        compact_only = bool(reports) and all(not r.exits for r in reports)
        cost = HeadCost(state.rows, state.hidden_size, torch.empty((), dtype=state.cache_w.dtype).element_size(), compact_only)
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
        ))
    return Explanation(heads)


def _unique(items) -> list[str]:
    return list(dict.fromkeys(items))
