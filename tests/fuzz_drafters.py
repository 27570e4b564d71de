"""Drafters generated from a recipe, for the pass fuzzer (tests/passes/test_pass_fuzzer.py).

A :class:`Recipe` is plain data (its ``repr`` is valid Python), and :class:`FuzzDrafter` builds
an ``nn.Module`` from it: a token lookup (one of :data:`LOOKUPS`) and a tiny body, a head pattern,
and a program on the logits drawn from :data:`CATALOGUE` (post-ops, casts, views, in-place bans,
normalisations and what follows them, consumers, graph breaks). ``recipes()`` draws them.

The oracle is the contract of issue 16, written by the generator, not by the pass: the *chain* is
the run of elementwise ops and column-keeping views from the head's ``[..., V]`` output. Called with
``_mask`` (bool over the head's rows), the drafter sets inactive tokens to -inf exactly where a chain
tensor is read by something outside the chain (a consumer, a reduction, a normalisation, a graph
output); the generator knows those places because it wrote the program. Everything after the chain
is plain eager IEEE arithmetic on the masked tensors (``exp(log_softmax(z))`` is 0 there, ``p * log p``
is NaN). Nothing here imports the pass. ``_record`` receives what each output was computed from, so
that selections can be checked up to ties.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

HEADS = (
    "linear",          # nn.Linear(H, V) (bias drawn)
    "linear_tied",     # nn.Linear whose weight *is* the embedding's Parameter (HF tie_weights)
    "functional_tied",  # F.linear(h, self.embed.weight)
    "matmul_bias",     # h @ self.W.t() + self.b
    "matmul_T",        # torch.matmul(h, self.W.T)
    "einsum",          # torch.einsum("...h,vh->...v", h, self.W)
    "buffer",          # F.linear(h, self.head_buf): the weight is a registered buffer
    "dequant",         # F.linear(h, self.qweight.to(dtype) * self.scale): int8 weight dequantised in the graph
    "matmul_hv",       # h @ self.W (+ self.b): the weight is stored [H, V]
    "linear_hv",       # F.linear(h, self.W.t(), self.b): the same weight, read through a transpose
    "quant_row",       # F.linear(h, self.qweight.to(dtype) * self.qscale_v[:, None]): per-row scale [V] before
    "quant_after",     # F.linear(h, self.qweight.to(dtype)) * self.qscale_v: the scale after the matmul
    "fp8_row",         # as quant_row with a float8_e4m3fn weight
    "param_rownorm",   # nn.Linear behind parametrize: W / W.norm(dim=-1, keepdim=True) (row-wise)
    "param_colnorm",   # nn.Linear behind parametrize: W / W.norm(dim=0, keepdim=True) (mixes rows: dense)
    # -- issue 40 item 6 / issue 45 item 4: heads found by their algebra
    "addmm",           # torch.addmm(self.b, h2d, self.W.t()) on the flattened positions (torch.mm without a bias)
    "addmm_scaled",    # torch.addmm(self.b, h2d, self.W.t(), beta=0.5, alpha=2.0) (without a bias: beta=0 over zeros)
    "baddbmm",         # torch.baddbmm(self.b, h3d, self.W.t().unsqueeze(0).expand(B, -1, -1), alpha=1.5) (bmm without)
    # -- issue 40 item 2: a LoRA delta on the head is one head of one set
    "lora",            # self.lm_head(h) + self.lora_B(self.lora_A(h)) * 0.5 (rank 2; trainable in the grad modes)
    "einsum_wh",       # torch.einsum("vh,...h->...v", self.W, h): the weight first
    "attr_tensor",     # F.linear(h, self.W) with self.W a plain tensor attribute (no Parameter, no buffer)
)

# How the token ids reach the embedding table (issue 16, class 3 and 14).
LOOKUPS = (
    "embedding",        # self.embed(ids)
    "f_embedding",      # F.embedding(ids, W)
    "index",            # W[ids]
    "index_select",     # torch.index_select(W, 0, ids.flatten())
    "index_select_method",  # W.index_select(0, ids.flatten())
    "gather",           # W.gather(0, ids expanded over H)
    "take",             # torch.take(W, ids * H + arange(H))
    "one_hot",          # one_hot(ids) @ W
    "embedding_bag",    # F.embedding_bag(ids[:, None], W, mode="sum")
    "python_ids",       # self.embed(ids) + self.embed(torch.tensor(<Python list>)).sum(0): ids built in forward
    "buffer_ids",       # ids copied into a buffer with copy_, then embedded from the buffer
    "cond",             # the lookup inside torch.cond branches
    "max_norm",         # nn.Embedding(max_norm=1.0): renormalises rows of the (maybe tied) table in place
)
SPECIAL_IDS = (1, 2)  # the Python list of "python_ids"

# Steps of the logits program. Each is a tuple (name, *params) with params plain numbers/strings.
ELEMENTWISE = {  # out-of-place, column j -> column j: the chain continues
    "temperature", "scale", "bias", "scale_vec", "softcap", "cast", "clamp", "masked_fill", "gumbel", "where_ban",
    "scatter_ban", "bias_like",  # bias_like: a [V] bias cast or shaped after the logits (``b.type_as(z)``)
}
MUTATIONS = {  # in place on the current logits (or a view of them): the chain continues
    "div_", "itruediv", "iadd_bias", "imul", "clamp_", "clamp_fn_", "masked_fill_", "setitem", "setitem_view",
    "out_self", "copy_clamp", "nan_to_num_fn", "index_fill_", "scatter_",
    "copy_ban",  # contiguous/reshape/cast of z (z itself or a copy, as its layout allows), scaled and banned, emitted
}
ROW_OPS = {"sub_lse", "sub_max", "sub_global_max"}  # z - z.logsumexp(..), z - z.max(..), z - z.max(): end the chain
NORMALISE = {"to_log_softmax", "to_neg_log_softmax", "to_probs"}  # end the chain, z becomes the result
VIEWS = {  # column-keeping views: the chain continues
    "last", "last_ellipsis", "flatten", "reshape", "view_n", "transpose", "permute", "unsqueeze", "squeeze",
    "contiguous", "mT", "vslice",
}
CONSUMERS = {  # read z, emit an output; z is unchanged
    "topk", "argmax", "max", "sort", "softmax", "log_softmax", "gather_ids", "gather_probe", "multinomial",
    "inverse_cdf", "exp_log_softmax", "neg_log_softmax", "exp_inplace", "logp_clamp_min", "entropy_plogp",
    "entropy_nansum", "entropy_entr", "categorical_entropy", "typical", "eta", "global_max",
}
BREAKS = ("dynamo", "item", "int", "print", "branch", "helper_item", "helper_print", "helper_branch")
OTHER = {"graph_break", "out_new_softcap"}
CATALOGUE = ELEMENTWISE | MUTATIONS | ROW_OPS | NORMALISE | VIEWS | CONSUMERS | OTHER
OUT_STEPS = {"out_self", "out_new_softcap"}  # out= calls: not with autograd

BODY_OPS = ("mlp", "mlp_vocab_width", "clamp_fn_", "tanh_fn_", "out_mul", "counter", "graph_break")
# -- issue 32, items 4-5: functorch transforms Dynamo inlines, and Python calls whose only result is an effect.
TRANSFORM_BODY_OPS = (
    "vmap_mlp",        # the body MLP under torch.vmap over the batch (the head outside: still rewritten)
    "effect_call",     # a Python call in the graph (allow_in_graph, no schema) that writes a tensor the body reads
)
TRANSFORM_LOOKUPS = ("vmap_embedding",)  # the token lookup under torch.vmap: observed through the unbatched ids
TRANSFORM_HEADS = ("linear", "linear_tied", "functional_tied", "matmul_bias", "einsum")  # may run under head_vmap
EXTRA_OUTPUTS = ("hidden", "wide_proj", "router")
# -- several heads (Medusa heads, MTP depths with heads of their own): ``extra_heads`` more nn.Linear(H, V) heads score
# the same hidden state as the head, each output ``z_i / (i + 2)`` returned after the head's outputs. Each is a head
# of its own (its own ActiveVocab); the oracle masks head i's output with ``extra_masks[i]`` (bool over the rows, or
# None where that head runs dense), which the fuzzer sets from head i's state before each eager call.
EXTRA_HEADS = (0, 1, 2)
# -- issue 40 item 6: Medusa heads stacked in one weight. With ``stacked``, the extra heads are ONE parameter
# ``stacked_W`` (``[K, V, H]``, or ``[K, H, V]`` for the ``khv`` spellings; K = max(extra_heads, 2)) applied by that
# spelling (an equation or a form -> (where the output holds K, where it holds V), axes from the end), then
# ``stacked_post``; one head of one set (one state per weight): the oracle masks every head's logits along V by that
# state's set.
STACKED = {
    "bth,kvh->btkv": (-2, -1), "bth,kvh->bktv": (-3, -1), "...h,kvh->...kv": (-2, -1), "khv,bth->btkv": (-2, -1),
    "bth,kvh->btvk": (-1, -2),  # V not last
    "kbth,kvh->kbtv": (-4, -1),  # each head its own hidden state
    "matmul_mT": (-3, -1),       # h.unsqueeze(1) @ W.mT: [B, K, T, V]
    "matmul_khv": (-3, -1),      # h.unsqueeze(1) @ W, W stored [K, H, V]
    "bmm": (-3, -1),             # torch.bmm(hk [K, B*T, H], W.transpose(1, 2)): [K, B*T, V]
}
STACKED_POSTS = ("temperature", "bias", "log_softmax", "softcap", "sum_heads", "argmax")
# -- issues 40 item 2 / 45 item 2, heads that meet: with two extra heads, ``combine`` names an op that combines their
# logits into one output (``COMBINE``: every elementwise binary op kind, ``where``, a gather of one at the other's
# top-k ids, a stack then a reduction across the heads). The oracle reads each head's logits masked by its own set
# (each chain ends at the op), then plain IEEE arithmetic; where the two sets differ only dense (with a warning) or
# one shared set can equal it.
COMBINE = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "mean": lambda a, b: (a + b) / 2,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "fmax": torch.fmax,
    "fmin": torch.fmin,
    "logaddexp": torch.logaddexp,
    "hypot": torch.hypot,
    "atan2": torch.atan2,
    "copysign": torch.copysign,
    "where_greater": lambda a, b: torch.where(a > b, a, b),
    "where_sign": lambda a, b: torch.where(a > 0, b, a),
    "gather_at_topk": lambda a, b: b.gather(-1, a.topk(2).indices),
    "stack_amax": lambda a, b: torch.stack([a, b]).amax(0),
    "stack_mean": lambda a, b: torch.stack([a, b]).mean(0),
}
# -- issue 32, items 1, 2, 8: a second token lookup in one call (the same table with other ids, or another table with
# as many rows), fed ``ids2``; a call that raises after valid ids (``bad_inputs``: one invalid id, last, in ``ids`` or
# ``ids2``: the fuzzer checks that every state is exactly as before it); a pruned head over a draft vocabulary
# (EAGLE-3: ``[R, H]`` head rows, a ``d2t`` buffer, the embedding ``V > R`` target ids), compiled without the option
# ("buffer": dense with a warning) or with ``draft_to_target`` ("option": rewritten, the oracle maps head row i to
# target token ``i + d2t[i]``).
SECOND_LOOKUPS = ("", "same_table", "other_table")
BAD_CALLS = ("", "pad", "past_table")
D2T = ("", "buffer", "option")
D2T_HEADS = ("linear", "matmul_bias", "einsum", "buffer")
# -- issue 40, item 1: several small tables (segment or type embeddings, not the vocabulary) read at one segment id
# computed from the tokens: the transactional observe checks each of their lookups where the ids exist, one check
# inserted next to the previous one, in a graph it is editing.
SMALL_TABLES = (0, 1, 2, 3)

MODES = ("inference", "no_grad", "grad", "enable_grad_inside", "no_grad_forward")
GRAD_MODES = ("grad", "enable_grad_inside")  # outputs carry gradients to the (trainable) body


@dataclasses.dataclass(frozen=True)
class Recipe:
    vocab: int                 # V': the real vocabulary (ids fed are below it)
    hidden: int                # H
    head: str                  # one of HEADS
    head_bias: bool = False
    head_pad: int = 0          # head rows beyond V' (a padded vocabulary; a "vslice" step cuts them)
    embed_pad: int = 0         # embedding rows beyond the head's (untied heads only)
    position: bool = False     # a position embedding (not the vocabulary)
    body: tuple = ("mlp",)     # BODY_OPS, in order
    order: str = "embed_first"  # or "head_first": score the previous hidden state, then embed the ids
    chain: tuple = ()          # steps, see CATALOGUE
    return_logits: bool = True
    extra_outputs: tuple = ()  # EXTRA_OUTPUTS
    dtype: str = "float32"
    mode: str = "inference"    # MODES; "grad": frozen head, trainable body; "enable_grad_inside": the same under an
    #                            outer no_grad with torch.enable_grad() in forward; "no_grad_forward": a
    #                            @torch.no_grad() forward called in grad mode
    autocast: bool = False     # run under torch.autocast("cpu", torch.bfloat16)
    capacity: int = 64
    batch: int = 2
    seq: int = 3
    seq2: int = 3              # sequence length of the second call
    feed_padded_ids: bool = False  # also feed ids in [head rows, embedding rows)
    extra_active: int = 0      # ids observed by hand between the two calls
    n_ban: int = 2             # banned ids used by masked_fill/setitem steps
    seed: int = 0
    lookup: str = "embedding"  # LOOKUPS
    head_break: str = ""       # a graph break (BREAKS) between the chain and the body (head_first) or body and head
    hook: bool = False         # a forward hook on the head module (scales its output); nn.Linear heads only
    draft_steps: int = 0       # >0: a draft loop in forward (embed_first): k heads, each feeding a token back
    draft_feed: str = "argmax"  # "argmax" (the step's argmax) or "input" (ids given as the input "future")
    extra_heads: int = 0       # several heads: more nn.Linear(H, V) heads on the head's input, see EXTRA_HEADS
    combine: str = ""          # COMBINE: the two extra heads' logits meet in one op (one output for both)
    stacked: str = ""          # STACKED: the extra heads are one stacked [K, V, H] weight applied by this spelling
    stacked_post: str = "temperature"  # STACKED_POSTS: what follows the stacked heads (then returned)
    head_vmap: bool = False    # the head projection under torch.vmap over the batch: dense, with one warning
    second_lookup: str = ""    # SECOND_LOOKUPS: a second token lookup of ``ids2`` in the body
    bad_call: str = ""         # BAD_CALLS: after the first call, a call with one invalid id (eager raises)
    bad_at: str = "ids"        # which input holds it: "ids" or "ids2"
    d2t: str = ""              # D2T: the head has ``head_rows`` rows over a draft vocabulary of the embed_rows ids
    small_tables: int = 0      # SMALL_TABLES: small tables (3, 4, ... rows) all read at one segment id ``ids % 3``
    trainable_post: bool = False  # grad modes: the chain's logit_bias and logit_scale (bias, iadd_bias, scale_vec)
    #                            stay trainable: a post-op operand that needs gradients (the head runs dense, warned)

    @property
    def head_rows(self) -> int:
        return self.vocab + self.head_pad

    @property
    def embed_rows(self) -> int:
        return self.head_rows + self.embed_pad


NEG_INF = "-inf"


def _value(v):
    return float("-inf") if v == NEG_INF else float(v)


class RowNorm(nn.Module):
    """A parametrisation whose every output row depends only on the same input row."""

    def forward(self, W):
        return W / W.norm(dim=-1, keepdim=True)


class ColumnNorm(nn.Module):
    """A parametrisation that mixes rows (each column normalised): not row-wise."""

    def forward(self, W):
        return W / W.norm(dim=0, keepdim=True)


def scale_output_hook(module, args, output):
    """A forward hook on the head (module level: a drafter with it stays picklable)."""
    return output * 0.5


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether eager returned a view of ``b`` (the oracle's run only: Dynamo never traces this)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _apply_views(t: torch.Tensor, views: list) -> torch.Tensor:
    """Apply the chain's column-keeping views so far to ``t`` ([B, S, X]), in reshape-safe forms."""
    for v in views:
        if v in ("last", "last_ellipsis"):
            t = t[..., -1, :]
        elif v in ("flatten", "reshape", "view_n"):
            t = t.reshape(-1, t.shape[-1])
        elif v in ("transpose", "permute"):
            t = t.transpose(0, 1)
        elif v == "unsqueeze":
            t = t.unsqueeze(0)
        elif v == "squeeze":
            t = t.squeeze(0)
    return t


