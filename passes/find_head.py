"""Find the drafter's LM head in a Dynamo FX graph: by structure, never by module name.

A head is a projection (see ``patterns.py``) whose weight is a parameter or buffer of shape
[V, H], whose [..., V] output reaches the graph output through post-ops, views and
consumers only, and whose V is the vocabulary: the rows of the token embedding the graph
looks ids up in (or that embedding's own weight, tied). A body layer whose width happens to
be V feeds another projection, not the output; a projection of another width (an MoE router,
a hidden-state projection wider than V) is never the head when a token embedding says what V
is. See :func:`find_heads` for the whole rule.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from . import patterns, projections, vocab_views
from .contract import DenseHead
from .graph import node_name, where
from .lora_delta import lora_deltas
from .lookups import embedding_lookups, rows_chosen_in_graph
from .row_weight import row_weight
from .stacked_heads import match_stacked, stacked_operand


class HeadSelectionError(ValueError):
    """``options['head']`` names no projection of the graph (or several weights). The backend raises it to the
    caller as an ``OptionError`` (not wrapped in Dynamo's ``BackendCompilerFailed``); passes/ stays below options."""


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
    reach: str | None = field(default=None, compare=False)  # how its output reaches the graph output
    # the weight is stored [H, V] (``h @ W``, ``F.linear(h, W.t())``): its columns are the rows
    transposed: bool = False
    sources: list[fx.Node] = field(default_factory=list, compare=False)  # other inputs of a weight computed per row
    # K heads stacked in one 3-D weight ([K, V, H], [K, H, V]...) applied by one einsum/matmul (``stacked_heads``):
    # the positions of its V, K and H axes; () for a head of one 2-D weight
    stacked: tuple = ()

    __hash__ = object.__hash__


def parameter_name(node: fx.Node) -> str:
    """A readable dotted name for a parameter placeholder, e.g. ``lm_head.weight``."""
    text = patterns.source_name(node)
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


def reaches_output(node: fx.Node, vocab_size: int) -> str | None:
    """How the [..., V] value of ``node`` reaches the graph output: ``"logits"`` (through
    post-ops, views, softmax, stacking), ``"selection"`` (only through top-k/argmax-like
    consumers and what is computed from them), or None."""
    carriers, derived, stack = {node}, set(), [node]
    via_selection = False
    while stack:
        cur = stack.pop()
        for user in cur.users:
            if user.op == "output":
                if cur in carriers:
                    return "logits"
                via_selection = True
                continue
            if cur in carriers and (
                patterns.elementwise_operands_ok(user, cur, vocab_size, carriers)
                or vocab_views.view_keeps_vocab(user, cur, vocab_size)
                or vocab_views.is_reshape_or_permute(user)
                or patterns.is_call(user, patterns.SOFTMAX_FUNCTIONS, patterns.SOFTMAX_METHODS)
                or patterns.is_call(user, patterns.JOIN_FUNCTIONS)
                or vocab_views.is_basic_indexing(user, cur)  # incl. ``z[..., :V']`` of a padded head
                or (patterns.is_write_like(user) and user.args[0] is cur)  # a ban: ``z.scatter(-1, ids, -inf)``
            ):
                out = user.kwargs.get("out")  # ``torch.tanh(z, out=buf)``: buf carries the logits on
                for node in (user, out) if isinstance(out, fx.Node) else (user,):
                    if node not in carriers:
                        carriers.add(node)
                        stack.append(node)
            elif projections.match_projection(user) is None:  # computed from the logits (a selection, an entropy)
                if user not in derived:
                    derived.add(user)
                    stack.append(user)
    return "selection" if via_selection else None


def token_tables(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Embedding tables the graph looks token ids up in (ids from a user input): node -> rows. A table of int32/int64
    entries maps ids to ids (Gemma-4's cluster -> token ordering, read at a top-k of centroid scores): it holds no
    token vectors and its rows say nothing about a vocabulary (an int8/uint8 table may be a quantised embedding)."""
    return {table: rows for _, _, table, rows in embedding_lookups(gm.graph)
            if getattr(patterns.example_value(table), "dtype", None) not in (torch.int32, torch.int64)}


def find_heads(gm: fx.GraphModule, example_inputs: list, vocab_size: int | None = None, head: str | None = None,
               notes: list[str] | None = None) -> list[HeadMatch]:
    """The LM head(s) of ``gm`` (:func:`_find_heads`); with none, a token table whose rows the graph reads at ids it
    chose from scores is named in ``notes``: a head whose rows are chosen in the graph (Gemma-4's centroid head), said
    in the graph that holds the choice, so a call split by a graph break (its ``.item()``) is warned at its first
    call, whichever piece holds the head."""
    found = _find_heads(gm, example_inputs, vocab_size, head, notes)
    if not found and notes is not None:
        for lk, selection in rows_chosen_in_graph(gm.graph)[:1]:
            notes.append(f"the rows of the token table {parameter_name(lk.table)} are read at ids chosen in this graph "
                         f"by {node_name(selection, attribute=True)} ({where(lk.node)}): a head whose rows are chosen "
                         "in the graph (a centroid or cluster selection of the table's rows), which nanospec does not "
                         "rewrite; it runs unchanged and exact")
    return found


def _find_heads(gm: fx.GraphModule, example_inputs: list, vocab_size: int | None = None, head: str | None = None,
                notes: list[str] | None = None) -> list[HeadMatch]:
    """The LM head(s) of ``gm``, grouped by weight, chosen by structure (never by width alone).

    * ``head`` (a weight name or module path) picks that projection; a name that matches
      none (or several weights) raises HeadSelectionError listing the candidates.
    * ``vocab_size``: every projection of that width whose output reaches the graph output.
    * otherwise, among projections whose output reaches the graph output, every one onto the token
      vocabulary: a weight shared with the token embedding, and the projections as wide as a token embedding
      has rows (Medusa heads, MTP depths with heads of their own: each is rewritten with its own state, one
      per weight), the widest of them only (a 2-way classifier beside a token-type table is no head). A table
      with more rows than any projection has outputs (a padded vocabulary) says nothing about V: none, with a
      note naming the candidates (the ``vocab_size`` or ``head`` option picks, and the ids in [0, V) are
      observed); with no token embedding in the graph: the one projection wider than its
      input that reaches the output, if its logits (not only a selection of them) do (a router or a
      hidden-state projection is narrower or is not alone); several wider projections reaching the output:
      none, with a note saying why (nothing says which is a head and which a hidden-state projection).
    """
    groups, deltas = _without_lora_deltas(gm.graph, _projection_groups(gm, example_inputs))
    if head is not None:
        chosen = [g for g in groups if name_matches(head, g.name, g.module_path)]
        if vocab_size is not None:
            chosen = [g for g in chosen if g.vocab_size == vocab_size]
        if not chosen:
            raise HeadSelectionError(
                f"nanospec: options['head']={head!r} matches no projection in this graph. "
                f"Candidates: {_describe(groups) or _NO_CANDIDATE}"
            )
        return _unique(chosen)
    reaching = {g: g.reach for g in groups if g.reach}
    if vocab_size is not None:
        return [g for g in reaching if g.vocab_size == vocab_size]
    tables = token_tables(gm)
    tied = [g for g in reaching if tables.get(g.weight) == g.vocab_size or g.transposed and any(
        projections.transposed_weight(t) is g.weight for t in tables)]  # F.embedding(ids, W.t()) with the head h @ W
    vocabularies = set(tables.values())
    # Every projection onto the token vocabulary is a head (Medusa heads, MTP depths with their own heads): tied to
    # the embedding, or as wide as a table the graph looks token ids up in. Each has its own state (one per weight).
    # A projection as wide as a smaller table than the largest is a head only when it is wider than its input: a
    # router as wide as a segment or token-type table (a few rows) is no head, even when the real head is not found.
    heads = tied + [g for g in reaching if g not in tied and g.vocab_size in vocabularies
                    and (g.vocab_size == max(vocabularies) or g.vocab_size > g.hidden_size)]
    if heads:  # as wide as the largest such table: a small one (token types, segments) is no vocabulary of a head
        widest = max(h.vocab_size for h in heads)
        heads = [h for h in heads if h.vocab_size == widest]
    grouped = {n for g in groups for n in g.nodes} | deltas
    computed = [n for n in gm.graph.nodes if (shape := projections.projection_shape(n)) and shape[0] in vocabularies
                and n not in grouped and reaches_output(n, shape[0])]  # a weight computed in the graph
    if computed and notes is not None:
        notes.append(DenseHead(module_path(computed[0]) or computed[0].name,
                               "the weight is not row-wise: it is computed in the graph "
                               f"({_weight_op(computed[0])}) and "
                               "nanospec cannot prove that each of its rows depends only on the same row of stored "
                               "tensors (elementwise ops, per-row scales, reductions over the last axis): it is not "
                               "rewritten"))
    unread = [(n, reason) for n in gm.graph.nodes if (reason := projections.unmatched_reason(n))
              and (shape := patterns.tensor_shape(n)) and isinstance(shape[-1], int)
              and (shape[-1] in vocabularies or not vocabularies) and reaches_output(n, shape[-1])]
    if unread and notes is not None:  # an addmm / baddbmm onto the vocabulary with a bias or scales not read
        notes.append(DenseHead(module_path(unread[0][0]) or unread[0][0].name, f"{unread[0][1]}: it is not rewritten"))
    example_of = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs))
    stacked = [(n, w, v) for n in gm.graph.nodes if (w := stacked_operand(n)) is not None and match_stacked(n) is None
               and patterns.is_weight_like(w, example_of.get(w)) and (shape := patterns.tensor_shape(n))
               and (v := next((d for d in shape if isinstance(d, int) and d in vocabularies), None))
               and reaches_output(n, v)]
    if stacked and notes is not None:  # a stacked weight read onto the vocabulary in a way not read as K heads
        n, w, v = stacked[0]
        notes.append(DenseHead(
            parameter_name(w), f"its {node_name(n)} ({where(n)}) reads the stacked weight {parameter_name(w)} "
            f"{tuple(patterns.tensor_shape(w))} onto the vocabulary (V={v}) in a way nanospec does not rewrite: only "
            "one contraction over H that keeps the K and V axes of the weight is read as K Medusa heads "
            "(passes/stacked_heads.py); it is not rewritten"))
    if heads:
        return heads
    if vocabularies:
        padded = [g for g in reaching if g.hidden_size < g.vocab_size < max(vocabularies)]
        if padded and notes is not None and not stacked:  # a padded table: its rows do not say what V is, so nothing
            #                                                  is guessed (a stacked weight as wide as it was said)
            notes.append(f"the token embedding has {max(vocabularies)} rows and no projection that many outputs; for a "
                         "padded vocabulary name the head's width, "
                         f"e.g. options={{'vocab_size': {padded[0].vocab_size}}} "
                         f"(candidates: {_describe(padded)}); for a head over a draft vocabulary (EAGLE-3: head row "
                         "i is target token i + d2t[i]) pass "
                         f"options={{'draft_to_target': torch.arange({padded[0].vocab_size}) + d2t, "
                         f"'target_vocab_size': {max(vocabularies)}}}")
        return []
    # Every projection wider than its input that reaches the output counts (through its logits or only
    # through a selection of them): a wider one returned as logits is not the head because the head's own
    # logits are only selected from. Several: nothing says which.
    wider = [g for g in reaching if g.vocab_size > g.hidden_size]
    computed = [n for n in projections_reaching_output(gm) if n not in grouped]  # a weight computed in the graph
    candidates = [g for g in wider if reaching[g] == "logits"] if len(wider) == 1 and not computed else wider
    if len(candidates) > 1 or (candidates and computed):
        if notes is not None:
            notes.append("several projections could be the head and no token embedding says which ("
                         + ", ".join([_describe(candidates)] * bool(candidates)
                                     + [f"{n.name} (a weight computed in the graph)" for n in computed]) + ")")
        return []
    return candidates


def projections_reaching_output(gm: fx.GraphModule) -> list[fx.Node]:
    """Every projection wider than its input (any weight, a computed one too) whose output reaches the graph
    output: what could be a head."""
    found = []
    for node in gm.graph.nodes:
        shape = projections.projection_shape(node)
        if shape and isinstance(shape[0], int) and shape[0] > shape[1] \
                and reaches_output(node, shape[0]):
            found.append(node)
    return found


def _weight_op(node: fx.Node) -> str:
    w = projections.match_projection(node)[1]
    return f"{w.target if isinstance(w.target, str) else getattr(w.target, '__name__', w.target)}"


def _unique(heads: list[HeadMatch]) -> list[HeadMatch]:
    if len(heads) > 1:
        raise HeadSelectionError(
            f"nanospec found several possible LM heads: {_describe(heads)}. Choose one with "
            "torch.compile(..., backend='nanospec', options={'head': '<name>'})"
        )
    return heads


_NO_CANDIDATE = "none (no linear/matmul/einsum with a 2-D parameter weight, or a 3-D one of stacked heads)"


def _describe(heads: list[HeadMatch]) -> str:
    return ", ".join(f"{h.name} [V={h.vocab_size}, H={h.hidden_size}]" for h in heads)


def _projection_groups(gm: fx.GraphModule, example_inputs: list) -> list[HeadMatch]:
    """Every projection with a static 2-D parameter/buffer weight, grouped by weight."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    example_of = {n: ex for n, ex in zip(placeholders, example_inputs)}
    groups: dict[tuple, HeadMatch] = {}
    lookups = {lookup for lookup, _, _, _ in embedding_lookups(gm.graph)}  # ``one_hot(ids) @ E`` reads rows of E
    for node in gm.graph.nodes:
        m = projections.match_projection(node) if node not in lookups else None
        if m is None:
            continue
        x, w, b = m
        transposed = projections.projection_transposed(node)
        w_shape, out_shape = projections.projection_shape(node), patterns.tensor_shape(node)
        if w_shape is None or out_shape is None or not all(isinstance(d, int) for d in w_shape):
            continue  # V and H must be static
        n_out, hidden = w_shape
        if not patterns.is_weight_like(w, example_of.get(w)):
            rows = row_weight(w, n_out) if not transposed else None  # quantised / parametrised: computed per row
            if rows is None or not patterns.is_weight_like(rows.base, example_of.get(rows.base)):
                continue
            w, sources = rows.base, [n for n in rows.leaves if n is not rows.base]
        else:
            sources = []
        match = groups.get((w, transposed))  # one weight read in both layouts (square): two groups, never one head
        if match is None:
            match = groups[(w, transposed)] = HeadMatch(w, [], parameter_name(w), n_out, hidden,
                                                        module_path=module_path(node), transposed=transposed)
        match.nodes.append(node)
        match.biases.append(b)
        match.sources += [n for n in sources if n not in match.sources]
        reach = reaches_output(node, n_out)
        if reach == "logits" or (reach and not match.reach):
            match.reach = reach
    for node in gm.graph.nodes:  # K heads stacked in one weight: one head of one set (``stacked_heads``)
        s = match_stacked(node)
        if s is None or not patterns.is_weight_like(s.weight, example_of.get(s.weight)):
            continue
        match = groups.get((s.weight, s.axes))  # one weight read with its axes in two roles: two heads, never one
        if match is None:
            match = groups[(s.weight, s.axes)] = HeadMatch(s.weight, [], parameter_name(s.weight), s.vocab_size,
                                                           s.hidden_size, module_path=module_path(node),
                                                           stacked=s.axes)
        match.nodes.append(node)
        match.biases.append(None)
        reach = reaches_output(node, s.vocab_size)
        if reach == "logits" or (reach and not match.reach):
            match.reach = reach
    return list(groups.values())


def _without_lora_deltas(graph: fx.Graph, groups: list[HeadMatch]) -> tuple[list[HeadMatch], set[fx.Node]]:
    """``groups`` less every group whose projections are all LoRA deltas of another group's (``lora_deltas``): they
    are read over that head's set (the rewrite gathers their rows), not heads of their own; and those projections."""
    found = set()
    for g in groups:
        found.update(lora_deltas(graph, g.nodes, g.vocab_size, g.hidden_size).all())
    merged = [d for d in groups if d.nodes and set(d.nodes) <= found]
    return [g for g in groups if g not in merged], {n for d in merged for n in d.nodes}


def name_matches(wanted: str, weight_name: str, mod_path: str | None) -> bool:
    names = {weight_name, weight_name.rsplit(".", 1)[0]}
    if mod_path:
        names.add(mod_path)
    return any(n == wanted or n.endswith("." + wanted) for n in names)
