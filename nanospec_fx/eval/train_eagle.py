"""Train an EAGLE drafter for a transformers causal LM: features, loss, training loop, checkpoint.

The pipeline behind ``nanospec-fx train-eagle``:

1. :func:`extract_features`: the target runs over packed token windows of training text; the input
   of its final norm (EAGLE's feature) at every position is cached on disk with the token ids, in
   shards, so an interrupted run resumes at the next shard.
2. :func:`train`: the drafter (:class:`nanospec_fx.eagle.EagleDrafter`: fc over [token embedding,
   feature] -> one decoder layer -> the target's final norm and tied head; embedding, norm and head
   frozen and shared) learns from ``(x[t+1], f[t])`` to predict ``f[t+1]`` (smooth L1 on features
   standardised per dimension: one of Gemma-3's dimensions is ~70x the median scale) and the
   target's next-token distribution ``softmax(head(norm(f[t+1])))``. That distribution is matched on
   a *sampled* candidate set per step (the frequent tokens, the batch's tokens, random ones), with
   the target's and the drafter's logits both restricted to it: a 262k-row softmax per position is
   what the CPU cannot afford, and the head rows are the same for both sides, so the restricted KL
   is zero exactly when the two distributions agree on the set (docs/eagle.md says more).
3. :func:`validate`: top-1 agreement of drafter and target over the *full* vocabulary on held-out
   windows (the first shard, never trained on).

The checkpoint (:func:`save_drafter` / :func:`load_drafter`) holds only the drafter's own weights
(fc and the layer) as safetensors plus a JSON of its config and how it was trained.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nanospec_fx.eagle import EagleConfig, EagleDrafter
from nanospec_fx.eagle.speculative import final_norm

SHARD = "shard-{:05d}.safetensors"
WEIGHTS, META = "drafter.safetensors", "drafter.json"
TRAIN_STATE = "train-state.pt"
# ShareGPT records before this index are left to the evaluation (``sharegpt[:N]`` takes the first ones).
TRAIN_START = 600


def eagle_dir(model: str, cache_dir: Path | None = None) -> Path:
    """Where a model's features and trained drafter live (outside the repository, under the eval cache)."""
    from nanospec_fx.eval.loaders import CACHE

    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(model).name if model) or "model"
    return Path(cache_dir) if cache_dir else CACHE / "eagle" / slug


# ----------------------------------------------------------------------------- training text
def sharegpt_training_conversations(start: int = TRAIN_START) -> Iterator[tuple[str, str]]:
    """``(first request as an evaluation prompt, whole conversation as User:/Assistant: text)`` of the
    ShareGPT records from ``start`` on, minus every record an evaluation category could take (the
    translation and summarisation requests)."""
    from nanospec_fx.eval import loaders

    held_out = re.compile(f"{loaders.TRANSLATE_PATTERN}|{loaders.SUMMARIZE_PATTERN}", re.IGNORECASE)
    for i, rec in enumerate(loaders._sharegpt_records()):
        turns = [t for t in rec.get("conversations") or []
                 if t.get("from") in ("human", "gpt") and (t.get("value") or "").strip()]
        if i < start or not turns or turns[0]["from"] != "human" or held_out.search(turns[0]["value"].strip()[:300]):
            continue
        text = "".join(f"{'User' if t['from'] == 'human' else 'Assistant'}: {t['value'].strip()}\n" for t in turns)
        yield loaders.chat_prompt([], turns[0]["value"].strip()), text


def prompt_digest(prompt: str) -> str:
    """A short hash of a request prompt (the checkpoint lists those of its training conversations)."""
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:16]


def pack_windows(sequences: Iterable[list[int]], window: int, max_per_sequence: int = 2048) -> Iterator[list[int]]:
    """Token windows of length ``window`` from concatenated sequences (each cut at ``max_per_sequence``
    tokens, so a few long conversations do not dominate)."""
    buffer: list[int] = []
    for ids in sequences:
        buffer.extend(ids[:max_per_sequence])
        while len(buffer) >= window:
            yield buffer[:window]
            buffer = buffer[window:]


