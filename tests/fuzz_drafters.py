"""Drafters generated from a recipe, for the pass fuzzer (tests/passes/test_pass_fuzzer.py).

A :class:`Recipe` is plain data (its ``repr`` is valid Python), and :class:`FuzzDrafter` builds
an ``nn.Module`` from it: a token embedding and a tiny body, a head pattern, and a chain of steps
on the logits drawn from :data:`CATALOGUE` (post-ops, casts, views and slices, in-place
mutations, consumers, graph breaks). ``recipes()`` is the hypothesis strategy that draws them.

The oracle lives in the same ``forward``: called with ``_mask`` (bool, one entry per head output)
the drafter sets inactive logits to -inf right after the head and again after every elementwise
step, which equals masking once after the last elementwise step (every such step maps column j to
column j), and it records what each output was computed from in ``_record``, so that selections
can be checked up to ties.
"""
from __future__ import annotations

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
)

# Steps of the logits chain. Each is a tuple (name, *params) with params plain numbers/strings.
ELEMENTWISE = {  # out-of-place, column j -> column j
    "temperature", "scale", "bias", "scale_vec", "softcap", "cast", "clamp", "masked_fill", "gumbel", "where_ban",
}
MUTATIONS = {  # in place on the current logits (or a view of them)
    "div_", "itruediv", "iadd_bias", "imul", "clamp_", "clamp_fn_", "masked_fill_", "setitem", "setitem_view",
    "out_self", "copy_clamp", "nan_to_num_fn",
}
ROW_OPS = {"sub_lse", "sub_max"}  # read a reduction over the vocabulary, then elementwise
VIEWS = {"last", "flatten", "vslice", "contiguous"}
CONSUMERS = {"topk", "argmax", "max", "sort", "softmax", "log_softmax", "gather_ids", "gather_probe", "multinomial"}
OTHER = {"graph_break", "out_new_softcap"}
CATALOGUE = ELEMENTWISE | MUTATIONS | ROW_OPS | VIEWS | CONSUMERS | OTHER
OUT_STEPS = {"out_self", "out_new_softcap"}  # out= calls: not with autograd

BODY_OPS = ("mlp", "mlp_vocab_width", "clamp_fn_", "tanh_fn_", "out_mul", "counter", "graph_break")
EXTRA_OUTPUTS = ("hidden", "wide_proj", "router")


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
    mode: str = "inference"    # "inference", "no_grad" or "grad" (frozen head, trainable body)
    autocast: bool = False     # run under torch.autocast("cpu", torch.bfloat16)
    capacity: int = 64
    batch: int = 2
    seq: int = 3
    seq2: int = 3              # sequence length of the second call
    feed_padded_ids: bool = False  # also feed ids in [head rows, embedding rows)
    extra_active: int = 0      # ids observed by hand between the two calls
    n_ban: int = 2             # banned ids used by masked_fill/setitem steps
    seed: int = 0

    @property
    def head_rows(self) -> int:
        return self.vocab + self.head_pad

    @property
    def embed_rows(self) -> int:
        return self.head_rows + self.embed_pad


NEG_INF = "-inf"


def _value(v):
    return float("-inf") if v == NEG_INF else float(v)