def typical_warper(scores: torch.Tensor, mass: float = 0.9) -> torch.Tensor:
    """HF's TypicalLogitsWarper written out (2-D scores, min_tokens_to_keep=1)."""
    normalized = F.log_softmax(scores, dim=-1)
    p = torch.exp(normalized)
    ent = -(normalized * p).nansum(-1, keepdim=True)
    shifted = torch.abs((-normalized) - ent)
    sorted_scores, sorted_indices = torch.sort(shifted, descending=False)
    sorted_logits = scores.gather(-1, sorted_indices)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    last_ind = (cumulative_probs < mass).sum(dim=1)
    last_ind.clamp_(max=sorted_scores.shape[-1] - 1)
    sorted_remove = sorted_scores > sorted_scores.gather(1, last_ind.view(-1, 1))
    sorted_remove[..., :1] = 0
    remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)
    return scores.masked_fill(remove, float("-inf"))


def eta_warper(scores: torch.Tensor, epsilon: float = 0.02) -> torch.Tensor:
    """HF's EtaLogitsWarper written out (2-D scores, min_tokens_to_keep=1)."""
    probabilities = scores.softmax(dim=-1)
    entropy = torch.distributions.Categorical(logits=scores).entropy()
    eps = torch.tensor(epsilon, device=scores.device)
    eta = torch.min(eps, torch.sqrt(eps) * torch.exp(-entropy))[..., None]
    remove = probabilities < eta
    remove = remove & (scores < torch.topk(scores, 1)[0][..., -1, None])
    return scores.masked_fill(remove, float("-inf"))


