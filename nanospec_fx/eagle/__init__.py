"""An EAGLE-2-style drafter and its draft rounds (greedy chain and tree, sampled chain and tree).

The drafter predicts the target's next feature from (token embedding, target feature):
``fc(cat(embed(x[t+1]), f[t])) -> one Llama-style decoder layer -> target's LM head``, and
returns ``(logits, hidden)``. Compiled with nanospec, its head computes only the active tokens.

A draft round starts from the drafter's output at the last committed position (the *root*):

* :func:`draft_chain`: ``depth`` greedy steps, one token each;
* :func:`draft_tree`: EAGLE-2's dynamic tree: at each depth expand the ``top_k`` frontier nodes,
  score their ``top_k`` children by cumulative log-prob and keep the best ``top_k`` as the next
  frontier; every scored child is a candidate, and :meth:`DraftTree.paths` keeps the best ones.

Shapes are static within a round (``top_k`` rows per depth, a KV cache of fixed length masked by
slot), all selection runs on the device, and the host reads the tree once per round, when it is
verified. :func:`draft_sampled` and :func:`verify_sampled` are the sampling counterparts: drafts
drawn from the drafter's pruned distribution, verified by speculative (recursive rejection)
sampling (nanospec_fx/sampling.py, docs/sampling.md). The decode loop that drives all of them, for
either kind of target, is :func:`nanospec_fx.eagle.speculative.decode`.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanospec_fx.vocab.module_heads import unwrap
from nanospec_fx.sampling import SpeculativeSampler


# ----------------------------------------------------------------------------- the drafter
LAYOUTS = ("nanospec", "vllm", "mtp")
#: our decoder layer's modules -> their names in a transformers Llama decoder layer (and under vLLM's ``layers.0``)
LLAMA_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
}


@dataclass
class EagleConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    #: ``"nanospec"``: features are the input of the target's final norm, fc has a bias, the layer normalises its
    #: input and the head reads ``norm(hidden)``. ``"vllm"``: EAGLE-1 as published and as vLLM's ``eagle`` method
    #: runs it (``EagleLlamaForCausalLM``): features are the final norm's *output*, fc has no bias, the layer has no
    #: input norm and the head reads ``hidden`` itself. Neither folds exactly into the other (docs/vllm.md).
    layout: str = "nanospec"

    def __post_init__(self):
        self.head_dim = self.head_dim or self.hidden_size // self.num_heads
        if self.layout not in LAYOUTS:
            raise ValueError(f"EagleConfig.layout must be one of {LAYOUTS}, got {self.layout!r}")

    @classmethod
    def from_target(cls, config) -> "EagleConfig":
        """The drafter shape of EAGLE for a transformers Llama-like target config."""
        rope = getattr(config, "rope_parameters", None) or {}  # transformers 5; 4.x has config.rope_theta
        # per layer type (Gemma-3)
        if "rope_theta" not in rope and rope and all(isinstance(v, dict) for v in rope.values()):
            rope = rope.get("full_attention") or next(iter(rope.values()))
        theta = rope.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
            head_dim=getattr(config, "head_dim", None), rope_theta=theta, rms_eps=getattr(config, "rms_norm_eps", 1e-6),
        )

    @classmethod
    def llama3_8b(cls) -> "EagleConfig":
        """Llama-3.1-8B's shape (H=4096, V=128256, GQA 32/8)."""
        return cls(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_heads=32, num_kv_heads=8,
                   rope_theta=500000.0, rms_eps=1e-5)


