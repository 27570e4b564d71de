"""Drafters that score the target's own head inside transformers' ``generate``: MTP layers and DFlash.

    nanospec_fx.speculative_pair(target, mtp=True)      # then target.generate(ids, use_mtp=True)
    nanospec_fx.speculative_pair(target, drafter)       # a DFlash drafter: then target.generate(ids,
                                                        #   assistant_model=drafter, speculation_type="dflash")

Both drafters read the target's ``lm_head`` weight, so they share its ActiveVocab (one state per head weight).
The target is not compiled: its forward is the verification and stays dense; its top-k at the positions it
verified is observed from the outputs transformers hands the candidate generator, once per verification. What
is compiled with the nanospec backend is the module whose call reads the shared head while drafting:

* MTP: the MTP layers (``MtpModel``, built once), with ``head`` set to the module holding the target's output
  embedding (found from the model: :func:`mtp_head`); the tokens fed to them join the set through the input
  observer the pass inserts.
* DFlash: transformers' ``DFlashTokenCandidateGenerator`` calls the target's output embedding itself on the
  drafter's ``[B, K, H]`` output (the drafter, e.g. ``MuseGlimmerAssistantModel``, has no head). That call is
  given a :class:`SharedHead` of its own, compiled in place: one compact head call of ``B*K`` rows per step,
  while the target's forward still calls the dense module. The tokens the generator feeds (the committed
  sequence) are observed before each drafting step.

Each ``generate`` call builds a new candidate generator: the set is reset then (one call, one request).

Greedy MTP drafting picks tokens only: transformers' assisted loop reads the drafted logits for sampling or for
``assistant_ensemble_weight``, and for nothing else. There the generator calls :class:`MtpTokens` instead: the same
MTP layers compiled a second time with the logits dropped, so the graph's only reader of the head is the argmax,
taken on the compact logits with the ids mapped back (``compact_argmax``): no ``[V]`` row is written while drafting.
Its ids are those of the argmax over ``[V]`` logits with the inactive tokens at -inf (ties: the smaller id, as
``torch.argmax`` returns the first maximum). Sampling and ensembles keep the layers that return the ``[V]`` logits.
"""
from __future__ import annotations

import operator
import threading

import torch
import torch.nn as nn

_LOCK = threading.Lock()


class SharedHead(nn.Module):
    """The target's output embedding as called by a drafter: a module of its own, so that compiling it (in place,
    nanospec) makes the drafting reads compact while the target's own forward still calls the dense head."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    @property
    def weight(self):  # the generator moves the hidden states to head.weight.device
        return self.head.weight

    def forward(self, hidden):
        return self.head(hidden)


class MtpTokens(nn.Module):
    """``mtp``'s drafting call without its logits: ``(drafted ids, None, loss)``. Compiled with nanospec apart from
    ``mtp`` (whose own call returns the logits), so the head's only reader in this graph is the argmax and the
    pass takes it on the compact logits. ``mtp``'s uncompiled call path (hooks included) is what it traces."""

    def __init__(self, mtp: nn.Module):
        super().__init__()
        self.mtp = mtp

    def forward(self, *args, **kwargs):
        ids, _, loss = self.mtp._call_impl(*args, **kwargs)
        return ids, None, loss


# Ops that write nothing: unused, they can go. (A whitelist: Dynamo's graph holds in-place method calls - cache
# writes - that fx's own dead-code elimination would take for pure.)
_PURE_FUNCTIONS = (operator.getitem, torch.cat, torch.stack)
_PURE_METHODS = ("to", "float", "unsqueeze", "view", "reshape", "contiguous")


def without_dead_reads(gm, example_inputs, **kwargs):
    """The nanospec backend on Dynamo's graph less its unused pure ops: MtpModel's loop still builds the logits it
    returns (``logits[:, None, :]`` into a list, ``torch.cat``) after :class:`MtpTokens` dropped them, and Dynamo
    keeps those dead nodes; left in, they read the head's ``[..., V]`` output and it would be materialised for them.
    """
    from torch._dynamo import lookup_backend

    removed = True
    while removed:
        removed = False
        for node in reversed(list(gm.graph.nodes)):
            pure = ((node.op == "call_function" and node.target in _PURE_FUNCTIONS)
                    or (node.op == "call_method" and node.target in _PURE_METHODS))
            if pure and not node.users:
                gm.graph.erase_node(node)
                removed = True
    gm.recompile()
    return lookup_backend("nanospec")(gm, example_inputs, **kwargs)


def is_dflash_drafter(drafter: nn.Module) -> bool:
    """A drafter that transformers runs with ``speculation_type="dflash"``: no head of its own, a block of
    ``block_size`` positions drafted from the target's hidden states at ``target_layer_ids``."""
    config = getattr(drafter, "config", None)
    return (getattr(config, "target_layer_ids", None) is not None and getattr(config, "block_size", None) is not None
            and getattr(config, "mask_token_id", None) is not None)