# ----------------------------------------------------------------------------- features
def extract_features(target: nn.Module, windows: Iterable[list[int]], out: Path, tokens: int, window: int,
                     windows_per_shard: int = 16, batch: int = 2,
                     on_shard: Callable[[int, int], None] | None = None) -> int:
    """Cache the target's pre-norm features over ``windows`` until ``tokens`` tokens are on disk.

    Shard ``i`` holds windows ``i*windows_per_shard ..`` of the (deterministic) window stream as
    ``ids`` int32 ``[n, window]`` and ``features`` fp16 ``[n, window, H]`` (fp32 if a value does not
    fit fp16). Existing shards are kept, so a rerun resumes. ``on_shard(done_tokens, total)`` reports
    progress. Returns the number of shards on disk.
    """
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    per_shard = windows_per_shard * window
    n_shards = max(1, math.ceil(tokens / per_shard))
    norm, caught = final_norm(target), []
    hook = norm.register_forward_pre_hook(lambda m, args: caught.append(args[0]))
    stream, shard, base = iter(windows), 0, getattr(target, target.base_model_prefix)
    try:
        while shard < n_shards:
            chunk = [w for _, w in zip(range(windows_per_shard), stream)]
            if len(chunk) < windows_per_shard:
                break  # the text ran out
            path = out / SHARD.format(shard)
            if not path.exists():
                ids = torch.tensor(chunk, dtype=torch.long)
                feats = []
                with torch.inference_mode():
                    for rows in ids.split(batch):
                        caught.clear()
                        base(input_ids=rows, use_cache=False)
                        feats.append(caught[-1].float())
                feats = torch.cat(feats)
                fits = feats.abs().max() < torch.finfo(torch.float16).max / 2
                tmp = path.with_suffix(".tmp")
                save_file({"ids": ids.to(torch.int32),
                           "features": feats.to(torch.float16 if fits else torch.float32)}, str(tmp))
                tmp.rename(path)
            shard += 1
            if on_shard:
                on_shard(shard * per_shard, n_shards * per_shard)
    finally:
        hook.remove()
    return shard