class FuzzDrafter(nn.Module):
    """An ``nn.Module`` built from a :class:`Recipe`; see the module docstring for ``_mask``/``_record``."""

    def __init__(self, recipe: Recipe):
        super().__init__()
        r = self.recipe = recipe
        g = torch.Generator().manual_seed(r.seed)
        H, Vh = r.hidden, r.head_rows

        def randn(*shape, scale=1.0):
            return torch.randn(*shape, generator=g) * scale

        self.embed = nn.Embedding(r.embed_rows, H, max_norm=1.0 if r.lookup == "max_norm" else None)
        with torch.no_grad():
            self.embed.weight.copy_(randn(r.embed_rows, H))
        self.special = list(SPECIAL_IDS)
        if r.lookup == "buffer_ids":
            self.register_buffer("id_buf", torch.zeros(4, 8, dtype=torch.int64), persistent=False)
        if r.position:
            self.pos = nn.Embedding(16, H)
        self.small = nn.ModuleList(nn.Embedding(3 + i, H) for i in range(r.small_tables))
        with torch.no_grad():
            for table in self.small:
                table.weight.copy_(randn(*table.weight.shape, scale=0.5))
        if r.second_lookup == "other_table":
            self.embed2 = nn.Embedding(r.embed_rows, H)
            with torch.no_grad():
                self.embed2.weight.copy_(randn(r.embed_rows, H))
        if r.d2t:  # EAGLE-3: head row i predicts target id targets[i] = i + d2t[i] (a sorted draft vocabulary)
            targets = torch.randperm(r.embed_rows, generator=g)[:Vh].sort().values
            self.register_buffer("d2t", targets - torch.arange(Vh))
        width = Vh if "mlp_vocab_width" in r.body else 2 * H
        self.up = nn.Linear(H, width)
        self.down = nn.Linear(width, H)
        if r.order == "head_first":
            self.pre = nn.Linear(H, H)
        w = randn(Vh, H, scale=H**-0.5 * 2)
        b = randn(Vh) if r.head_bias else None
        if r.head == "lora":
            self.lora_A = nn.Linear(H, 2, bias=False)
            self.lora_B = nn.Linear(2, Vh, bias=False)
            with torch.no_grad():
                self.lora_A.weight.copy_(randn(2, H, scale=H**-0.5))
                self.lora_B.weight.copy_(randn(Vh, 2))
        if r.head in ("linear", "lora"):
            self.lm_head = nn.Linear(H, Vh, bias=r.head_bias)
            with torch.no_grad():
                self.lm_head.weight.copy_(w)
                if b is not None:
                    self.lm_head.bias.copy_(b)
        elif r.head == "linear_tied":
            self.lm_head = nn.Linear(H, Vh, bias=r.head_bias)
            self.lm_head.weight = self.embed.weight
            if b is not None:
                with torch.no_grad():
                    self.lm_head.bias.copy_(b)
        elif r.head in ("matmul_bias", "matmul_T", "einsum", "addmm", "einsum_wh", "addmm_scaled", "baddbmm"):
            self.W = nn.Parameter(w)
            self.b = nn.Parameter(b) if b is not None else None
        elif r.head == "attr_tensor":
            self.W = w
        elif r.head == "buffer":
            self.register_buffer("head_buf", w)
        elif r.head == "dequant":
            scale = w.abs().amax(1, keepdim=True) / 127
            self.register_buffer("qweight", torch.round(w / scale).to(torch.int8))
            self.register_buffer("qscale", scale)
        elif r.head in ("matmul_hv", "linear_hv"):
            self.W = nn.Parameter(w.t().contiguous())
            self.b = nn.Parameter(b) if b is not None else None
        elif r.head in ("quant_row", "quant_after", "fp8_row"):
            scale = w.abs().amax(1) / 127
            self.register_buffer("qweight", torch.round(w / scale[:, None]).to(torch.int8))
            self.register_buffer("qscale_v", scale)
            self.b = nn.Parameter(b) if b is not None else None
        elif r.head in ("param_rownorm", "param_colnorm"):
            self.lm_head = nn.Linear(H, Vh, bias=r.head_bias)
            with torch.no_grad():
                self.lm_head.weight.copy_(w)
                if b is not None:
                    self.lm_head.bias.copy_(b)
            torch.nn.utils.parametrize.register_parametrization(
                self.lm_head, "weight", RowNorm() if r.head == "param_rownorm" else ColumnNorm())
        self.extra_heads = nn.ModuleList(nn.Linear(H, Vh, bias=False) for _ in range(0 if r.stacked else r.extra_heads))
        with torch.no_grad():
            for head in self.extra_heads:
                head.weight.copy_(randn(Vh, H, scale=H**-0.5 * 2))
        if r.stacked:
            k = max(r.extra_heads, 2)
            w3 = randn(k, Vh, H, scale=H**-0.5 * 2)
            self.stacked_W = nn.Parameter(w3.transpose(1, 2).contiguous() if "khv" in r.stacked else w3)
            self.stacked_b = nn.Parameter(randn(k, Vh))
            self.stacked_mix = nn.Linear(H, k * H)  # per-head hidden states, for the spellings that take them
        self.extra_masks: list | None = None  # per extra head, set by the fuzzer before an eager oracle call
        if r.hook and r.head in ("linear", "linear_tied"):
            self.lm_head.register_forward_hook(scale_output_hook)
        if "wide_proj" in r.extra_outputs:
            self.wide = nn.Linear(H, Vh + 7, bias=False)  # wider than the vocabulary, returned: not the head
        if "router" in r.extra_outputs:
            self.router = nn.Linear(H, 4, bias=False)
        self.logit_bias = nn.Parameter(randn(Vh))
        scale = 0.5 + torch.rand(Vh, generator=g)
        if r.trainable_post:
            self.logit_scale = nn.Parameter(scale)
        else:
            self.register_buffer("logit_scale", scale)
        # Banned ids: tokens the first call feeds (so they are active: a lost ban shows) and one random token.
        fed = make_inputs(r, 0)["ids"].flatten()
        fed = fed[fed < r.vocab].unique()
        # At least one fed token stays unbanned: with every active token at -inf, sampling has nothing to draw.
        n_fed_banned = min(r.n_ban, fed.numel() - 1)
        order = torch.randperm(fed.numel(), generator=g)
        extra = torch.randint(0, r.vocab, (1,), generator=g)
        extra = extra[~torch.isin(extra, fed[order[n_fed_banned:]])]  # never the fed tokens left unbanned
        ban = torch.cat([fed[order[:n_fed_banned]], extra]).unique()
        self.register_buffer("ban_ids", ban)
        self.register_buffer("ban_mask", torch.zeros(Vh, dtype=torch.bool).index_fill_(0, ban, True))
        self.register_buffer("probe", torch.randint(0, r.vocab, (5,), generator=g))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.to(DTYPES[r.dtype])  # floating tensors only: the int8 weight, ids and masks keep their dtype
        if r.head == "attr_tensor":  # a plain attribute: Module.to() does not see it
            self.W = self.W.to(DTYPES[r.dtype])
        if r.head == "fp8_row":  # float8 is floating: stored after the cast of the other tensors
            self.qweight = self.qweight.to(torch.float8_e4m3fn)
        if r.mode in GRAD_MODES:  # EAGLE training: the head (and a tied embedding) frozen, the body trainable
            for name, p in self.named_parameters():
                if name.startswith("logit_") and r.trainable_post:
                    continue
                if (name.startswith(("lm_head", "W", "b", "logit_bias", "extra_heads", "stacked_W", "stacked_b"))
                        or (name.startswith("embed") and "tied" in r.head)):
                    p.requires_grad_(False)
        self.eval()

    # ----------------------------------------------------------------- pieces
    def head_weight(self) -> torch.Tensor | None:
        r = self.recipe
        if r.head in ("linear", "linear_tied", "lora"):
            return self.lm_head.weight
        if r.head == "functional_tied":
            return self.embed.weight
        if r.head in ("matmul_bias", "matmul_T", "einsum", "matmul_hv", "linear_hv", "addmm", "einsum_wh", "addmm_scaled",
                      "baddbmm", "attr_tensor"):
            return self.W
        if r.head == "buffer":
            return self.head_buf
        if r.head in ("dequant", "quant_row", "quant_after", "fp8_row"):
            return self.qweight
        if r.head in ("param_rownorm", "param_colnorm"):
            return self.lm_head.parametrizations.weight.original
        return None

    def draft_targets(self) -> torch.Tensor:
        """The target id of each head row (``d2t`` recipes)."""
        return torch.arange(self.d2t.numel()) + self.d2t

    def fed_ids(self, inputs: dict, outputs=None) -> torch.Tensor:
        """Every token id one call embeds (the contract's fed ids), from its inputs and outputs."""
        r = self.recipe
        parts = [inputs["ids"].flatten()] + ([inputs["ids2"].flatten()] if "ids2" in inputs else [])
        if r.lookup == "python_ids":
            parts.append(torch.tensor(self.special))
        if r.draft_steps and outputs is not None:
            parts.append(self._target_ids(outputs[0] if isinstance(outputs, tuple) else outputs).flatten())
        return torch.cat(parts)

    def _target_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """A draft loop's tokens as the ids it feeds back: head rows over a draft vocabulary are mapped to their target
        ids (``tok + d2t[tok]``, as EAGLE-3 does before embedding them; feeding a head row as a target id would
        activate rows that earlier steps of the call did not see, which the fuzzer's end-of-call oracle cannot
        follow); token ids otherwise."""
        return tokens + self.d2t[tokens] if self.recipe.d2t else tokens

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        r = self.recipe
        if r.head in ("linear", "linear_tied"):
            return self.lm_head(h)
        if r.head == "lora":
            return self.lm_head(h) + self.lora_B(self.lora_A(h)) * 0.5
        if r.head == "functional_tied":
            return F.linear(h, self.embed.weight)
        if r.head == "matmul_bias":
            z = h @ self.W.t()
            return z + self.b if self.b is not None else z
        if r.head == "matmul_T":
            z = torch.matmul(h, self.W.T)
            return z + self.b if self.b is not None else z
        if r.head == "einsum":
            z = torch.einsum("...h,vh->...v", h, self.W)
            return z + self.b if self.b is not None else z
        if r.head == "buffer":
            return F.linear(h, self.head_buf)
        if r.head == "addmm":
            flat = h.reshape(-1, h.shape[-1])
            z = torch.addmm(self.b, flat, self.W.t()) if self.b is not None else torch.mm(flat, self.W.t())
            return z.view(*h.shape[:-1], z.shape[-1])
        if r.head == "addmm_scaled":
            flat = h.reshape(-1, h.shape[-1])
            bias = self.b if self.b is not None else flat.new_zeros(())
            z = torch.addmm(bias, flat, self.W.t(), beta=0.5 if self.b is not None else 0, alpha=2.0)
            return z.view(*h.shape[:-1], z.shape[-1])
        if r.head == "baddbmm":
            h3 = h if h.dim() == 3 else h.reshape(1, -1, h.shape[-1])
            w3 = self.W.t().unsqueeze(0).expand(h3.shape[0], -1, -1)
            z = torch.baddbmm(self.b, h3, w3, alpha=1.5) if self.b is not None else torch.bmm(h3, w3)
            return z.view(*h.shape[:-1], z.shape[-1])
        if r.head == "einsum_wh":
            z = torch.einsum("vh,...h->...v", self.W, h)
            return z + self.b if self.b is not None else z
        if r.head == "attr_tensor":
            return F.linear(h, self.W)
        if r.head == "matmul_hv":
            z = h @ self.W
            return z + self.b if self.b is not None else z
        if r.head == "linear_hv":
            return F.linear(h, self.W.t(), self.b)
        if r.head in ("quant_row", "fp8_row"):
            return F.linear(h, self.qweight.to(h.dtype) * self.qscale_v[:, None].to(h.dtype), self.b)
        if r.head == "quant_after":
            z = F.linear(h, self.qweight.to(h.dtype)) * self.qscale_v.to(h.dtype)
            return z + self.b if self.b is not None else z
        if r.head in ("param_rownorm", "param_colnorm"):
            return self.lm_head(h)
        return F.linear(h, self.qweight.to(h.dtype) * self.qscale.to(h.dtype))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        kind, W = self.recipe.lookup, self.embed.weight
        if kind in ("embedding", "max_norm"):
            return self.embed(ids)
        if kind == "vmap_embedding":
            return torch.vmap(lambda i: self.embed(i))(ids)  # (vmap of the module itself breaks the graph)
        if kind == "f_embedding":
            return F.embedding(ids, W)
        if kind == "index":
            return W[ids]
        if kind == "index_select":
            return torch.index_select(W, 0, ids.reshape(-1)).view(*ids.shape, W.shape[1])
        if kind == "index_select_method":
            return W.index_select(0, ids.reshape(-1)).view(*ids.shape, W.shape[1])
        if kind == "gather":
            return W.gather(0, ids.reshape(-1, 1).expand(-1, W.shape[1])).view(*ids.shape, W.shape[1])
        if kind == "take":
            return torch.take(W, ids.unsqueeze(-1) * W.shape[1] + torch.arange(W.shape[1], device=ids.device))
        if kind == "one_hot":
            return F.one_hot(ids, W.shape[0]).to(W.dtype) @ W
        if kind == "embedding_bag":
            return F.embedding_bag(ids.reshape(-1, 1), W, mode="sum").view(*ids.shape, W.shape[1])
        if kind == "python_ids":
            return self.embed(ids) + self.embed(torch.tensor(self.special, device=ids.device)).sum(0)
        if kind == "buffer_ids":
            buf = self.id_buf[: ids.shape[0], : ids.shape[1]]
            buf.copy_(ids)
            return self.embed(buf)
        if kind == "cond":
            return torch.cond(ids.sum() >= 0, _lookup_true, _lookup_false, (ids, W))
        raise ValueError(f"unknown lookup {kind!r}")

    def _body(self, ids: torch.Tensor, ids2: torch.Tensor | None = None) -> torch.Tensor:
        r = self.recipe
        h = self._lookup(ids)
        if r.second_lookup:
            table = self.embed2 if r.second_lookup == "other_table" else self.embed
            h = h + table(ids2).mean(-2, keepdim=True)
        if r.position:
            h = h + self.pos(torch.arange(ids.shape[-1], device=ids.device))
        if r.small_tables:
            segment = ids % 3
            for table in self.small:
                h = h + table(segment)
        for op in r.body:
            if op in ("mlp", "mlp_vocab_width"):
                h = h + self.down(F.silu(self.up(h)))
            elif op == "clamp_fn_":
                h = h * 1.0
                torch.clamp_(h, -0.5, 0.5)  # function form, result unused: must not be eliminated
            elif op == "tanh_fn_":
                h = h * 2.0
                torch.tanh_(h)
            elif op == "out_mul":
                buf = torch.empty_like(h)
                torch.mul(h, 0.5, out=buf)  # out=, result unused
                h = buf
            elif op == "counter":
                self.calls.add_(1)  # a side effect on module state
            elif op == "vmap_mlp":
                h = torch.vmap(lambda x: x + self.down(F.silu(self.up(x))))(h)
            elif op == "effect_call":
                scale = torch.ones_like(h[..., :1])
                _halve_into(scale)  # result unused: eliminating the call leaves the scale at 1
                h = h * scale
            elif op == "graph_break":
                torch._dynamo.graph_break()
        return h

    def _break(self, kind: str, z: torch.Tensor) -> None:
        """A graph break of ``kind`` that reads ``z`` (already masked by the caller where the contract says so)."""
        if kind.startswith("helper_"):
            return self._break_helper(kind[len("helper_"):], z)
        if kind == "dynamo":
            torch._dynamo.graph_break()
        elif kind == "item":
            if torch.softmax(z.float(), -1).amax().item() > 2.0:  # after probabilities; never true
                raise AssertionError("a probability above 2")
        elif kind == "int":
            if int(z.float().argmax()) < 0:
                raise AssertionError("a negative index")
        elif kind == "print":
            print("", end="")
        elif kind == "branch":
            if bool(z.float().amax() > 1e30):
                raise AssertionError("a huge logit")

    def _break_helper(self, kind: str, z: torch.Tensor) -> None:
        self._break(kind, z)

    # ----------------------------------------------------------------- forward
    def forward(self, ids, prev_hidden=None, noise=None, future=None, ids2=None, prefill=False, _mask=None,
                _record=None):
        r = self.recipe
        # one plain context manager: Dynamo cannot trace contextlib.ExitStack, and a graph break inside its `with`
        # made it skip the whole forward (every such case ran eager: dense, never testing the rewrite)
        grad = (torch.enable_grad() if r.mode == "enable_grad_inside" else torch.no_grad()
                if r.mode == "no_grad_forward" else contextlib.nullcontext())
        with grad:
            if prefill:  # a prefill call: embeds the prompt, scores nothing
                return self._body(ids, ids2)
            if r.draft_steps:
                return self._draft_loop(ids, ids2, future, _mask, _record)
            return self._forward(ids, ids2, prev_hidden, noise, _mask, _record)

    def _masker(self, mask):
        def read(t):  # a chain tensor read by something outside the chain: -inf at inactive tokens
            return t if mask is None else t.masked_fill(~mask[: t.shape[-1]], float("-inf"))
        return read

    def _draft_loop(self, ids, ids2, future, mask, record):
        r = self.recipe
        read = self._masker(mask)
        x = self._body(ids, ids2)[:, -1:]
        tokens, z = [], None
        for i in range(r.draft_steps):
            z = read(self._head(x) / 0.7)  # chain: temperature; read by argmax and by the output
            tok = z.argmax(-1) if r.draft_feed == "argmax" else future[:, i: i + 1]
            tokens.append(tok)
            x = x + self._lookup(self._target_ids(tok))
        if record is not None:
            record += [("values", None, None), ("values", None, None)]
        return torch.cat(tokens, 1), z

    def _forward(self, ids, ids2, prev_hidden, noise, mask, record):
        r = self.recipe
        outputs: list = []
        read = self._masker(mask)
        if r.order == "head_first":
            x = self.pre(prev_hidden)
            z = self._head(x)
            z, in_chain = self._chain(z, ids, noise, mask, record, outputs)
            self._extra_heads(x, outputs, record)
            if r.head_break:
                self._break(r.head_break, read(z) if in_chain else z)
            h = self._body(ids, ids2)
        else:
            h = self._body(ids, ids2)
            if r.head_break:
                self._break(r.head_break, h)
            z = torch.vmap(self._head)(h) if r.head_vmap else self._head(h)
            self._chain(z, ids, noise, mask, record, outputs)
            self._extra_heads(h, outputs, record)
        for extra in r.extra_outputs:
            if extra == "hidden":
                out = h
            elif extra == "wide_proj":
                out = self.wide(h)
            else:
                out = self.router(h)
            outputs.append(out)
            if record is not None:
                record.append(("values", None, None))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _stacked(self, h):
        """The stacked heads' logits (see STACKED)."""
        r, W = self.recipe, self.stacked_W
        k = W.shape[0]
        if r.stacked == "matmul_mT":
            return h.unsqueeze(1) @ W.mT
        if r.stacked == "matmul_khv":
            return h.unsqueeze(1) @ W
        if r.stacked == "bmm":
            hk = self.stacked_mix(h).reshape(-1, k, h.shape[-1]).transpose(0, 1)
            return torch.bmm(hk, W.transpose(1, 2))
        if r.stacked.startswith("kbth"):
            hk = self.stacked_mix(h).unflatten(-1, (k, h.shape[-1])).movedim(-2, 0)
            return torch.einsum(r.stacked, hk, W)
        if r.stacked.startswith("khv"):
            return torch.einsum(r.stacked, W, h)
        return torch.einsum(r.stacked, h, W)

    def _stacked_block(self, h, outputs, record):
        """The stacked heads, masked along V by the one set of their weight (``extra_masks[0]``), then the post-op."""
        r = self.recipe
        mask = self.extra_masks[0] if self.extra_masks is not None else None
        z = self._stacked(h)
        k_axis, axis = STACKED[r.stacked]

        def along(t, at):  # ``t`` [K, V] / [V] laid out along z's axes ``at`` (from the end), 1 elsewhere
            shape = [1] * z.dim()
            for size, a in zip(t.shape, at):
                shape[z.dim() + a] = size
            return t.reshape(shape)

        if r.stacked_post == "bias":  # a [K, V] bias laid out along z's K and V axes
            b = self.stacked_b if k_axis < axis else self.stacked_b.t()
            z = z + along(b, sorted((k_axis, axis)))
        z = z / 0.7

        def masked(t):
            return t if mask is None else t.masked_fill(~along(mask[: t.shape[axis]], (axis,)), float("-inf"))

        kind, x = "values", None
        if r.stacked_post == "log_softmax":
            out = torch.log_softmax(masked(z), dim=axis)
        elif r.stacked_post == "softcap":
            out = masked(2.0 * torch.tanh(z / 2.0))
        elif r.stacked_post == "sum_heads":  # every head's logits summed: one set, exact on it
            out = masked(z).sum(dim=k_axis)
        elif r.stacked_post == "argmax":
            x = masked(z).movedim(axis, -1)
            out, kind = z.movedim(axis, -1).argmax(-1), "argmax"
        else:
            out = masked(z)
        outputs.append(out)
        if record is not None:
            record.append((kind, None if x is None else x.detach().clone(), None))

    def _extra_heads(self, h, outputs, record):
        """The several-heads block: each extra head's logits, masked by its own set (see EXTRA_HEADS); with
        ``combine``, the first two meet in one op (see COMBINE); with ``stacked``, one stacked weight."""
        if self.recipe.stacked:
            return self._stacked_block(h, outputs, record)
        logits = []
        for i, head in enumerate(self.extra_heads):
            mask = self.extra_masks[i] if self.extra_masks is not None else None
            logits.append(self._masker(mask)(head(h) / (i + 2)))
        if self.recipe.combine and len(logits) > 1:
            logits = [COMBINE[self.recipe.combine](logits[0], logits[1])] + logits[2:]
        for z in logits:
            outputs.append(z)
            if record is not None:
                record.append(("values", None, None))

    def _chain(self, z, ids, noise, mask, record, outputs):
        """Run the recipe's steps on the head output ``z``; returns (the last z, whether it is still in the chain)."""
        r = self.recipe
        views: list = []  # the column-keeping views applied so far (to lay out noise and ids like z)
        in_chain = True
        m = mask
        masked = self._masker(m)

        def read(t):  # outside the chain, the chain's tensor is read masked; after the chain, as it is
            return masked(t) if in_chain else t

        late: list = []  # outputs that alias a chain value: masked when the chain ends (see copy_ban)

        def emit(kind, out, x=None, params=None):
            outputs.append(out)
            if record is not None:
                # a copy: later in-place steps must not change what the consumer read
                record.append((kind, None if x is None else x.detach().clone(), params))

        for step in r.chain:
            name, p = step[0], step[1:]
            w = z.shape[-1]
            # -- elementwise and in place: the chain (if not ended) continues
            if name == "temperature":
                z = z / p[0]
            elif name == "scale":
                z = z * p[0]
            elif name == "bias":
                z = z + self.logit_bias[:w]
            elif name == "scale_vec":
                z = z * self.logit_scale[:w]
            elif name == "softcap":
                z = p[0] * torch.tanh(z / p[0])
            elif name == "cast":
                z = z.to(DTYPES[p[0]])
            elif name == "clamp":
                z = torch.clamp(z, min=p[0])
            elif name == "masked_fill":
                z = z.masked_fill(self.ban_mask[:w], _value(p[0]))
            elif name == "where_ban":
                z = torch.where(self.ban_mask[:w], torch.full_like(z, _value(p[0])), z)
            elif name == "scatter_ban":
                z = z.scatter(-1, self.ban_ids.expand(*z.shape[:-1], -1), _value(p[0]))
            elif name == "bias_like":
                b = self.logit_bias[:w]
                z = z + (b.type_as(z) if p[0] == "type_as" else b.to(z) if p[0] == "to" else b.expand_as(z))
            elif name == "gumbel":
                z = z + _apply_views(noise[..., :w], views).to(z.dtype)
            elif name == "div_":
                z.div_(p[0])
            elif name == "itruediv":
                z /= p[0]
            elif name == "iadd_bias":
                z += self.logit_bias[:w]
            elif name == "imul":
                z *= p[0]
            elif name == "clamp_":
                z.clamp_(min=p[0])
            elif name == "clamp_fn_":
                torch.clamp_(z, min=p[0])
            elif name == "masked_fill_":
                z.masked_fill_(self.ban_mask[:w], _value(p[0]))
            elif name == "setitem":
                z[..., self.ban_ids] = _value(p[0])
            elif name == "setitem_view":
                v = z[-1:]  # a view of the last row (batch or position)
                v[..., self.ban_ids] = _value(p[0])
            elif name == "index_fill_":
                z.index_fill_(-1, self.ban_ids, _value(p[0]))
            elif name == "scatter_":
                z.scatter_(-1, self.ban_ids.expand(*z.shape[:-1], -1), _value(p[0]))
            elif name == "out_self":
                torch.div(z, p[0], out=z)
            elif name == "out_new_softcap":
                buf = torch.empty_like(z)
                torch.tanh(z / p[0], out=buf)
                z = buf * p[0]
            elif name == "copy_clamp":
                z.copy_(torch.clamp(z, min=p[0]))
            elif name == "nan_to_num_fn":
                torch.nan_to_num_(z, neginf=p[0])
            elif name == "copy_ban":  # z goes on as it is (written too where the op returned z itself)
                c = {"contiguous": z.contiguous, "reshape": lambda: z.reshape(-1, w), "float": z.float,
                     "to_copy": lambda: z.to(z.dtype, copy=True)}[p[0]]()
                c.mul_(0.5)
                c[..., self.ban_ids] = _value(p[1])
                if mask is not None and in_chain and _same_storage(c, z):
                    # eager returned z itself: the output is z, and the chain's later steps write it too; the
                    # oracle masks what it holds when the chain ends (a masked copy now would miss those writes)
                    emit("values", c)
                    late.append(len(outputs) - 1)
                else:
                    emit("values", read(c))
            # -- column-keeping views: the chain continues
            elif name in ("last", "last_ellipsis", "flatten", "reshape", "view_n", "transpose", "permute", "unsqueeze",
                          "squeeze"):
                if name == "last":
                    z = z[:, -1]
                elif name == "last_ellipsis":
                    z = z[..., -1, :]
                elif name == "flatten":
                    z = z.flatten(0, -2)
                elif name == "reshape":
                    z = z.reshape(-1, z.shape[-1])
                elif name == "view_n":
                    z = z.view(z.shape[:-1].numel(), -1)
                elif name == "transpose":
                    z = z.transpose(0, 1)
                elif name == "permute":
                    z = z.permute(1, 0, 2)
                elif name == "unsqueeze":
                    z = z.unsqueeze(0)
                else:
                    z = z.squeeze(0)
                views.append(name)
            elif name == "contiguous":
                z = z.contiguous()
            elif name == "mT":  # transposed, one scalar elementwise op, transposed back
                z = z.mT
                z = p[1] * torch.tanh(z / p[1]) if p[0] == "softcap" else z * p[1]
                z = z.mT
            elif name == "vslice":
                z = z[..., : r.vocab]
            # -- graph breaks: not ops of the program; a break that reads z reads it from outside the chain
            elif name == "graph_break":
                self._break(p[0] if p else "dynamo", read(z))
            # -- the end of the chain: z becomes a normalised tensor
            elif name in ROW_OPS | NORMALISE:
                z = read(z)
                if name == "sub_lse":
                    z = z - torch.logsumexp(z.float(), dim=-1, keepdim=True).to(z.dtype)
                elif name == "sub_max":
                    z = z - z.max(dim=-1, keepdim=True).values
                elif name == "sub_global_max":
                    z = z - z.max()
                elif name == "to_log_softmax":
                    z = F.log_softmax(z.float(), dim=-1)
                elif name == "to_neg_log_softmax":
                    z = -F.log_softmax(z.float(), dim=-1)
                else:
                    z = torch.softmax(z.float(), dim=-1)
                in_chain = False
            # -- consumers: read z (masked while in the chain), emit an output
            elif name in ("topk", "argmax", "max", "sort", "multinomial", "inverse_cdf"):
                x = read(z)
                via = p[-1]
                x = x if via == "none" else (torch.softmax(x.float(), -1) if via == "softmax"
                                             else torch.log_softmax(x.float(), -1))
                if name == "topk":
                    k, largest = p[0], p[1]
                    emit("topk", tuple(torch.topk(x, k, dim=-1, largest=largest)), x, (k, largest))
                elif name == "argmax":
                    emit("argmax", x.argmax(dim=-1), x, None)
                elif name == "max":
                    emit("max", tuple(x.max(dim=-1)), x, None)
                elif name == "sort":
                    emit("sort", tuple(torch.sort(x, dim=-1, descending=p[0])), x, p[0])
                else:
                    probs = (x if via == "softmax" else torch.softmax(x.float(), -1)).reshape(-1, x.shape[-1])
                    if name == "multinomial":
                        emit("sample", torch.multinomial(probs, 1), probs, None)
                    else:  # inverse-CDF sampling
                        cdf = probs.cumsum(-1)
                        u = torch.rand(cdf.shape[0], 1, device=cdf.device) * cdf[:, -1:]
                        emit("sample", torch.searchsorted(cdf, u).clamp(max=cdf.shape[-1] - 1), probs, None)
            elif name in CONSUMERS:
                x = read(z)
                if name == "softmax":
                    out = torch.softmax(x.float(), dim=-1)
                elif name == "log_softmax":
                    out = F.log_softmax(x, dim=-1)
                elif name == "gather_ids":
                    out = x.gather(-1, _apply_views(ids.unsqueeze(-1), views))
                elif name == "gather_probe":
                    out = x.gather(-1, self.probe.expand(*x.shape[:-1], self.probe.numel()))
                elif name == "exp_log_softmax":
                    out = torch.exp(F.log_softmax(x.float(), dim=-1))
                elif name == "neg_log_softmax":
                    out = -F.log_softmax(x.float(), dim=-1)
                elif name == "exp_inplace":
                    out = F.log_softmax(x.float(), dim=-1)
                    out.exp_()
                elif name == "logp_clamp_min":
                    out = F.log_softmax(x.float(), dim=-1).clamp(min=torch.finfo(torch.float32).min)
                elif name in ("entropy_plogp", "entropy_nansum"):
                    lp = F.log_softmax(x.float(), dim=-1)
                    plogp = lp.exp() * lp
                    out = -(plogp.sum(-1) if name == "entropy_plogp" else plogp.nansum(-1))
                elif name == "entropy_entr":
                    out = torch.special.entr(torch.softmax(x.float(), dim=-1)).sum(-1)
                elif name == "categorical_entropy":
                    out = torch.distributions.Categorical(logits=x.float()).entropy()
                elif name == "typical":
                    out = typical_warper(x.float().reshape(-1, x.shape[-1]))
                elif name == "eta":
                    out = eta_warper(x.float().reshape(-1, x.shape[-1]))
                elif name == "global_max":  # a reduction over every axis (``aten::max`` has a pointwise overload)
                    out = x.max()
                else:
                    raise ValueError(f"unknown step {name!r}")
                emit("values", out)
            else:
                raise ValueError(f"unknown step {name!r}")
        for i in late:
            outputs[i] = masked(outputs[i])
        if r.return_logits or not outputs:
            outputs.insert(0, read(z))  # a graph output reads the chain from outside
            if record is not None:
                record.insert(0, ("values", None, None))
        return z, in_chain