def mtp_pair(target: nn.Module, state, mtp: nn.Module | None = None, *, observe_topk: int = 3, inductor: bool = True,
             **vocab_options):
    """Compile ``target``'s MTP layers (``MtpModel.from_pretrained(target)``, or ``mtp``) with nanospec in place
    and make ``target.generate(..., use_mtp=True)`` draft with them; ``state``: the ActiveVocab of the target's head
    (``nanospec_fx.attach(target)``), returned. Called by ``nanospec_fx.speculative_pair(target, mtp=True)``.

    The head is found from the model, not by a name: the module of the MTP layers whose weight is the target's
    output embedding (transformers' ``shared_head``, tied to the token embedding or not), see :func:`mtp_head`."""
    mtp = mtp_layers(target, mtp)
    head = mtp_head(mtp, target)
    options = {**vocab_options, "inductor": inductor}
    mtp.compile(backend="nanospec", options={**options, "head": head})
    tokens = MtpTokens(mtp)  # greedy drafting: compiled at its first call
    tokens.compile(backend=without_dead_reads, options={**options, "head": f"mtp.{head}"})
    _drafters(target)["mtp"] = (mtp, state, observe_topk, tokens)
    target._nanospec_mtp = mtp
    return state


def mtp_layers(target: nn.Module, mtp: nn.Module | None = None) -> nn.Module:
    """The MTP layers to draft with, checked: ``mtp`` (an ``MtpModel`` built on ``target``, no deeper than its
    config), or loaded from the target's checkpoint (:func:`load_mtp_layers`). Called before anything is set up, so
    a wrong route leaves the target as it was."""
    from transformers.modeling_layers import MtpModel

    depth = mtp_depth(target)
    if mtp is None:
        return load_mtp_layers(target, depth)
    if not isinstance(mtp, MtpModel):
        raise TypeError(f"mtp= takes True or a transformers.modeling_layers.MtpModel built on the target, "
                        f"got {type(mtp).__name__}")
    if len(mtp.layers) > depth:
        raise ValueError(f"mtp= has {len(mtp.layers)} MTP layers but {type(target).__name__}'s config holds "
                         f"{depth} (num_mtp_layers={depth}): generate(use_mtp=True) drafts num_mtp_layers tokens per "
                         f"round, so build MtpModel(target, {depth}) or set target.config.num_mtp_layers to "
                         f"{len(mtp.layers)} first")
    mtp_head(mtp, target)  # built on this target
    return mtp


