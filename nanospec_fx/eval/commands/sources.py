"""The inputs several verbs share: the default static corpus, loading what an option names, and a static
table's samples kept apart from the evaluation requests (here so that no verb imports another for them)."""
from __future__ import annotations

STATIC_CORPUS = "sharegpt[1000:3000]"


def load_option(option: str, load, spec):
    """``load(spec)``; a missing asset's message names the option it came from."""
    from nanospec_fx.eval.loaders import MissingAsset

    try:
        return load(spec)
    except MissingAsset as e:
        raise MissingAsset(f"{option} {spec}: {e}") from e


def disjoint_static_samples(static: list, requests: list, spec: str) -> tuple[list, dict]:
    """The static-table samples that share no record (nor prompt) with an evaluation request, and what was
    checked: FR-Spec's frequency table must not have counted the text it is evaluated on."""
    from nanospec_fx.eval.report import fail

    used_records = {s.record for s in requests if s.record}
    used_prompts = {s.prompt for s in requests}
    kept = [s for s in static if not (s.record and s.record in used_records) and s.prompt not in used_prompts]
    if not kept:
        fail(f"every record of --static-corpus {spec} is also an evaluation request: choose a disjoint slice")
    return kept, {"corpus": spec, "records_counted": len(kept), "records_dropped_as_requests": len(static) - len(kept),
                  "disjoint_by": "record id (and prompt text)", "unlabelled_records": sum(not s.record for s in kept)}
