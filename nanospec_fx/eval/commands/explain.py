"""``nanospec-fx explain``: compile a model with nanospec, run it once, show what the pass did."""
from __future__ import annotations

import click

from nanospec_fx.vocab.config import DEFAULT_CAPACITY


@click.command()
@click.option("--model", default="tiny-llama", show_default=True,
              help="gemma3-270m, smollm2-135m, a HF directory, a .gguf file, or tiny-llama (random weights, offline).")
@click.option("--capacity", default=DEFAULT_CAPACITY, show_default=True, help="Slots of the active vocabulary.")
@click.option("--prompt-tokens", default=32, show_default=True,
              help="Random prompt tokens fed once (they become active).")
@click.option("--rows", default="1,10", show_default=True, help="Rows for the predicted head speedup.")
@click.option("--inductor/--no-inductor", default=False, show_default=True,
              help="Compile the rest with inductor (slow on CPU).")
@click.option("--calibrate/--no-calibrate", default=False, show_default=True,
              help="Measure the cost model's constants on this CPU first (about a second).")
def explain(model, capacity, prompt_tokens, rows, inductor, calibrate):
    """Compile a model with nanospec, run it once, print what the pass did and the cost model."""
    import torch

    import nanospec_fx
    from nanospec_fx.eval import loaders
    from nanospec_fx.eval.commands.sources import load_option
    from nanospec_fx.eval.report import console, fail, ints

    try:
        lm = load_option("--model", loaders.load_model, model)
    except loaders.MissingAsset as e:
        fail(e)
    torch._dynamo.reset()
    compiled = torch.compile(lm, backend="nanospec", options={"capacity": capacity, "inductor": inductor})
    vocab = lm.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        compiled(ids)
    report = nanospec_fx.explain(lm, calibrate=calibrate, quiet=True)
    console.print(str(report), highlight=False)
    for head in report.heads:
        for n_active in dict.fromkeys([max(len(head.state), 1), head.state.capacity]):
            preds = ", ".join(f"{head.cost.predict(r, n_active):.1f}x at {r} row(s)" for r in ints(rows))
            console.print(f"  predicted {head.name} speedup with {n_active} active tokens: {preds}")