def mtp_depth(target: nn.Module) -> int:
    """How many MTP layers ``target``'s config holds (``num_mtp_layers`` of its text config); none is an error
    naming the config (``generate(use_mtp=True)`` needs them too)."""
    config = getattr(target, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    depth = getattr(text, "num_mtp_layers", None)
    if not depth:
        raise ValueError(f"{type(target).__name__}'s config holds no MTP layers (num_mtp_layers={depth!r}): "
                         "generate(use_mtp=True) has nothing to draft with; pair a drafter instead "
                         "(speculative_pair(target, drafter))")
    return depth


def load_mtp_layers(target: nn.Module, depth: int) -> nn.Module:
    """``MtpModel.from_pretrained(target)``, as transformers' MTP candidate generator builds it: the MTP layers'
    weights are read from the checkpoint the target was loaded from (``config.name_or_path``). A target built in
    memory has none: the error says to pass ``mtp=MtpModel(target, depth)`` instead."""
    from transformers.modeling_layers import MtpModel

    source = getattr(target.config, "name_or_path", "") or ""
    route = (f"for a model built in memory pass the layers yourself, with trained weights loaded: "
             f"speculative_pair(target, mtp=MtpModel(target, {depth})) "
             f"(from transformers.modeling_layers import MtpModel)")
    if not source:
        raise ValueError("speculative_pair(target, mtp=True) loads the MTP layers' weights from the checkpoint the "
                         f"target was loaded from, and this {type(target).__name__} has none (config.name_or_path "
                         f"is empty: built in memory, not with from_pretrained); {route}")
    device = next(target.get_decoder().layers[-1].parameters()).device
    try:
        return MtpModel.from_pretrained(target, device_map={"": device}).eval()
    except (OSError, ValueError, RuntimeError, AttributeError) as error:
        raise ValueError(f"speculative_pair(target, mtp=True) could not load the MTP layers from {source!r} "
                         f"({type(error).__name__}: {error}); {route}") from error


def mtp_head(mtp: nn.Module, target: nn.Module) -> str:
    """The module path, in ``mtp``, of the head its logits read: the module holding the target's output embedding
    (``lm_head``, shared with the MTP layers as ``shared_head``; tied to the token embedding or not). Named by its
    module path, as the projection's call is: a tied weight's parameter name is the embedding's in the graph."""
    head = target.get_output_embeddings()
    weight = getattr(head, "weight", None)
    modules = [name for name, module in mtp.named_modules(remove_duplicate=False) if module is head and name]
    if not modules:  # a head module of the MTP layers' own that holds the target's weight
        modules = [name for name, module in mtp.named_modules(remove_duplicate=False)
                   if name and weight is not None and getattr(module, "weight", None) is weight
                   and not isinstance(module, nn.Embedding)]
    if not modules:
        raise ValueError(f"{type(mtp).__name__} holds no module whose weight is the target's output embedding "
                         f"({type(head).__name__}): build it on this target, MtpModel(target, depth)")
    return modules[0]


def dflash_pair(target: nn.Module, drafter: nn.Module, state, *, observe_topk: int = 3, inductor: bool = True,
                **vocab_options):
    """Make ``target.generate(..., assistant_model=drafter, speculation_type="dflash")`` score the drafter's block
    with a compact head (a :class:`SharedHead` over the target's output embedding, compiled in place); the drafter
    itself is left as it is. ``state``: the target head's ActiveVocab, returned. Called by
    ``nanospec_fx.speculative_pair(target, drafter)`` for a DFlash drafter."""
    if not is_dflash_drafter(drafter):
        raise TypeError(f"{type(drafter).__name__} is not a DFlash drafter (its config needs target_layer_ids, "
                        "block_size and mask_token_id)")
    head = SharedHead(target.get_output_embeddings())
    head.compile(backend="nanospec", options={**vocab_options, "inductor": inductor, "head": "head.weight"})
    _drafters(target)["dflash"] = (drafter, head, state, observe_topk)
    return state


def mtp_detach(target: nn.Module) -> None:
    """Undo :func:`mtp_pair` and :func:`dflash_pair`: ``generate`` drafts with uncompiled modules again."""
    for name in ("_get_candidate_generator", "_nanospec_mtp", "_nanospec_drafters"):
        target.__dict__.pop(name, None)


def _drafters(target: nn.Module) -> dict:
    """The shared-head drafters paired with ``target``; the first pair wraps its ``_get_candidate_generator``."""
    if "_nanospec_drafters" not in vars(target):
        target.__dict__["_nanospec_drafters"] = {}
        original = type(target)._get_candidate_generator
        target.__dict__["_get_candidate_generator"] = lambda *a, **k: _candidate_generator(target, original, a, k)
    return target.__dict__["_nanospec_drafters"]


def _candidate_generator(target, original, args, kwargs):
    from transformers.modeling_layers import MtpModel

    drafters = target.__dict__.get("_nanospec_drafters", {})
    mtp = drafters.get("mtp")
    if mtp is None:
        generator = original(target, *args, **kwargs)
    else:  # transformers builds MtpModel.from_pretrained(target): hand it the compiled layers (no second load)
        builder = MtpModel.__dict__["from_pretrained"]

        def reuse(cls, main_model, *a, **k):
            return mtp[0] if main_model is target else builder.__get__(None, cls)(main_model, *a, **k)

        with _LOCK:
            MtpModel.from_pretrained = classmethod(reuse)
            try:
                generator = original(target, *args, **kwargs)
            finally:
                MtpModel.from_pretrained = builder
    dflash = drafters.get("dflash")
    if mtp is not None and getattr(generator, "mtp_model", None) is mtp[0]:
        if _picks_tokens_only(generator, args, kwargs):
            generator.mtp_model = mtp[3]
        _observe_before_drafting(generator, mtp[1], mtp[2], fed=False)
    elif (dflash is not None and getattr(generator, "assistant_model", None) is dflash[0]
          and hasattr(generator, "main_model_output_embeddings")):
        generator.main_model_output_embeddings = dflash[1]
        _observe_before_drafting(generator, dflash[2], dflash[3], fed=True)
    return generator


def _picks_tokens_only(generator, args, kwargs) -> bool:
    """Whether transformers' assisted loop will read only the drafted ids of this generate call: greedy
    (``do_sample`` off) and no ``assistant_ensemble_weight`` (both read the drafted logits)."""
    config = kwargs.get("generation_config", args[0] if args else None)
    return not getattr(generator, "do_sample", True) and getattr(config, "assistant_ensemble_weight", None) is None


def _observe_before_drafting(generator, state, observe_topk: int, fed: bool) -> None:
    """Reset the set (a new generate call: a new request); before each drafting step observe the target's top-k at
    the positions it just verified (one observe per verification) and, with ``fed``, the tokens committed since."""
    state.reset()
    draft, seen = generator.get_candidates, 0

    def get_candidates(input_ids, *a, model_outputs=None, **k):
        nonlocal seen
        if model_outputs is not None:
            if fed and input_ids.shape[1] > seen:
                state.observe(input_ids[:, seen:], validate=False)
                seen = input_ids.shape[1]
            if observe_topk > 0:
                state.observe(model_outputs.logits.topk(observe_topk, dim=-1).indices, validate=False)
        return draft(input_ids, *a, model_outputs=model_outputs, **k)

    generator.get_candidates = get_candidates
