"""Find the drafter's LM head in a Dynamo FX graph: by structure, never by module name.

A head is a projection (see ``patterns.py``) whose weight is a parameter or buffer of shape
[V, H] and whose [..., V] output reaches the graph output through post-ops, views and
consumers only. A body layer whose width happens to be V feeds another projection, not the
output, so it is never a head.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from . import patterns


class HeadSelectionError(ValueError):
    """Several different projections could be the head and nothing says which."""


@dataclass
class HeadMatch:
    """One LM head: every projection node that applies the same weight."""

    weight: fx.Node
    nodes: list[fx.Node]
    name: str
    vocab_size: int
    hidden_size: int
    biases: list[fx.Node | None] = field(default_factory=list)
    module_path: str | None = None


def parameter_name(node: fx.Node) -> str:
    """A readable dotted name for a parameter placeholder, e.g. ``lm_head.weight``."""
    text = parameter_name_raw(node)
    text = re.sub(r"^[LG]\['[^']+'\](\[\d+\])?\.?", "", text)  # the frame local (self, args[0], ...)
    text = re.sub(r"\._(modules|parameters|buffers)\['([^']+)'\]", r".\2", text)
    text = re.sub(r"^_(modules|parameters|buffers)\['([^']+)'\]", r"\2", text)
    text = re.sub(r"\[(\d+)\]", r".\1", text)
    return text or str(node.target)


def module_path(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    path = re.sub(r"^[LG]\['[^']+'\](\[\d+\])?\.?", "", path)
    return re.sub(r"_modules\['([^']+)'\]", r"\1", path) or None


def _is_weight_like(node: fx.Node, example: object) -> bool:
    """A parameter or buffer (fixed across calls), not an arbitrary tensor argument."""
    if node.op == "get_attr":
        return True
    if node.op != "placeholder":
        return False
    if isinstance(example, torch.nn.Parameter):
        return True
    return "_buffers[" in parameter_name_raw(node)


def parameter_name_raw(node: fx.Node) -> str:
    """Dynamo's source expression for a placeholder (``L['self']._modules['lm_head']...``), or ''."""
    source = node.meta.get("grapharg").source if "grapharg" in node.meta else None
    if source is None:
        return ""
    n = source.name
    return n() if callable(n) else str(n)


def reaches_output(node: fx.Node, vocab_size: int) -> bool:
    """Whether the [..., V] value of ``node`` flows to the graph output via vocab-axis ops only."""
    carriers, derived, stack = {node}, set(), [node]
    while stack:
        cur = stack.pop()
        for user in cur.users:
            if user.op == "output":
                return True
            if cur in carriers and (
                patterns.elementwise_operands_ok(user, cur, vocab_size, carriers)
                or patterns.view_keeps_vocab(user, cur, vocab_size)
                or patterns.is_call(user, {torch.softmax, torch.log_softmax, torch.nn.functional.softmax, torch.nn.functional.log_softmax}, {"softmax", "log_softmax"})
            ):
                if user not in carriers:
                    carriers.add(user)
                    stack.append(user)
            elif cur in derived or patterns.is_call(user, patterns.CONSUMER_FUNCTIONS, patterns.CONSUMER_METHODS):
                if user not in derived:
                    derived.add(user)
                    stack.append(user)
    return False


def find_heads(gm: fx.GraphModule, example_inputs: list, vocab_size: int | None = None, head: str | None = None) -> list[HeadMatch]:
    """The LM head(s) of ``gm``, grouped by weight. Raises HeadSelectionError when ambiguous.

    ``vocab_size`` keeps only projections of that width; ``head`` keeps only the projection whose
    weight name or module path equals or ends with it.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    example_of = {n: ex for n, ex in zip(placeholders, example_inputs)}
    groups: dict[fx.Node, HeadMatch] = {}
    for node in gm.graph.nodes:
        m = patterns.match_projection(node)
        if m is None:
            continue
        x, w, b = m
        w_shape, out_shape = patterns.tensor_shape(w), patterns.tensor_shape(node)
        if w_shape is None or out_shape is None or not all(isinstance(d, int) for d in w_shape):
            continue  # V and H must be static
        n_out, hidden = w_shape
        if vocab_size is not None and n_out != vocab_size:
            continue
        if not _is_weight_like(w, example_of.get(w)) or not reaches_output(node, n_out):
            continue
        name = parameter_name(w)
        if head is not None and not _name_matches(head, name, module_path(node)):
            continue
        match = groups.setdefault(w, HeadMatch(w, [], name, n_out, hidden, module_path=module_path(node)))
        match.nodes.append(node)
        match.biases.append(b)
    heads = list(groups.values())
    if len(heads) > 1:
        widest = max(h.vocab_size for h in heads)
        if vocab_size is None and sum(h.vocab_size == widest for h in heads) == 1:
            heads = [h for h in heads if h.vocab_size == widest]
        else:
            names = ", ".join(f"{h.name} [V={h.vocab_size}, H={h.hidden_size}]" for h in heads)
            raise HeadSelectionError(
                f"nanospec found several possible LM heads: {names}. Choose one with "
                "torch.compile(..., backend='nanospec', options={'head': '<name>'})"
            )
    return heads


def _name_matches(wanted: str, weight_name: str, mod_path: str | None) -> bool:
    names = {weight_name, weight_name.rsplit(".", 1)[0]}
    if mod_path:
        names.add(mod_path)
    return any(n == wanted or n.endswith("." + wanted) for n in names)