def load_shards(folder: Path, first: int = 0, last: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids ``[N, T]`` (int64) and features ``[N, T, H]`` (as stored) of shards ``first..last-1``."""
    from safetensors.torch import load_file

    paths = sorted(folder.glob("shard-*.safetensors"))[first:last]
    if not paths:
        raise FileNotFoundError(f"no feature shards in {folder}[{first}:{last}]")
    parts = [load_file(str(p)) for p in paths]
    dtype = torch.float32 if any(p["features"].dtype == torch.float32 for p in parts) else torch.float16
    return torch.cat([p["ids"].long() for p in parts]), torch.cat([p["features"].to(dtype) for p in parts])


# ----------------------------------------------------------------------------- the drafter
def new_drafter(target: nn.Module, seed: int = 0, layout: str = "nanospec") -> EagleDrafter:
    """An EAGLE drafter sharing the target's embedding, final norm and head (frozen); fc starts as
    "next feature = this feature" and the layer's output projections small, so training starts from
    the copy-the-feature baseline instead of noise. ``layout="vllm"``: the layout vLLM's ``eagle``
    method runs (:class:`~nanospec_fx.eagle.EagleConfig`; exported by :mod:`nanospec_fx.eval.vllm_eagle`);
    ``layout="mtp"``: an MTP module in DeepSeek-V3's layout (normed embedding and feature, ``eh_proj``, one block)."""
    torch.manual_seed(seed)
    config = EagleConfig.from_target(getattr(target.config, "text_config", target.config))
    config.layout = layout
    drafter = EagleDrafter(config, target.get_input_embeddings(), target.get_output_embeddings(), final_norm(target))
    h = config.hidden_size
    with torch.no_grad():
        drafter.fc.weight[:, :h].mul_(0.1)
        drafter.fc.weight[:, h:].copy_(torch.eye(h))
        if drafter.fc.bias is not None:
            drafter.fc.bias.zero_()
        drafter.layer.o_proj.weight.mul_(0.1)
        drafter.layer.down_proj.weight.mul_(0.1)
    for module in (drafter.embed, drafter.lm_head, drafter.norm):
        module.requires_grad_(False)
    return drafter


def own_parameters(drafter: EagleDrafter) -> dict[str, torch.Tensor]:
    """The drafter's trained tensors (fc and layer), not the target's shared ones (while training:
    their values, not the parametrization's internals)."""
    out = {}
    for prefix in drafter.trained_modules():
        for name, sub in getattr(drafter, prefix).named_modules():
            if "parametrizations" in name or isinstance(sub, RowScale):
                continue
            for pname in ("weight", "bias"):
                t = getattr(sub, pname, None)
                if isinstance(t, torch.Tensor):
                    out[".".join(x for x in (prefix, name, pname) if x)] = t
    return out


class RowScale(nn.Module):
    """``W = diag(scale) W'``: the drafter writes features whose dimensions differ ~400x in scale (Gemma-3:
    std 15 .. 6,000); training ``W'`` in standardised units lets one learning rate fit every dimension
    (without it the layer's outputs need weights ~100x larger than Adam moves them in a few hundred steps)."""

    def __init__(self, scale: torch.Tensor, columns: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("scale", scale)
        self.columns = columns  # fc: 1/std on the feature inputs, so that W' = I passes a feature through

    def _factor(self, w):
        f = self.scale.view(-1, *[1] * (w.dim() - 1))
        return f * self.columns[None, :] if self.columns is not None and w.dim() == 2 else f

    def forward(self, w):
        return w * self._factor(w)

    def right_inverse(self, w):
        return w / self._factor(w)


def _scaled(drafter: EagleDrafter) -> list[tuple[nn.Module, str]]:
    """The tensors that write into the feature space: fc (weight, bias), the layer's o_proj and down_proj."""
    scaled = [(drafter.fc, "weight"), (drafter.fc, "bias"), (drafter.layer.o_proj, "weight"),
              (drafter.layer.down_proj, "weight")]
    return [(m, name) for m, name in scaled if getattr(m, name) is not None]  # vLLM's layout: fc has no bias


def save_drafter(drafter: EagleDrafter, folder: Path, meta: dict) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in own_parameters(drafter).items()}, str(folder / WEIGHTS))
    (folder / META).write_text(json.dumps({"config": asdict(drafter.config), **meta}, indent=1))
    return folder / WEIGHTS


def load_drafter(target: nn.Module, folder: Path) -> EagleDrafter:
    """The trained drafter in ``folder`` (:func:`save_drafter`), sharing ``target``'s embedding, norm and head."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / WEIGHTS).exists():
        raise FileNotFoundError(f"no trained drafter in {folder}: run `nanospec-fx train-eagle` first")
    meta = json.loads((folder / META).read_text())
    config = EagleConfig(**meta["config"])
    drafter = EagleDrafter(config, target.get_input_embeddings(), target.get_output_embeddings(), final_norm(target))
    if config.vocab_size != drafter.lm_head.weight.shape[0] or config.hidden_size != drafter.lm_head.weight.shape[1]:
        raise ValueError(f"{folder}: drafter trained for V={config.vocab_size}, H={config.hidden_size}, "
                         f"target head is {tuple(drafter.lm_head.weight.shape)}")
    weights = load_file(str(folder / WEIGHTS))
    for prefix in drafter.trained_modules():
        getattr(drafter, prefix).load_state_dict(
            {k[len(prefix) + 1:]: v for k, v in weights.items() if k.startswith(prefix + ".")})
    dtype = drafter.lm_head.weight.dtype
    return drafter.to(dtype).eval().requires_grad_(False)


# ----------------------------------------------------------------------------- the loss
@dataclass
class TrainConfig:
    steps: int = 100_000
    minutes: float = 30.0
    batch: int = 2
    lr: float = 3e-4
    warmup: int = 20
    token_weight: float = 1.0
    frequent: int = 2048
    random_negatives: int = 1024
    noise: float = 0.05
    seed: int = 0
    checkpoint_every: int = 50


@dataclass
class TrainLog:
    steps: int = 0
    seconds: float = 0.0
    positions: int = 0
    history: list[dict] = field(default_factory=list)


def _forward(drafter: EagleDrafter, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """Teacher-forced drafter over windows: hidden ``[B, T-1, H]`` at positions 0..T-2 from (x[t+1], f[t]);
    ``feats`` are the drafter's features (:func:`drafter_features`)."""
    b, t = ids.shape[0], ids.shape[1] - 1
    cache_k = torch.zeros(b, drafter.config.num_kv_heads, t, drafter.config.head_dim)
    cache_v = torch.zeros_like(cache_k)
    slots = torch.arange(t)
    mask = slots[None, :] <= slots[:, None]
    x = drafter.fuse(drafter.embed(ids[:, 1:]), feats[:, :-1])
    return drafter.layer(x, slots.expand(b, t), slots, mask, cache_k, cache_v)