@torch._dynamo.allow_in_graph
def _halve_into(buf: torch.Tensor) -> None:
    """Sets ``buf`` to 0.5: a call Dynamo keeps as one node with no schema, whose result nothing uses."""
    buf.fill_(0.5)


def _lookup_true(ids, W):
    return F.embedding(ids, W)


def _lookup_false(ids, W):
    return F.embedding(ids, W) * 1.0


def compute_dtype(recipe: Recipe) -> torch.dtype:
    """The least precise dtype the logits pass through (it sets the comparison tolerance)."""
    dtypes = [DTYPES[recipe.dtype]] + [DTYPES[s[1]] for s in recipe.chain if s[0] == "cast"]
    if recipe.autocast:
        dtypes.append(torch.bfloat16)
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def make_inputs(recipe: Recipe, call: int) -> dict:
    """Inputs of call ``call`` (0, 1, ...): ids (and the previous hidden state, Gumbel noise, future ids)."""
    g = torch.Generator().manual_seed(recipe.seed * 7 + call + 1)
    seq = recipe.seq if call == 0 else recipe.seq2
    shape = (recipe.batch, seq)
    ids = torch.randint(0, recipe.vocab, shape, generator=g)
    if recipe.feed_padded_ids and recipe.embed_pad:
        ids[0, 0] = recipe.head_rows + int(torch.randint(0, recipe.embed_pad, (1,), generator=g))
    dtype = DTYPES[recipe.dtype]
    inputs = {"ids": ids}
    if recipe.order == "head_first":
        inputs["prev_hidden"] = torch.randn(*shape, recipe.hidden, generator=g).to(dtype)
    if any(s[0] == "gumbel" for s in recipe.chain):
        u = torch.rand(*shape, recipe.head_rows, generator=g).clamp(1e-6, 1 - 1e-6)
        inputs["noise"] = -torch.log(-torch.log(u))
    if recipe.draft_steps and recipe.draft_feed == "input":
        inputs["future"] = torch.randint(0, recipe.vocab, (recipe.batch, recipe.draft_steps), generator=g)
    if recipe.second_lookup:
        inputs["ids2"] = torch.randint(0, recipe.vocab, (recipe.batch, 2), generator=g)
    return inputs