class FuzzDrafter(nn.Module):
    """An ``nn.Module`` built from a :class:`Recipe`; see the module docstring for ``_mask``/``_record``."""

    def __init__(self, recipe: Recipe):
        super().__init__()
        r = self.recipe = recipe
        g = torch.Generator().manual_seed(r.seed)
        H, Vh = r.hidden, r.head_rows

        def randn(*shape, scale=1.0):
            return torch.randn(*shape, generator=g) * scale

        self.embed = nn.Embedding(r.embed_rows, H)
        with torch.no_grad():
            self.embed.weight.copy_(randn(r.embed_rows, H))
        if r.position:
            self.pos = nn.Embedding(16, H)
        width = Vh if "mlp_vocab_width" in r.body else 2 * H
        self.up = nn.Linear(H, width)
        self.down = nn.Linear(width, H)
        if r.order == "head_first":
            self.pre = nn.Linear(H, H)
        w = randn(Vh, H, scale=H**-0.5 * 2)
        b = randn(Vh) if r.head_bias else None
        if r.head == "linear":
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
        elif r.head in ("matmul_bias", "matmul_T", "einsum"):
            self.W = nn.Parameter(w)
            self.b = nn.Parameter(b) if b is not None else None
        elif r.head == "buffer":
            self.register_buffer("head_buf", w)
        elif r.head == "dequant":
            scale = w.abs().amax(1, keepdim=True) / 127
            self.register_buffer("qweight", torch.round(w / scale).to(torch.int8))
            self.register_buffer("qscale", scale)
        if "wide_proj" in r.extra_outputs:
            self.wide = nn.Linear(H, Vh + 7, bias=False)  # wider than the vocabulary, returned: not the head
        if "router" in r.extra_outputs:
            self.router = nn.Linear(H, 4, bias=False)
        self.logit_bias = nn.Parameter(randn(Vh))
        self.register_buffer("logit_scale", 0.5 + torch.rand(Vh, generator=g))
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
        if r.mode == "grad":  # EAGLE training: the head (and a tied embedding) frozen, the body trainable
            for name, p in self.named_parameters():
                if name.startswith(("lm_head", "W", "b", "logit_bias")) or (name.startswith("embed") and "tied" in r.head):
                    p.requires_grad_(False)
        self.eval()

    # ----------------------------------------------------------------- pieces
    def head_weight(self) -> torch.Tensor | None:
        r = self.recipe
        if r.head in ("linear", "linear_tied"):
            return self.lm_head.weight
        if r.head == "functional_tied":
            return self.embed.weight
        if r.head in ("matmul_bias", "matmul_T", "einsum"):
            return self.W
        if r.head == "buffer":
            return self.head_buf
        return None

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        r = self.recipe
        if r.head in ("linear", "linear_tied"):
            return self.lm_head(h)
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
        return F.linear(h, self.qweight.to(h.dtype) * self.qscale.to(h.dtype))

    def _body(self, ids: torch.Tensor) -> torch.Tensor:
        r = self.recipe
        h = self.embed(ids)
        if r.position:
            h = h + self.pos(torch.arange(ids.shape[-1], device=ids.device))
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
            elif op == "graph_break":
                torch._dynamo.graph_break()
        return h

    # ----------------------------------------------------------------- forward
    def forward(self, ids, prev_hidden=None, noise=None, _mask=None, _record=None):
        r = self.recipe
        outputs: list = []
        if r.order == "head_first":
            z = self._head(self.pre(prev_hidden))
            self._chain(z, ids, noise, _mask, _record, outputs)
            h = self._body(ids)
        else:
            h = self._body(ids)
            z = self._head(h)
            self._chain(z, ids, noise, _mask, _record, outputs)
        for extra in r.extra_outputs:
            if extra == "hidden":
                out = h
            elif extra == "wide_proj":
                out = self.wide(h)
            else:
                out = self.router(h)
            outputs.append(out)
            if _record is not None:
                _record.append(("values", None, None))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _chain(self, z, ids, noise, mask, record, outputs) -> None:
        r = self.recipe
        layout = "bsv"  # [B, S, V]; "bv" after last, "nv" after flatten
        m = mask

        def remask(t):
            return t if m is None else t.masked_fill(~m, float("-inf"))

        def like(t):  # a [B, S, ...] tensor in the current layout, cut to the current width
            t = t[..., : z.shape[-1]]
            if layout == "bv":
                return t[:, -1]
            if layout == "nv":
                return t.reshape(-1, t.shape[-1])
            return t

        def ids_like():
            if layout == "bv":
                return ids[:, -1:]
            if layout == "nv":
                return ids.reshape(-1, 1)
            return ids.unsqueeze(-1)

        def emit(kind, out, x=None, params=None):
            outputs.append(out)
            if record is not None:
                # a copy: later in-place steps must not change what the consumer read
                record.append((kind, x if x is None else (x.detach().clone(), m), params))

        z = remask(z)
        for step in r.chain:
            name, p = step[0], step[1:]
            elementwise = True
            if name == "temperature":
                z = z / p[0]
            elif name == "scale":
                z = z * p[0]
            elif name == "bias":
                z = z + self.logit_bias[: z.shape[-1]]
            elif name == "scale_vec":
                z = z * self.logit_scale[: z.shape[-1]]
            elif name == "softcap":
                z = p[0] * torch.tanh(z / p[0])
            elif name == "cast":
                z = z.to(DTYPES[p[0]])
            elif name == "clamp":
                z = torch.clamp(z, min=p[0])
            elif name == "masked_fill":
                z = z.masked_fill(self.ban_mask[: z.shape[-1]], _value(p[0]))
            elif name == "where_ban":
                z = torch.where(self.ban_mask[: z.shape[-1]], torch.full_like(z, _value(p[0])), z)
            elif name == "gumbel":
                z = z + like(noise).to(z.dtype)
            elif name == "div_":
                z.div_(p[0])
            elif name == "itruediv":
                z /= p[0]
            elif name == "iadd_bias":
                z += self.logit_bias[: z.shape[-1]]
            elif name == "imul":
                z *= p[0]
            elif name == "clamp_":
                z.clamp_(min=p[0])
            elif name == "clamp_fn_":
                torch.clamp_(z, min=p[0])
            elif name == "masked_fill_":
                z.masked_fill_(self.ban_mask[: z.shape[-1]], _value(p[0]))
            elif name == "setitem":
                z[..., self.ban_ids] = _value(p[0])
            elif name == "setitem_view":
                v = z[-1:]  # a view of the last row (batch or position)
                v[..., self.ban_ids] = _value(p[0])
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
            elif name == "sub_lse":
                z = z - torch.logsumexp(z.float(), dim=-1, keepdim=True).to(z.dtype)
            elif name == "sub_max":
                z = z - z.max(dim=-1, keepdim=True).values
            else:
                elementwise = False
            if elementwise:
                z = remask(z)
                continue
            if name == "last":
                z, layout = z[:, -1], "bv"
            elif name == "flatten":
                z, layout = z.reshape(-1, z.shape[-1]), "nv"
            elif name == "vslice":
                z = z[..., : r.vocab]
                m = None if m is None else m[: r.vocab]
            elif name == "contiguous":
                z = z.contiguous()
            elif name == "graph_break":
                torch._dynamo.graph_break()
            elif name in ("topk", "argmax", "max", "sort", "multinomial"):
                via = p[-1]
                x = z if via == "none" else (torch.softmax(z.float(), -1) if via == "softmax" else torch.log_softmax(z.float(), -1))
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
                    probs = x if via == "softmax" else torch.softmax(x.float(), -1)
                    emit("sample", torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1), probs.reshape(-1, probs.shape[-1]), None)
            elif name == "softmax":
                emit("values", torch.softmax(z.float(), dim=-1))
            elif name == "log_softmax":
                emit("values", F.log_softmax(z, dim=-1))
            elif name == "gather_ids":
                emit("values", z.gather(-1, ids_like()))
            elif name == "gather_probe":
                emit("values", z.gather(-1, self.probe.expand(*z.shape[:-1], self.probe.numel())))
            else:
                raise ValueError(f"unknown step {name!r}")
        if r.return_logits or not outputs:
            outputs.insert(0, z)
            if record is not None:
                record.insert(0, ("values", None, None))


