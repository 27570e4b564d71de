"""transformers' MTP drafting (``generate(use_mtp=True)``) with a compact head, the target left dense.

    state = nanospec_fx.mtp.mtp_pair(target)         # builds and compiles the MTP layers once
    target.generate(ids, use_mtp=True)               # drafting reads compact, verification dense

The MTP layers share the target's ``lm_head`` weight, so they share its ActiveVocab (one state per head
weight). Only the MTP module is compiled with the nanospec backend; the target is not compiled at all:
its top-k at the positions it verified is observed from the outputs transformers hands the MTP generator.
Each ``generate`` call starts from a reset set (one request).
"""
from __future__ import annotations

import threading

import torch.nn as nn

from nanospec_fx.integrations import attach

_LOCK = threading.Lock()


def mtp_pair(target: nn.Module, mtp: nn.Module | None = None, *, observe_topk: int = 3, inductor: bool = True,
             **vocab_options):
    """Compile ``target``'s MTP layers (``MtpModel.from_pretrained(target)``, or ``mtp``) with nanospec in place
    and make ``target.generate(..., use_mtp=True)`` draft with them; returns the head's ActiveVocab."""
    from transformers.modeling_layers import MtpModel

    if mtp is None:
        device = next(target.get_decoder().layers[-1].parameters()).device
        mtp = MtpModel.from_pretrained(target, device_map={"": device}).eval()
    state = attach(target, **vocab_options)
    mtp.compile(backend="nanospec", options={**vocab_options, "inductor": inductor, "head": "shared_head.weight"})
    original = type(target)._get_candidate_generator

    def candidate_generator(*args, **kwargs):
        builder = MtpModel.__dict__["from_pretrained"]

        def reuse(cls, main_model, *a, **k):
            return mtp if main_model is target else builder.__get__(None, cls)(main_model, *a, **k)

        with _LOCK:
            MtpModel.from_pretrained = classmethod(reuse)
            try:
                generator = original(target, *args, **kwargs)
            finally:
                MtpModel.from_pretrained = builder
        if hasattr(generator, "mtp_model"):
            generator.mtp_model = mtp
            state.reset()  # one generate call, one request
            draft = generator.get_candidates

            def get_candidates(*a, model_outputs=None, **k):
                if model_outputs is not None and observe_topk > 0:
                    state.observe(model_outputs.logits.topk(observe_topk, dim=-1).indices, validate=False)
                return draft(*a, model_outputs=model_outputs, **k)

            generator.get_candidates = get_candidates
        return generator

    target._get_candidate_generator = candidate_generator
    target._nanospec_mtp = mtp
    return state


def mtp_detach(target: nn.Module) -> None:
    """Undo :func:`mtp_pair`: ``generate(use_mtp=True)`` builds its own uncompiled MTP layers again."""
    target.__dict__.pop("_get_candidate_generator", None)
    target.__dict__.pop("_nanospec_mtp", None)