def bad_inputs(recipe: Recipe) -> dict:
    """The first call's inputs with the last id of ``bad_at`` replaced by one no lookup of it can read: a ``-1`` pad
    (``-embed_rows - 1`` for ``W[ids]``, which reads ``W[-1]``) or an id past the table."""
    inputs = make_inputs(recipe, 0)
    key = recipe.bad_at if recipe.second_lookup else "ids"
    bad = inputs[key].clone()
    if recipe.bad_call == "pad":
        bad.view(-1)[-1] = -recipe.embed_rows - 1 if recipe.lookup == "index" and key == "ids" else -1
    else:
        bad.view(-1)[-1] = recipe.embed_rows + 2
    inputs[key] = bad
    return inputs


# ----------------------------------------------------------------------------- strategies
SCALAR_STEPS = ("softcap", "scale")


@st.composite
def _steps(draw, recipe_vocab: int, head_pad: int, capacity: int, grad: bool, max_steps: int):
    """A program on the logits, valid for the layouts and widths it passes through."""
    steps, sliced, broke = [], head_pad == 0, False
    ndim, contiguous, unsqueezed = 3, True, 0
    n = draw(st.integers(0, max_steps))
    temps = st.sampled_from([0.5, 0.7, 2.0])
    ban_values = st.sampled_from([NEG_INF, NEG_INF, -1e4, 0.0])
    clamps = st.sampled_from([-5.0, -2.0])
    kinds = ["post", "post", "mutation", "mutation", "view", "view", "consumer", "consumer", "post_norm", "row",
             "other"]
    for _ in range(n):
        kind = draw(st.sampled_from(kinds))
        if kind == "post":
            name = draw(st.sampled_from(sorted(ELEMENTWISE)))
            params = {
                "temperature": (draw(temps),), "scale": (draw(st.sampled_from([0.5, 1.5])),),
                "softcap": (draw(st.sampled_from([2.0, 5.0])),),
                "cast": (draw(st.sampled_from(["float32", "float32", "bfloat16", "float16"])),),
                "clamp": (draw(clamps),),
                "masked_fill": (draw(ban_values),), "where_ban": (draw(ban_values),),
                "scatter_ban": (draw(ban_values),),
                "bias_like": (draw(st.sampled_from(["type_as", "to", "expand_as"])),),
            }.get(name, ())
            step = (name, *params)
        elif kind == "mutation":
            names = sorted(MUTATIONS - (OUT_STEPS if grad else set()))
            name = draw(st.sampled_from(names))
            if name == "setitem_view" and ndim < 2:
                continue
            params = {
                "div_": (draw(temps),), "itruediv": (draw(temps),), "imul": (draw(st.sampled_from([0.5, 1.5])),),
                "clamp_": (draw(clamps),), "clamp_fn_": (draw(clamps),), "masked_fill_": (draw(ban_values),),
                "setitem": (draw(ban_values),), "setitem_view": (draw(ban_values),), "index_fill_": (draw(ban_values),),
                "scatter_": (draw(ban_values),), "out_self": (draw(temps),), "copy_clamp": (draw(clamps),),
                "nan_to_num_fn": (-50.0,),
                "copy_ban": (draw(st.sampled_from(["contiguous", "reshape", "float", "to_copy"])), draw(ban_values)),
            }.get(name, ())
            step = (name, *params)
        elif kind == "row":
            step = (draw(st.sampled_from(sorted(ROW_OPS | NORMALISE))),)
        elif kind == "view":
            options = ["contiguous"] + (["mT"] if ndim >= 2 else []) + ([] if sliced else ["vslice", "vslice"])
            if ndim == 3:
                options += (["last", "last_ellipsis", "flatten", "transpose", "permute"]
                            + (["view_n"] if contiguous else []))
            if ndim >= 2:
                options += ["reshape", "unsqueeze"]
            if unsqueezed:
                options += ["squeeze", "squeeze"]
            name = draw(st.sampled_from(options))
            step = (name,)
            if name in ("last", "last_ellipsis", "flatten", "view_n"):
                ndim, contiguous = 2, contiguous and name not in ("last", "last_ellipsis")
            elif name == "reshape":
                ndim, contiguous = 2, True
            elif name in ("transpose", "permute"):
                contiguous = False
            elif name == "unsqueeze":
                ndim, unsqueezed = ndim + 1, unsqueezed + 1
            elif name == "squeeze":
                ndim, unsqueezed = ndim - 1, unsqueezed - 1
            elif name == "contiguous":
                contiguous = True
            elif name == "mT":
                s = draw(st.sampled_from(SCALAR_STEPS))
                step = ("mT", s, 2.0 if s == "softcap" else 1.5)
            elif name == "vslice":
                sliced = True
        elif kind in ("consumer", "post_norm"):
            pool = ["topk", "argmax", "max", "sort", "softmax", "log_softmax", "gather_ids", "gather_probe",
                    "multinomial"]
            if kind == "post_norm":
                pool = sorted(CONSUMERS - set(pool)) + ["multinomial"]
            name = draw(st.sampled_from(pool))
            via = draw(st.sampled_from(["none", "none", "log_softmax", "softmax"]))
            width = recipe_vocab if sliced else recipe_vocab + head_pad
            if name == "topk":
                step = ("topk", draw(st.integers(1, min(8, capacity, width))), draw(st.booleans()), via)
            elif name == "sort":
                step = ("sort", draw(st.booleans()), via)
            elif name in ("argmax", "max", "multinomial", "inverse_cdf"):
                step = (name, via)
            elif name == "gather_ids" and unsqueezed:
                continue
            else:
                step = (name,)
        else:
            options = ["out_new_softcap"] if not grad else []
            options += [] if broke else ["graph_break"]
            if not options:
                continue
            name = draw(st.sampled_from(options))
            if name == "out_new_softcap":
                step = (name, draw(st.sampled_from([2.0, 5.0])))
            else:
                step, broke = (name, draw(st.sampled_from(BREAKS))), True
        steps.append(step)
    if not sliced and draw(st.booleans()):
        steps.append(("vslice",))
    return tuple(steps)