class KVCache:
    """Keys and values of the drafter's layer, ``[B, kv_heads, max_len, head_dim]``, written by slot."""

    def __init__(self, config: EagleConfig, max_len: int, batch: int = 1, dtype=torch.float32, device=None):
        shape = (batch, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x [B, heads, T, D]`` at ``positions [B, T]`` (rotate-half form)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = positions[:, None, :, None].float() * inv_freq  # [B, 1, T, D/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class DecoderLayer(nn.Module):
    """A Llama decoder layer (RMSNorm, GQA attention with RoPE, SwiGLU) over a slot-addressed KV cache."""

    def __init__(self, config: EagleConfig):
        super().__init__()
        c, h, d = config, config.hidden_size, config.head_dim
        self.config = config
        self.attn_norm = nn.RMSNorm(h, eps=c.rms_eps)
        self.q_proj = nn.Linear(h, c.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, c.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, c.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_heads * d, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=c.rms_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)

    def forward(self, x, positions, slots, mask, cache_k, cache_v):
        c = self.config
        b, t, _ = x.shape
        y = self.attn_norm(x)
        q = self.q_proj(y).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(y).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(y).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
        cache_k.index_copy_(2, slots, k)  # in place: the cache keeps its address across steps
        cache_v.index_copy_(2, slots, v)
        y = F.scaled_dot_product_attention(q, cache_k, cache_v, attn_mask=mask, enable_gqa=True)
        x = x + self.o_proj(y.transpose(1, 2).reshape(b, t, -1))
        y = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class EagleDrafter(nn.Module):
    """EAGLE's drafter: (token ids, target features) -> (logits, hidden).

    ``embed`` and ``lm_head`` are the target's (shared, as in EAGLE); without them the drafter
    makes its own (e.g. to benchmark a draft step at a real shape without a target). ``norm`` is
    the target's final norm, applied before the head when the features are taken before it (as
    EAGLE does); ``hidden`` is returned before the norm, so it can stand in for the next feature.
    With ``config.layout == "vllm"`` the drafter is vLLM's EAGLE-1 (see :class:`EagleConfig`): its features
    are the norm's output (:meth:`target_features` converts the target's) and the head reads ``hidden``.
    """

    def __init__(self, config: EagleConfig, embed: nn.Embedding | None = None, lm_head: nn.Linear | None = None,
                 norm: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.norm = norm
        self.embed = embed if embed is not None else nn.Embedding(config.vocab_size, config.hidden_size)
        vllm, mtp = config.layout == "vllm", config.layout == "mtp"
        if mtp:
            self.enorm = nn.RMSNorm(config.hidden_size, eps=config.rms_eps)
            self.hnorm = nn.RMSNorm(config.hidden_size, eps=config.rms_eps)
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=not (vllm or mtp))
        self.layer = DecoderLayer(config)
        if vllm:  # vLLM's (and EAGLE's) first draft layer has no input norm
            self.layer.attn_norm = nn.Identity()
        self.lm_head = lm_head if lm_head is not None else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, features, positions, slots, mask, cache_k, cache_v, logits_to_keep: int = 0,
                draft_topk: int = 0):
        """Args: ``input_ids [B, T]``, ``features [B, T, H]`` (the feature before each token),
        ``positions [B, T]`` (RoPE), ``slots [T]`` (cache rows written), ``mask [T, L]`` bool
        (cache rows each query reads), ``cache_k/v`` of a :class:`KVCache` (updated in place).
        ``logits_to_keep`` (as in transformers): score only the last N positions (0: all); the hidden state
        is returned for every position. ``draft_topk=k``: return the ``k`` best tokens of each scored position
        and their log-probs (``(log_probs [B, T', k], token ids [B, T', k])``) instead of the logits, so that a
        draft loop that only picks tokens never reads a ``[V]`` row: compiled with nanospec, the selection runs on
        the compact logits and maps the ids back (no scatter into ``[V]``)."""
        h = self.body(input_ids, features, positions, slots, mask, cache_k, cache_v)
        logits = self.lm_head(self.head_input(h[:, -logits_to_keep:] if logits_to_keep else h))
        if draft_topk:
            return tuple(torch.log_softmax(logits.float(), -1).topk(draft_topk, dim=-1)), h
        return logits, h

    def body(self, input_ids, features, positions, slots, mask, cache_k, cache_v) -> torch.Tensor:
        """The hidden state ``[B, T, H]`` of every fed position: the drafter without its head."""
        x = self.fuse(self.embed(input_ids), features.to(self.fc.weight.dtype))
        return self.layer(x, positions, slots, mask, cache_k, cache_v)

    def fuse(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The block's input from the token embeddings and the features: ``fc(cat(e, f))``, each normalised
        first in the ``mtp`` layout."""
        if self.config.layout == "mtp":
            embeds, features = self.enorm(embeds), self.hnorm(features)
        return self.fc(torch.cat([embeds, features], dim=-1))

    def trained_modules(self) -> tuple[str, ...]:
        """The drafter's own (trained) modules, by attribute name; the rest are the target's, shared."""
        return ("enorm", "hnorm", "fc", "layer") if self.config.layout == "mtp" else ("fc", "layer")

    def target_features(self, features: torch.Tensor) -> torch.Tensor:
        """The drafter's input feature from the target's (the input of its final norm): the same tensor, or in
        the ``vllm`` layout the final norm's output (what vLLM hands an EAGLE-1 drafter)."""
        return self.norm(features) if self.config.layout == "vllm" and self.norm is not None else features

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head reads: ``norm(hidden)`` (``nanospec`` layout, with a norm) or ``hidden`` (``vllm``)."""
        return self.norm(hidden) if self.norm is not None and self.config.layout != "vllm" else hidden

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        w = self.fc.weight
        return KVCache(self.config, max_len, batch, dtype=w.dtype, device=w.device)

    def llama_layer_pairs(self, theirs: Callable[[str], object]) -> list[tuple[nn.Module, object]]:
        """(our layer's module, ``theirs(name)``) for every module with a weight, ``name`` being its name in a
        transformers Llama decoder layer (:data:`LLAMA_LAYER_NAMES`; the ``vllm`` layout has no input norm)."""
        mine = self.layer
        return [(getattr(mine, ours), theirs(name)) for ours, name in LLAMA_LAYER_NAMES.items()
                if hasattr(getattr(mine, ours), "weight")]

    @torch.no_grad()
    def copy_target_layer(self, layer: nn.Module, noise: float = 0.0) -> "EagleDrafter":
        """Stand-in for training: pass the token embedding through ``fc`` and copy a transformers
        Llama decoder ``layer`` of the target (plus Gaussian ``noise`` relative to each weight's scale).
        With the target's first layer, the drafter then approximates a one-layer target closely."""
        h = self.config.hidden_size
        self.fc.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
        if self.fc.bias is not None:
            self.fc.bias.zero_()
        for dst, src in self.llama_layer_pairs(layer.get_submodule):
            dst.weight.copy_(src.weight + noise * src.weight.std() * torch.randn_like(src.weight))
        return self


# ----------------------------------------------------------------------------- drafting
@dataclass
class DraftTree:
    """Drafted candidates of one round, on the device: token, parent candidate (-1: the root), score.

    Scores are cumulative log-probs; -inf marks a candidate that does not exist (fewer active
    tokens than ``top_k``).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor

    def paths(self, num_nodes: int | None = None) -> list[list[int]]:
        """Root-to-leaf token paths of the best ``num_nodes`` candidates (all, if None) and their ancestors."""
        scores = self.scores.float()
        keep = int(torch.isfinite(scores).sum())
        if num_nodes is not None:
            keep = min(keep, num_nodes)
        chosen = set(scores.topk(keep).indices.tolist()) if keep else set()
        tokens, parents = self.tokens.tolist(), self.parents.tolist()
        for node in list(chosen):  # a tie can leave out an ancestor: put it back
            while parents[node] >= 0 and parents[node] not in chosen:
                node = parents[node]
                chosen.add(node)
        inner = {parents[n] for n in chosen}
        paths = []
        for leaf in sorted(chosen - inner):
            path, node = [], leaf
            while node >= 0:
                path.append(tokens[node])
                node = parents[node]
            paths.append(path[::-1])
        return paths


class Choice(NamedTuple):
    """A drafter's ``k`` best tokens at one or more positions, taken inside its forward (``draft_topk``):
    log-probs ``[..., k]`` (descending) and token ids ``[..., k]``. A draft loop that only picks tokens reads
    these instead of ``[V]`` logits."""

    scores: torch.Tensor
    tokens: torch.Tensor


def feed(drafter: Callable, cache: KVCache, tokens: torch.Tensor, features: torch.Tensor, start: int,
         select: int = 0):
    """Run the drafter over committed positions ``start..start+T-1`` (causal); return the root.

    ``tokens [T]`` are x[start+1 ..], ``features [T, H]`` are the target's f[start ..]. Returns the
    logits ``[V]`` and hidden ``[H]`` of the last position: the root of the next draft round. With
    ``select=k`` and a drafter that takes ``draft_topk``, the root's first element is its :class:`Choice`
    of ``k`` (``[k]`` each) instead of the ``[V]`` logits.
    """
    device = cache.k.device
    slots = torch.arange(start, start + tokens.numel(), device=device)
    mask = torch.arange(cache.max_len, device=device) <= slots[:, None]
    convert = getattr(unwrap(drafter), "target_features", None)  # a vLLM-layout drafter reads normed features
    features = convert(features) if convert is not None else features
    keep = {"logits_to_keep": 1} if _takes(drafter, "logits_to_keep") else {}  # only the last position is used
    out, hidden = drafter(tokens.view(1, -1), _fresh(features.unsqueeze(0)), slots.view(1, -1), slots, mask,
                          cache.k, cache.v, **keep, **_selecting(drafter, select))
    return _last(out), hidden[0, -1]


def _selecting(drafter: Callable, k: int) -> dict:
    """The keyword that makes the drafter pick its ``k`` best tokens itself (``{}``: it cannot, or ``k`` is 0)."""
    return {"draft_topk": k} if k and _takes(drafter, "draft_topk") else {}


def _last(out) -> torch.Tensor | Choice:
    """The last position of the first batch row: of a drafter's logits ``[1, T, V]`` or its choice."""
    return Choice(out[0][0, -1], out[1][0, -1]) if isinstance(out, tuple) else out[0, -1]


def _best(root: torch.Tensor | Choice, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-probs [..., k], token ids [..., k])`` of the best ``k`` tokens: from a :class:`Choice` as it is, or
    from ``[..., V]`` logits (a drafter that cannot select itself, or a caller that handed logits)."""
    if isinstance(root, Choice):
        return root.scores[..., :k], root.tokens[..., :k]
    return torch.log_softmax(root.float(), -1).topk(k, dim=-1)


def _takes(drafter: Callable, keyword: str) -> bool:
    """Whether the drafter's forward (a module's, or a plain callable's own) takes ``keyword``: an
    :class:`EagleDrafter` takes ``logits_to_keep`` and ``draft_topk``; a user's callable in the same convention
    may not, and then scores every fed position and hands the loop ``[V]`` logits."""
    if isinstance(drafter, nn.Module):
        return _takes_keyword(type(unwrap(drafter)).forward, keyword)
    return _takes_keyword(drafter if inspect.isfunction(drafter) else type(drafter).__call__, keyword)


@functools.lru_cache(maxsize=None)
def _takes_keyword(function: Callable, keyword: str) -> bool:
    """Once per function and keyword (feed runs every round): does its signature name it?"""
    try:
        return keyword in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy at storage offset 0: views of other tensors (slices, expands) would make
    Dynamo guard on their strides and offsets and recompile the drafter."""
    return x.clone(memory_format=torch.contiguous_format)


def draft_chain(drafter: Callable, cache: KVCache, root_logits, root_hidden, start: int, depth: int) -> DraftTree:
    """``depth`` tokens, each the drafter's argmax after the previous one (``depth - 1`` drafter calls).

    ``root_logits``: the root's ``[V]`` logits or its :class:`Choice`. A drafter that takes ``draft_topk`` picks
    each token itself (top-1 of its compact logits under nanospec: no ``[V]`` row in the loop)."""
    device = cache.k.device
    score, token = (t[0] for t in _best(root_logits, 1))
    tokens, scores = [token], [score]
    hidden = root_hidden
    select = _selecting(drafter, 1)
    for d in range(1, depth):
        slot = torch.tensor([start + d - 1], device=device)
        mask = (torch.arange(cache.max_len, device=device) <= slot)[None]
        out, h = drafter(token.view(1, 1), _fresh(hidden.view(1, 1, -1)), slot.view(1, 1), slot, mask,
                         cache.k, cache.v, **select)
        step, token = (t[0] for t in _best(_last(out), 1))
        score, hidden = score + step, h[0, -1]
        tokens.append(token)
        scores.append(score)
    parents = torch.arange(-1, depth - 1, device=device)
    return DraftTree(torch.stack(tokens), parents, torch.stack(scores))


def draft_tree(drafter: Callable, cache: KVCache, root_logits, root_hidden, start: int, depth: int,
               top_k: int) -> DraftTree:
    """EAGLE-2's dynamic draft tree: ``depth`` levels, ``top_k`` frontier nodes per level.

    Level 1 is the root's ``top_k``; each further level runs the drafter once over the frontier
    (``top_k`` rows, each attending to the committed cache and its own ancestors), scores
    ``top_k x top_k`` children and keeps the best ``top_k``. Candidates: ``top_k + (depth-1) top_k^2``.
    Frontier node i of level d is cached at slot ``start + (d-1) top_k + i``.
    """
    def best_children(logits):
        scores, tokens = _best(logits, top_k)
        return tokens, scores

    return DraftTree(*_grow_tree(drafter, cache, root_logits, root_hidden, start, depth, top_k, best_children,
                                 select=top_k))


def _grow_tree(drafter: Callable, cache: KVCache, root_logits, root_hidden, start: int, depth: int, k: int,
               children: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]], select: int = 0):
    """The frontier expansion of :func:`draft_tree` and :func:`draft_sampled`; returns flat
    ``(tokens, parents, scores)``.

    ``children(logits [n, V])`` gives each row's ``k`` candidates: tokens ``[n, k]`` and their log q
    ``[n, k]`` (-inf: the candidate does not exist); with ``select=k`` (and a drafter that takes ``draft_topk``)
    it gets the drafter's :class:`Choice` ``[n, k]`` instead of the logits. A missing candidate gets the root's
    first token (active) as a stand-in, and a cumulative score of -inf, so it is never kept in the frontier
    ahead of a real one and never verified.
    """
    device = cache.k.device
    tokens, scores = (t[0] for t in children(_rows(root_logits)))
    fallback = tokens[0]
    tokens = torch.where(torch.isneginf(scores), fallback, tokens)
    all_tokens, all_parents, all_scores = [tokens], [torch.full((k,), -1, device=device)], [scores]
    frontier = torch.arange(k, device=device)  # candidate index of each frontier node
    hidden = _fresh(root_hidden.expand(k, -1))  # the hidden each frontier node is conditioned on
    mask = (torch.arange(cache.max_len, device=device) < start).expand(k, -1).clone()
    rows, offset = torch.arange(k, device=device), k
    for d in range(1, depth):
        slots = start + (d - 1) * k + rows
        mask[rows, slots] = True
        positions = torch.full((1, k), start + d - 1, device=device)
        out, h = drafter(tokens.view(1, k), hidden.unsqueeze(0), positions, slots, mask, cache.k, cache.v,
                         **_selecting(drafter, select))
        child_tokens, child_scores = children(Choice(out[0][0], out[1][0]) if isinstance(out, tuple) else out[0])
        child_tokens = torch.where(torch.isneginf(child_scores), fallback, child_tokens)
        cumulative = (scores[:, None] + child_scores).flatten()  # -inf under a missing parent
        all_tokens.append(child_tokens.flatten())
        all_parents.append(frontier.repeat_interleave(k))
        all_scores.append(cumulative)
        scores, best = cumulative.topk(k)
        parent_row = best // k
        tokens, hidden, mask = child_tokens.flatten()[best], h[0][parent_row], mask[parent_row]
        frontier, offset = offset + best, offset + k * k
    return torch.cat(all_tokens), torch.cat(all_parents), torch.cat(all_scores)


def _rows(root: torch.Tensor | Choice) -> torch.Tensor | Choice:
    """The root as a batch of one row (``[1, V]`` logits or a choice of ``[1, k]``)."""
    return Choice(root.scores[None], root.tokens[None]) if isinstance(root, Choice) else root[None]


def drafter_cache(drafter, max_len: int) -> KVCache:
    return unwrap(drafter).new_cache(max_len)


# ----------------------------------------------------------------------------- sampling
# Speculative *sampling*: drafts are drawn from the drafter's (pruned) distribution q and verified
# against the target's p with the rules of nanospec_fx.sampling, so the output follows the target's
# sampling distribution exactly. A tree is verified by recursive rejection sampling: each node's
# children are drawn without replacement from its q and ALL of them are verified, in draw order
# (dropping some by score, as EAGLE-2's greedy reranking does, would bias the output).
@dataclass
class SampledDraft:
    """A sampled draft round, on the device.

    ``tokens``, ``parents`` and ``scores`` (cumulative log q; -inf: the candidate does not exist)
    as in :class:`DraftTree`; ``probs [R, V]`` are the draft distributions the candidates were drawn
    from (row 0: the root's; then one row per expanded node) and ``source[i]`` is candidate ``i``'s
    row. Siblings are stored in draw order.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: torch.Tensor
    probs: torch.Tensor
    source: torch.Tensor

    @cached_property
    def leaf_paths(self) -> list[list[int]]:
        """The candidate nodes from the root to every existing leaf (``[[]]``: no candidate at all)."""
        children = self.children()
        existing = sorted(node for kids in children.values() for node in kids)
        return [self.path_to(node) for node in existing if node not in children] or [[]]

    def path_to(self, node: int) -> list[int]:
        """The candidate nodes from the root down to ``node``."""
        parents, path = self.parents.tolist(), []
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def children(self) -> dict[int, list[int]]:
        """Existing candidates by parent (-1: the root), each list in draw order."""
        exists = torch.isfinite(self.scores).tolist()
        out: dict[int, list[int]] = {}
        for node, parent in enumerate(self.parents.tolist()):
            if exists[node]:
                out.setdefault(parent, []).append(node)
        return out


def draft_sampled(drafter: Callable, cache: KVCache, root_logits, root_hidden, start: int, depth: int, top_k: int,
                  sampler: SpeculativeSampler, generator: torch.Generator | None = None) -> SampledDraft:
    """Sample a draft of ``depth`` levels: ``top_k = 1`` is a chain, ``top_k > 1`` EAGLE-2's tree.

    Every expanded node draws ``top_k`` children without replacement from ``q = sampler.draft_probs
    (its logits)`` (with nanospec, 0 outside the active set, so only active tokens are drawn). The
    ``top_k`` children with the best cumulative log q form the next level's frontier; the choice is
    made before their own children are drawn, so it does not bias verification. Cache slots and
    masks are as in :func:`draft_tree` (``depth - 1`` drafter calls of ``top_k`` rows).
    """
    device, k = cache.k.device, top_k
    probs: list[torch.Tensor] = []

    def drawn_children(logits):
        q = sampler.draft_probs(logits.float())  # [n, V]: one draft distribution per expanded node
        probs.append(q)
        tokens, exists = sampler.draw(q, k, generator)
        return tokens, torch.where(exists, q.gather(-1, tokens).log(), float("-inf"))

    tokens, parents, scores = _grow_tree(drafter, cache, root_logits, root_hidden, start, depth, k, drawn_children)
    rows = torch.arange(k, device=device)
    source = [torch.zeros(k, dtype=torch.long, device=device)]
    source += [(1 + (d - 1) * k + rows).repeat_interleave(k) for d in range(1, depth)]
    return SampledDraft(tokens, parents, scores, torch.cat(probs), torch.cat(source))


def verify_sampled(draft: SampledDraft, target_probs: Callable[[list[int]], torch.Tensor],
                   sampler: SpeculativeSampler,
                   generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """Walk the draft from the root: at each node, recursive rejection over its children.

    ``target_probs(nodes)`` gives p ``[V]`` after the path ending at ``nodes[-1]`` (``[]``: the
    root). Returns ``(accepted candidate nodes, committed tokens)``: the accepted drafts plus one
    token drawn by the target (from a residual, or from p where the accepted path ends).
    """
    children, tokens = draft.children(), draft.tokens.tolist()
    path: list[int] = []
    while True:
        p = target_probs(path)
        kids = children.get(path[-1] if path else -1, [])
        q = draft.probs[int(draft.source[kids[0]])] if kids else p
        index, token = sampler.verify(p, q, torch.tensor([tokens[c] for c in kids], dtype=torch.long), generator)
        if index < 0:
            return path, [tokens[c] for c in path] + [token]
        path.append(kids[index])
