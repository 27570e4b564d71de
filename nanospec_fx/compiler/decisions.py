"""Why a head found in a graph runs dense: each soundness decision of the compile, as a reason (or None).

Each function answers for one head (or one group of heads) from the graph and the call's facts; the plan
(:mod:`nanospec_fx.compiler.plan`) asks them once and keeps the answer as the head's decision, so every reason is
decided in one place and said once.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from nanospec_fx.passes import HeadMatch, find_meetings, grad_enabled_at, transforms, unobserved_lookup


def dense_reason(gm: fx.GraphModule, head: HeadMatch, real: dict, position, observe_inputs: bool,
                 takes_dtensor: bool) -> str | None:
    """Why ``head`` cannot be rewritten in this graph for this call (None: nothing stops it yet)."""
    weight, bias = real.get(head.weight), bias_tensor(head, real)
    transform = transform_at(gm.graph, head)
    if transform:
        return inside_transform(transform)
    if weight is None or bias is False:
        return "its weight or bias is not a parameter or buffer (it is computed in the graph or passed in)"
    if hasattr(weight, "placements") and not takes_dtensor:
        return ("its weight is a DTensor in a layout nanospec does not rewrite (it rewrites ColwiseParallel heads, "
                "Shard(0) on a 1-D mesh, whose output is redistributed to Replicate(), or stays Shard(-1) and is "
                "read by a local max/top-k whose (value, id) candidates are all-gathered and picked from)")
    sources = [real.get(n) for n in getattr(head, "sources", ())]  # scales / parameters a weight computed per row reads
    if grad_enabled_at(gm.graph, head.nodes, torch.is_grad_enabled()) and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (weight, bias, *sources)):
        return ("it needs gradients here: grad mode is on where it runs and its weights are trainable. "
                "NanoSpec is for inference: call the drafter under torch.inference_mode() or torch.no_grad(), "
                "or freeze the head with requires_grad_(False)")
    if observe_inputs and not position.whole_call:
        return (f"this graph is one piece of a call split by graph breaks ({position.describe()}), so the token ids "
                "the call embeds in another piece cannot be proven active before the head reads the active set, "
                "and post-ops run in another piece would give inactive tokens finite values. Remove the graph "
                "break (print, .item(), int(tensor), a data-dependent branch, torch._dynamo.graph_break()), or "
                "compile with options={'observe_inputs': False} and feed the set yourself with "
                "nanospec_fx.active_vocab(model).observe(ids)")
    if observe_inputs:
        return unobserved_lookup(gm.graph, head)
    return None


def meetings(gm: fx.GraphModule, heads: list[HeadMatch]) -> list[tuple[list[HeadMatch], str]]:
    """Groups of heads whose logits one op combines (``passes/heads_meet.py``), each with the reason they all run
    dense: each head weight has its own active set."""
    groups = []
    for meeting in find_meetings(gm.graph, [h.nodes for h in heads]):
        group = [heads[i] for i in meeting.heads]
        low_rank = [h for h in group if h.hidden_size < max(g.hidden_size for g in group)]
        groups.append((group, (
            f"the logits of two heads are combined ({meeting.describe()}): each head weight has its own active set, "
            "so no one set makes the combined logits exact (one head's chain going on through the op would mask "
            "the result with that head's set alone). Combine them after the drafter's call, or rewrite one of them "
            "with options={'head': ...}"
            + (f"; {', '.join(h.name for h in low_rank)} reads a low-rank input (a LoRA delta B(A(h)) on the head): "
               "merge it into the head weight (W + s * B @ A; peft's merge_and_unload()) to have the head rewritten"
               if low_rank else ""))))
    return groups


def layout_clash(head: HeadMatch, heads: list[HeadMatch]) -> str | None:
    """A square weight read both as stored and transposed is two heads with one state (one per weight), which caches
    its rows in one layout: the transposed reader runs dense."""
    other = next((h for h in heads if h is not head and h.weight is head.weight and not h.transposed), None)
    if other is None or not head.transposed:
        return None
    return (f"its weight is also read as stored ([V, H]) by the head {other.name} in this graph, and the one active "
            "vocabulary of a weight caches its rows in one layout")


def transform_at(graph: fx.Graph, head: HeadMatch) -> str | None:
    """The functorch transform (``torch.vmap``...) a projection of ``head`` runs inside, if any."""
    regions = transforms.transform_regions(graph)
    return next((regions[n] for n in head.nodes if n in regions), None)


def inside_transform(transform: str) -> str:
    return (f"it runs inside {transform}, which Dynamo inlines: its values there are the transform's wrapped "
            "(batched) tensors, on which nanospec's ops cannot run. Move the head out of the transform: apply it "
            "to the transform's output (torch.vmap(body)(x), then the head), which computes the same logits")




def real_tensors(gm: fx.GraphModule, example_inputs: list) -> dict[fx.Node, torch.Tensor]:
    """The real parameter tensors behind placeholder / get_attr nodes."""
    found = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.Tensor):
            found[node] = value
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            obj = gm
            for part in node.target.split("."):
                obj = getattr(obj, part)
            if isinstance(obj, torch.Tensor):
                found[node] = obj
    return found


def bias_tensor(head: HeadMatch, real: dict) -> torch.Tensor | None | bool:
    """The head's bias tensor, None without one, False when the projections disagree or it is computed."""
    biases = set(head.biases)
    if len(biases) > 1:
        return False
    (b,) = biases
    if b is None:
        return None
    return real.get(b, False) if b.op in ("placeholder", "get_attr") else False