@st.composite
def recipes(draw, max_steps: int = 6) -> Recipe:
    """A random drafter recipe; shapes stay tiny so one case compiles and runs well under a second."""
    vocab = draw(st.integers(40, 200))
    hidden = draw(st.sampled_from([8, 16, 24, 32]))
    head = draw(st.sampled_from(HEADS))
    head_pad = draw(st.sampled_from([0, 0, 0, 0, 1, 24]))
    tied = "tied" in head
    embed_pad = 0 if tied else draw(st.sampled_from([0, 0, 0, 0, 3, 16]))
    mode = draw(st.sampled_from(["inference", "inference", "no_grad", "grad", "enable_grad_inside", "no_grad_forward"]))
    grad = mode in GRAD_MODES
    dtype = "float32" if grad else draw(st.sampled_from(["float32", "float32", "float32", "bfloat16", "float16"]))
    autocast = not grad and dtype == "float32" and draw(st.integers(0, 9)) == 0
    capacity = draw(st.sampled_from([4, 16, 32, 64, 512]))
    body_ops = [o for o in BODY_OPS + TRANSFORM_BODY_OPS if not (grad and o in ("out_mul",))]
    body = tuple(draw(st.lists(st.sampled_from(body_ops), max_size=3)))
    if "mlp" not in body and "mlp_vocab_width" not in body:
        body = ("mlp",) + body
    if body.count("graph_break") > 1:
        body = tuple(o for i, o in enumerate(body) if o != "graph_break" or i == body.index("graph_break"))
    lookup = draw(st.sampled_from(LOOKUPS + TRANSFORM_LOOKUPS + ("embedding",) * 4))
    batch = draw(st.integers(1, 3))
    order = draw(st.sampled_from(["embed_first", "embed_first", "embed_first", "head_first", "head_first"]))
    draft_steps = 0 if order == "head_first" or draw(st.integers(0, 7)) else draw(st.integers(2, 3))
    chain = () if draft_steps else draw(_steps(vocab, head_pad, min(capacity, vocab + head_pad), grad, max_steps))
    extra_heads = 0 if draft_steps or draw(st.integers(0, 5)) else draw(st.sampled_from(EXTRA_HEADS[1:]))
    stacked = draw(st.sampled_from(sorted(STACKED))) if extra_heads and draw(st.integers(0, 2)) == 0 else ""
    combine = draw(st.sampled_from(sorted(COMBINE))) if extra_heads == 2 and not stacked and draw(st.booleans()) \
        else ""
    second_lookup = draw(st.sampled_from(SECOND_LOOKUPS + ("",) * 4))
    bad_call = draw(st.sampled_from(BAD_CALLS + ("",) * 3))
    d2t = draw(st.sampled_from(D2T + ("",) * 10)) if head in D2T_HEADS else ""
    if d2t:  # a draft vocabulary of head_rows target ids among embed_rows: an untied head, no padding, no extra heads
        head_pad, embed_pad, extra_heads = 0, draw(st.sampled_from([16, 40])), 0
        combine = stacked = ""
    if draft_steps:
        dtype, autocast, capacity = "float32", False, 512  # argmax fed back: no near ties, no eviction inside a call
    seq = draw(st.integers(1, 4))
    return Recipe(
        vocab=vocab, hidden=hidden, head=head,
        head_bias=draw(st.booleans()) and head != "functional_tied" and head not in ("buffer", "dequant", "attr_tensor"),
        head_pad=head_pad, embed_pad=embed_pad, position=draw(st.booleans()), body=body,
        order=order, chain=chain, return_logits=draw(st.booleans()),
        extra_outputs=tuple(draw(st.lists(st.sampled_from(EXTRA_OUTPUTS), max_size=2, unique=True))),
        dtype=dtype, mode=mode, autocast=autocast, capacity=capacity,
        batch=batch, seq=seq, seq2=draw(st.sampled_from([seq, seq, seq + 1])),
        feed_padded_ids=embed_pad > 0 and draw(st.booleans()), extra_active=draw(st.sampled_from([0, 3, 20])),
        n_ban=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**16)),
        lookup=lookup, head_break=draw(st.sampled_from(("",) * 4 + BREAKS)),
        hook=head in ("linear", "linear_tied") and draw(st.integers(0, 5)) == 0,
        draft_steps=draft_steps, draft_feed=draw(st.sampled_from(["argmax", "input"])) if draft_steps else "argmax",
        extra_heads=extra_heads, combine=combine, stacked=stacked,
        stacked_post=draw(st.sampled_from(STACKED_POSTS if dtype == "float32" else STACKED_POSTS[:-1])),
        head_vmap=order == "embed_first" and not draft_steps and head in TRANSFORM_HEADS and draw(st.integers(0, 7)) == 0,
        second_lookup=second_lookup, bad_call=bad_call,
        bad_at=draw(st.sampled_from(["ids", "ids2"])) if second_lookup and bad_call else "ids", d2t=d2t,
        small_tables=draw(st.sampled_from(SMALL_TABLES + (0,) * 5)),
        trainable_post=grad and any(s[0] in ("bias", "iadd_bias", "scale_vec") for s in chain) and draw(st.booleans()),
    )
