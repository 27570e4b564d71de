"""``nanospec-fx train-eagle``: features of the target over training text, then an EAGLE drafter trained on them."""
from __future__ import annotations

import json
import time
from pathlib import Path

import click

from nanospec_fx.eval.cli import threads_option
from nanospec_fx.vocab.config import DEFAULT_STATIC_SIZE

TRAIN_CORPUS = "sharegpt-train"


@click.command("train-eagle")
@click.option("--model", default="gemma3-270m", show_default=True,
              help="Target: gemma3-270m, smollm2-135m, tiny-llama (random, for smoke runs), a HF directory or a "
                   ".gguf file.")
@click.option("--tokenizer", default=None, help="Tokenizer of the training text (default: the model's own).")
@click.option("--corpus", default=TRAIN_CORPUS, show_default=True,
              help=f"Training text: {TRAIN_CORPUS} (ShareGPT conversations from record 600 on, without the translation "
                   "and summarisation requests the evaluation takes), or NAME[a:b] / a JSON(L) file "
                   "(prompt + continuation).")
@click.option("--tokens", default=262_144, show_default=True,
              help="Tokens of features to extract (the first shard is held out).")
@click.option("--window", default=512, show_default=True,
              help="Tokens per training window (the target sees each window alone).")
@click.option("--val-tokens", default=2048, show_default=True,
              help="Held-out tokens (one shard) for the validation figure.")
@click.option("--minutes", default=25.0, show_default=True,
              help="Training time budget (stops at --steps or this, first).")
@click.option("--steps", default=100_000, show_default=True,
              help="Training steps at most (also the cosine schedule's length).")
@click.option("--batch", default=2, show_default=True, help="Windows per step.")
@click.option("--lr", default=3e-4, show_default=True,
              help="AdamW learning rate (the feature-writing weights train in standardised units).")
@click.option("--token-weight", default=1.0, show_default=True,
              help="Weight of the sampled token KL next to the feature regression.")
@click.option("--seed", default=0, show_default=True,
              help="Seed of the initialisation, the batches and the sampled candidates.")
@click.option("--extract-only", is_flag=True, help="Only cache the features (resumable), do not train.")
@click.option("--fresh", is_flag=True,
              help="Train from scratch even if a training state is cached (features are kept).")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where features and the checkpoint go (default: ~/.cache/nanospec-fx/eagle/<model>; "
                   "$NANOSPEC_FX_CACHE moves it).")
@click.option("--layout", type=click.Choice(["eagle", "mtp"]), default="eagle", show_default=True,
              help="eagle: EAGLE's drafter (fc over [embedding, feature], one decoder layer). mtp: a "
                   "multi-token-prediction module in DeepSeek-V3's layout (the embedding and the feature each "
                   "RMS-normed, concatenated, eh_proj, one block; the target's own embedding, final norm and head), "
                   "kept in <cache>/mtp-layout; `nanospec-fx e2e --drafter eagle --eagle-dir <cache>/mtp-layout` "
                   "measures it.")
@click.option("--vllm-out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Train the drafter in the layout vLLM's `eagle` method runs (EAGLE-1: the target's final-norm "
                   "output as feature, no fc bias, no layer input norm, head(hidden)) and write it to this directory "
                   "as vLLM loads it (config.json + model.safetensors; Llama targets). Its training state and "
                   "checkpoint are kept apart from the default drafter's, in <cache>/vllm-layout (docs/vllm.md).")