def compute_dtype(recipe: Recipe) -> torch.dtype:
    """The least precise dtype the logits pass through (it sets the comparison tolerance)."""
    dtypes = [DTYPES[recipe.dtype]] + [DTYPES[s[1]] for s in recipe.chain if s[0] == "cast"]
    if recipe.autocast:
        dtypes.append(torch.bfloat16)
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def make_inputs(recipe: Recipe, call: int) -> dict:
    """Inputs of call ``call`` (0 or 1): ids (and the previous hidden state, Gumbel noise)."""
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
    return inputs


# ----------------------------------------------------------------------------- strategies
@st.composite
def _steps(draw, recipe_vocab: int, head_pad: int, capacity: int, grad: bool, max_steps: int):
    """A chain of steps, valid for the layouts and widths it passes through."""
    steps, layout, sliced, broke = [], "bsv", head_pad == 0, False
    n = draw(st.integers(0, max_steps))
    temps = st.sampled_from([0.5, 0.7, 2.0])
    ban_values = st.sampled_from([NEG_INF, NEG_INF, -1e4, 0.0])
    for _ in range(n):
        kind = draw(st.sampled_from(["post", "post", "mutation", "mutation", "view", "consumer", "consumer", "row", "other"]))
        if kind == "post":
            name = draw(st.sampled_from(sorted(ELEMENTWISE)))
            params = {
                "temperature": (draw(temps),), "scale": (draw(st.sampled_from([0.5, 1.5])),), "softcap": (draw(st.sampled_from([2.0, 5.0])),),
                "cast": (draw(st.sampled_from(["float32", "float32", "bfloat16", "float16"])),), "clamp": (draw(st.sampled_from([-5.0, -2.0])),),
                "masked_fill": (draw(ban_values),), "where_ban": (draw(ban_values),),
            }.get(name, ())
            step = (name, *params)
        elif kind == "mutation":
            names = sorted(MUTATIONS - (OUT_STEPS if grad else set()))
            name = draw(st.sampled_from(names))
            params = {
                "div_": (draw(temps),), "itruediv": (draw(temps),), "imul": (draw(st.sampled_from([0.5, 1.5])),),
                "clamp_": (draw(st.sampled_from([-5.0, -2.0])),), "clamp_fn_": (draw(st.sampled_from([-5.0, -2.0])),),
                "masked_fill_": (draw(ban_values),), "setitem": (draw(ban_values),), "setitem_view": (draw(ban_values),),
                "out_self": (draw(temps),), "copy_clamp": (draw(st.sampled_from([-5.0, -2.0])),), "nan_to_num_fn": (-50.0,),
            }.get(name, ())
            step = (name, *params)
        elif kind == "row":
            step = (draw(st.sampled_from(sorted(ROW_OPS))),)
        elif kind == "view":
            options = ["contiguous"] + (["last", "flatten"] if layout == "bsv" else []) + ([] if sliced else ["vslice", "vslice"])
            step = (draw(st.sampled_from(options)),)
            if step[0] == "last":
                layout = "bv"
            elif step[0] == "flatten":
                layout = "nv"
            elif step[0] == "vslice":
                sliced = True
        elif kind == "consumer":
            name = draw(st.sampled_from(sorted(CONSUMERS)))
            via = draw(st.sampled_from(["none", "none", "log_softmax", "softmax"]))
            width = recipe_vocab if sliced else recipe_vocab + head_pad
            if name == "topk":
                step = ("topk", draw(st.integers(1, min(8, capacity, width))), draw(st.booleans()), via)
            elif name == "sort":
                step = ("sort", draw(st.booleans()), via)
            elif name in ("argmax", "max", "multinomial"):
                step = (name, via)
            else:
                step = (name,)
        else:
            options = ["out_new_softcap"] if not grad else []
            options += [] if broke else ["graph_break"]
            if not options:
                continue
            step = (draw(st.sampled_from(options)),)
            if step[0] == "out_new_softcap":
                step = (step[0], draw(st.sampled_from([2.0, 5.0])))
            broke = broke or step[0] == "graph_break"
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
    mode = draw(st.sampled_from(["inference", "inference", "no_grad", "grad"]))
    grad = mode == "grad"
    dtype = "float32" if grad else draw(st.sampled_from(["float32", "float32", "float32", "bfloat16", "float16"]))
    autocast = not grad and dtype == "float32" and draw(st.integers(0, 9)) == 0
    capacity = draw(st.sampled_from([4, 16, 32, 64, 512]))
    body_ops = [o for o in BODY_OPS if not (grad and o in ("out_mul",))]
    body = tuple(draw(st.lists(st.sampled_from(body_ops), max_size=3)))
    if "mlp" not in body and "mlp_vocab_width" not in body:
        body = ("mlp",) + body
    if body.count("graph_break") > 1:
        body = tuple(o for i, o in enumerate(body) if o != "graph_break" or i == body.index("graph_break"))
    chain = draw(_steps(vocab, head_pad, min(capacity, vocab + head_pad), grad, max_steps))
    seq = draw(st.integers(1, 4))
    return Recipe(
        vocab=vocab, hidden=hidden, head=head, head_bias=draw(st.booleans()) and head != "functional_tied" and head not in ("buffer", "dequant"),
        head_pad=head_pad, embed_pad=embed_pad, position=draw(st.booleans()), body=body,
        order=draw(st.sampled_from(["embed_first", "embed_first", "embed_first", "head_first"])),
        chain=chain, return_logits=draw(st.booleans()),
        extra_outputs=tuple(draw(st.lists(st.sampled_from(EXTRA_OUTPUTS), max_size=2, unique=True))),
        dtype=dtype, mode=mode, autocast=autocast, capacity=capacity,
        batch=draw(st.integers(1, 3)), seq=seq, seq2=draw(st.sampled_from([seq, seq, seq + 1])),
        feed_padded_ids=embed_pad > 0 and draw(st.booleans()), extra_active=draw(st.sampled_from([0, 3, 20])),
        n_ban=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**16)),
    )