def _logits(drafter: EagleDrafter, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    w = drafter.lm_head.weight if rows is None else drafter.lm_head.weight[rows]
    return F.linear(drafter.head_input(h), w)


def drafter_features(drafter: EagleDrafter, feats: torch.Tensor) -> torch.Tensor:
    """The cached target features (final-norm inputs) as the drafter reads them, in fp32 (the ``vllm``
    layout reads the norm's output; its hidden state then regresses that)."""
    with torch.no_grad():
        return drafter.target_features(feats.float())


def loss_terms(drafter: EagleDrafter, ids, feats, mean, std, candidates: torch.Tensor, noise: float = 0.0):
    """Feature regression (smooth L1, standardised) and token KL on ``candidates`` of one batch."""
    inputs = feats + noise * std * torch.randn_like(feats) if noise else feats
    h = _forward(drafter, ids, inputs)
    nxt = feats[:, 1:]
    reg = F.smooth_l1_loss((h - mean) / std, (nxt - mean) / std)
    with torch.no_grad():
        teacher = torch.log_softmax(_logits(drafter, nxt, candidates), -1)
    student = torch.log_softmax(_logits(drafter, h, candidates), -1)
    kl = F.kl_div(student.flatten(0, 1), teacher.flatten(0, 1), log_target=True, reduction="batchmean")
    agree = (student.argmax(-1) == teacher.argmax(-1)).float().mean()
    return reg, kl, agree


def candidate_set(frequent: torch.Tensor, ids: torch.Tensor, vocab: int, random_negatives: int,
                  gen: torch.Generator) -> torch.Tensor:
    """Frequent tokens + the batch's tokens + uniform random ones, deduplicated."""
    rand = torch.randint(0, vocab, (random_negatives,), generator=gen)
    return torch.unique(torch.cat([frequent, ids.flatten(), rand]))


def feature_stats(feats: torch.Tensor, windows: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and std of the features (of the first ``windows`` windows: enough, and cheap)."""
    flat = feats[:windows].float().flatten(0, 1)
    return flat.mean(0), flat.std(0).clamp_min(1e-3)


def train(drafter: EagleDrafter, ids: torch.Tensor, feats: torch.Tensor, cfg: TrainConfig, frequent: torch.Tensor,
          state_path: Path | None = None, on_step: Callable[[TrainLog, dict], None] | None = None) -> TrainLog:
    """Train ``drafter`` on windows ``ids [N, T]`` / ``feats [N, T, H]`` until ``cfg.steps`` or ``cfg.minutes``.

    Seeded; with ``state_path`` it resumes from (and saves every ``cfg.checkpoint_every`` steps) the
    optimizer, step and sampler state there.
    """
    from torch.nn.utils import parametrize

    torch.manual_seed(cfg.seed)
    mean, std = feature_stats(drafter_features(drafter, feats[:64]))
    log, gen = TrainLog(), torch.Generator().manual_seed(cfg.seed)
    saved = torch.load(state_path, weights_only=False) if state_path is not None and state_path.exists() else None
    if saved is not None:
        drafter.load_state_dict(saved["drafter"], strict=False)
    elif drafter.config.layout == "mtp":
        with torch.no_grad():  # hnorm(f) then has the features' typical size, so fc = [.., I] starts as the copy
            drafter.hnorm.weight.fill_(drafter_features(drafter, feats[:64]).pow(2).mean(-1).sqrt().mean().item())
    fc_columns = torch.cat([torch.ones_like(std), 1.0 / std])
    for module, name in _scaled(drafter):
        columns = fc_columns if module is drafter.fc and name == "weight" else None
        parametrize.register_parametrization(module, name, RowScale(std.clone(), columns))
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    if saved is not None:
        opt.load_state_dict(saved["optimizer"])
        gen.set_state(saved["generator"])
        log = TrainLog(**saved["log"])
    try:
        _loop(drafter, ids, feats, cfg, frequent, mean, std, opt, params, gen, log, state_path, on_step)
    finally:
        for module, name in _scaled(drafter):
            parametrize.remove_parametrizations(module, name, leave_parametrized=True)
    drafter.eval()
    return log


def _loop(drafter, ids, feats, cfg, frequent, mean, std, opt, params, gen, log, state_path, on_step) -> None:
    vocab = drafter.lm_head.weight.shape[0]
    def schedule(s: int) -> float:  # linear warm-up, then cosine down to 10%
        return min(1.0, (s + 1) / cfg.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s / cfg.steps, 1.0))))

    drafter.train()
    started, budget = time.perf_counter() - log.seconds, cfg.minutes * 60
    while log.steps < cfg.steps and time.perf_counter() - started < budget:
        rows = torch.randint(0, ids.shape[0], (cfg.batch,), generator=gen)
        b_ids, b_feats = ids[rows], drafter_features(drafter, feats[rows])
        cands = candidate_set(frequent, b_ids[:, 2:], vocab, cfg.random_negatives, gen)
        reg, kl, agree = loss_terms(drafter, b_ids, b_feats, mean, std, cands, cfg.noise)
        loss = reg + cfg.token_weight * kl
        reg, kl = reg.detach(), kl.detach()
        for group in opt.param_groups:
            group["lr"] = cfg.lr * schedule(log.steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        log.steps += 1
        log.positions += b_ids.shape[0] * (b_ids.shape[1] - 1)
        log.seconds = time.perf_counter() - started
        row = {"step": log.steps, "reg": reg.item(), "kl": kl.item(), "sampled_top1": agree.item(),
               "seconds": round(log.seconds, 1)}
        if log.steps % 10 == 0 or log.steps == 1:
            log.history.append(row)
        if on_step:
            on_step(log, row)
        if state_path is not None and log.steps % cfg.checkpoint_every == 0:
            _save_state(state_path, drafter, opt, gen, log)
    if state_path is not None:
        _save_state(state_path, drafter, opt, gen, log)


def _save_state(path: Path, drafter, opt, gen, log: TrainLog) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"drafter": own_parameters_prefixed(drafter), "optimizer": opt.state_dict(),
                "generator": gen.get_state(), "log": asdict(log)}, tmp)
    tmp.rename(path)


def own_parameters_prefixed(drafter: EagleDrafter) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in own_parameters(drafter).items()}


@torch.no_grad()
def validate(drafter: EagleDrafter, ids: torch.Tensor, feats: torch.Tensor, chunk: int = 256,
             static_rows: torch.Tensor | None = None) -> dict:
    """Held-out top-1 agreement of drafter and target over the full vocabulary (teacher-forced
    features), and with the drafter's head restricted to ``static_rows`` (FR-Spec) if given."""
    drafter.eval()
    hits, static_hits, total = 0, 0, 0
    for i in range(ids.shape[0]):
        window = drafter_features(drafter, feats[i: i + 1])
        h = _forward(drafter, ids[i: i + 1], window)[0]
        nxt = window[0, 1:]
        for a in range(0, h.shape[0], chunk):
            want = _logits(drafter, nxt[a: a + chunk]).argmax(-1)
            got = _logits(drafter, h[a: a + chunk])
            hits += int((got.argmax(-1) == want).sum())
            if static_rows is not None:
                static_hits += int((static_rows[got[:, static_rows].argmax(-1)] == want).sum())
            total += want.numel()
    out = {"positions": total, "top1_agreement": hits / max(total, 1)}
    if static_rows is not None:
        out["top1_agreement_static"] = static_hits / max(total, 1)
    return out