@threads_option
def train_eagle(model, tokenizer, corpus, tokens, window, val_tokens, minutes, steps, batch, lr, token_weight, seed,
                extract_only, fresh, cache_dir, layout, vllm_out, threads):
    """Train an EAGLE drafter (one decoder layer on the target's features, its head shared) for a target model.

    Features are cached in shards and a rerun resumes where it stopped; the trained drafter is saved as
    safetensors and used by `nanospec-fx e2e --drafter eagle` and examples/eagle_drafting.py. With
    --vllm-out, the drafter is trained in vLLM's EAGLE layout instead and also written for vLLM.
    """
    import torch

    from nanospec_fx.eval import loaders
    from nanospec_fx.eval import train_eagle as T
    from nanospec_fx.eval.commands.sources import load_option
    from nanospec_fx.eval.report import (
        command_line,
        console,
        fail,
        machine,
        progress,
        set_threads,
    )

    set_threads(threads)
    if vllm_out and layout == "mtp":
        fail("--vllm-out writes vLLM's EAGLE layout: it does not combine with --layout mtp")
    if window < 8 or tokens < 2 * window or val_tokens < window:
        fail(f"need --window >= 8, --tokens >= 2 x window and --val-tokens >= window; "
             f"got {window}, {tokens}, {val_tokens}")
    from nanospec_fx.eval.train_eagle import eagle_dir  # imports torch: not at --help

    folder = eagle_dir(model, cache_dir)
    features = folder / "features"
    try:
        target = load_option("--model", loaders.load_model, model)
        tok = load_option("--tokenizer", loaders.load_tokenizer, tokenizer or model)
        if corpus == TRAIN_CORPUS:
            conversations = T.sharegpt_training_conversations()
        else:
            conversations = ((s.prompt, s.prompt + s.continuation)
                             for s in load_option("--corpus", loaders.load_corpus, corpus))
    except loaders.MissingAsset as e:
        fail(e)
    if vllm_out:
        from nanospec_fx.eval.vllm_eagle import check_target

        try:
            check_target(target)
        except ValueError as e:
            fail(e)
    vocab = target.get_output_embeddings().weight.shape[0]
    digests: list[str] = []

    def sequences():
        for prompt, text in conversations:
            digests.append(T.prompt_digest(prompt))
            yield [i for i in tok.encode(text, bos=True) if i < vocab]

    per_shard = max(1, val_tokens // window)
    started = time.perf_counter()
    with progress() as prog:
        task = prog.add_task(f"features of {model}", total=tokens)
        def shard_done(done, total):
            prog.update(task, completed=min(done, tokens))
            if not console.is_terminal:  # a log file: one line per shard instead of a live bar
                console.print(f"features: {min(done, tokens):,}/{tokens:,} tokens, "
                              f"{time.perf_counter() - started:.0f} s")
        shards = T.extract_features(target, T.pack_windows(sequences(), window), features, tokens, window, per_shard,
                                    on_shard=shard_done)
    extract_s = time.perf_counter() - started
    (folder / "train-prompts.txt").write_text("\n".join(digests) + "\n")
    console.print(f"features: {shards} shards x {per_shard * window} tokens in {features} ({extract_s:.0f} s this run)")
    if shards < 2:
        fail(f"only {shards} shard(s) of features: the first is held out, training needs at least one more "
             "(raise --tokens or use a larger corpus)")
    if extract_only:
        return
    ids, feats = T.load_shards(features, 1)
    val_ids, val_feats = T.load_shards(features, 0, 1)
    counts = torch.bincount(ids.flatten(), minlength=vocab)
    frequent = torch.argsort(-counts, stable=True)
    cfg = T.TrainConfig(steps=steps, minutes=minutes, batch=batch, lr=lr, token_weight=token_weight, seed=seed)
    arch = "vllm" if vllm_out else "mtp" if layout == "mtp" else "nanospec"
    drafter = T.new_drafter(target, seed, arch)
    # another architecture: its own folder, never resumed across
    checkpoint = folder / "vllm-layout" if vllm_out else folder / "mtp-layout" if layout == "mtp" else folder
    checkpoint.mkdir(parents=True, exist_ok=True)
    if checkpoint != folder:  # what e2e checks its requests against, beside the checkpoint it loads
        (checkpoint / "train-prompts.txt").write_text((folder / "train-prompts.txt").read_text())
    state = checkpoint / T.TRAIN_STATE
    if fresh and state.exists():
        state.unlink()
    console.print(f"training on {ids.numel():,} tokens ({ids.shape[0]} windows of {window}); "
                  f"held out: {val_ids.numel():,}")
    with progress() as prog:
        task = prog.add_task("training", total=None)

        def show(log, row):
            text = (f"training: step {log.steps}, reg {row['reg']:.3f}, token KL {row['kl']:.3f}, "
                    f"sampled top-1 {row['sampled_top1']:.2f}")
            prog.update(task, completed=log.steps, description=text)
            if not console.is_terminal and log.steps % 10 == 0:
                console.print(f"{text}, {log.seconds:.0f} s")
        log = T.train(drafter, ids, feats, cfg, frequent[: cfg.frequent], state, show)
    console.print(f"trained {log.steps} steps ({log.positions:,} positions) in {log.seconds / 60:.1f} min; "
                  "validating...")
    val = T.validate(drafter, val_ids, val_feats, static_rows=frequent[: min(DEFAULT_STATIC_SIZE, vocab)])
    meta = {"model": model, "command": command_line(), "corpus": corpus, "window": window,
            "feature_tokens": shards * per_shard * window, "train_tokens": ids.numel(), "val_tokens": val_ids.numel(),
            "train": {**cfg.__dict__, "steps_done": log.steps, "seconds": round(log.seconds, 1),
                      "positions": log.positions},
            "history": log.history, "validation": val, "machine": machine()}
    path = T.save_drafter(drafter, checkpoint, meta)
    console.print(f"held-out top-1 agreement with the target: {100 * val['top1_agreement']:.1f}% "
                  f"over {val['positions']:,} positions (head restricted to the 32k most frequent training tokens: "
                  f"{100 * val['top1_agreement_static']:.1f}%)")
    console.print(f"saved {path}")
    if vllm_out:
        from nanospec_fx.eval.vllm_eagle import export_vllm_eagle

        text_config = getattr(target.config, "text_config", target.config)
        export_vllm_eagle(drafter, vllm_out, getattr(text_config, "max_position_embeddings", 2048),
                          frequent=frequent)
        console.print(f"wrote vLLM's EAGLE layout to {vllm_out}: --speculative-config "
                      f"'{{\"method\": \"eagle\", \"model\": \"{vllm_out}\", \"num_speculative_tokens\": 3}}'")
    print(json.dumps(val))
