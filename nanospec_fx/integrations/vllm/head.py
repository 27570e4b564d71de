"""The drafter's ``compute_logits`` over per-request active sets, engine-agnostic.

:class:`NanoSpecHead` takes plain values (the head's weight, the logits post-ops, the dense ``compute_logits`` to
fall back on) and a :class:`~nanospec_fx.vocab.request_vocab.RequestVocabs` built from the core's ``VocabConfig``; the
version adapters (``v0_32``, ``v0_33``, ``v0_34``) read them off vLLM's objects. For Model Runner V2, whose draft
loop runs in a captured CUDA graph, :class:`CompactLMHead` takes the drafter's ``lm_head`` slot instead and finds
each batch row's request on the device (:class:`SlotRows`). No vLLM here.
"""
from __future__ import annotations

import torch

from nanospec_fx.integrations.vllm.config import Settings
from nanospec_fx.integrations.vllm.metrics import warn

#: the one row every request shares under the static policy (never a vLLM request id)
STATIC_ROW = ("nanospec", "static")


def build_vocabs(weight, settings: Settings, vocab_size: int, shard=None):
    """The per-request sets over ``weight`` (its first ``vocab_size`` rows are the vocabulary; under tensor
    parallelism: this rank's shard, ``shard`` its :class:`~nanospec_fx.parallel.collectives.VocabShard`). The static
    policy gets one frozen row that every request reads."""
    from nanospec_fx.compiler.head_kind import request_vocabs
    from nanospec_fx.vocab.policies import resolve

    state = resolve(settings.vocab).keywords()
    max_requests = 1 if state["policy"] == "static" else settings.max_requests
    vocabs = request_vocabs(weight, max_requests, vocab_size, shard, **state)  # the head kind's: replicated if sharded
    if state["policy"] == "static":
        vocabs.assign(STATIC_ROW)
    return vocabs


def predicted_speedup(weight, vocab_rows: int, capacity: int) -> float:
    """The cost model's full-head time / compact-head time for one draft row with a full set of ``capacity`` tokens
    (:mod:`nanospec_fx.diagnostics.cost_model`, with the constants of the implementation that runs on ``weight``'s
    device).
    Below 1 the compact head cannot win: a small head (a few thousand rows) is cheaper to read whole than to
    serve per request."""
    from nanospec_fx.diagnostics.cost_model import HeadCost
    from nanospec_fx.kernels.dispatch import path_for

    active = min(capacity, vocab_rows)
    cost = HeadCost.for_path(vocab_rows, int(weight.shape[1]), weight.element_size(), False, path_for(weight.device),
                             active)
    return cost.predict(1, active)


class NanoSpecHead:
    """``compute_logits`` over per-request active sets: row ``i`` of the hidden states against the set of the
    request at batch row ``i`` (:attr:`rows`, set by the adapter for each draft step), ``-inf`` elsewhere.

    ``prepare``: what the drafter's ``compute_logits`` applies to the hidden states before the head (MTP layers whose
    ``shared_head`` norms them first: DeepSeek-V3, GLM-4-MoE), None when the head reads them as they come. A parallel
    drafter (DFlash: ``parallel`` set) scores its K positions of every request in one call, request-major: ``B*K``
    rows for ``B`` requests, each request's row repeated K times.

    Outside a draft step (``rows`` unset, e.g. warm-up), with an unexpected row count, or after the first compact
    call differed from ``dense_compute_logits`` (a model whose logits are more than its head), the call runs
    ``dense_compute_logits``: exact, counted in ``dense_calls``. Counters (plain ints, read by tests and metrics):
    ``compact_calls``, ``dense_calls``, ``assigned`` and ``released`` (request rows); with ``settings.record``,
    ``released_sets`` and ``active_sizes`` keep each released request's active token ids and their number.
    """

    def __init__(self, vocabs, dense_compute_logits, settings: Settings, *, scale: float = 1.0, soft_cap=None,
                 logits_dtype=None, target_vocab_size: int, name: str = "drafter", group_name: str | None = None,
                 rank: int = 0, prepare=None, parallel: bool = False):
        import torch

        self.vocabs = vocabs
        self.static = vocabs.policy == "static"  # one shared, frozen row: every request's set is the list
        d2t = settings.vocab.draft_to_target
        self.draft_to_target = None if d2t is None else torch.as_tensor(d2t).to(vocabs.device)
        self.target_vocab_size = target_vocab_size
        self.scale, self.soft_cap, self.head_dtype = scale, soft_cap, logits_dtype
        self.dense_compute_logits = dense_compute_logits
        self.model_name = name
        self.group_name, self.rank = group_name, rank
        self.topk = settings.topk
        self.rows = None  # batch row -> request row for the drafter calls of the current step
        self.prepare, self.parallel = prepare, parallel
        self.compact_calls = self.dense_calls = self.assigned = self.released = 0
        self.checked = False  # the first compact call is compared with the dense compute_logits
        self.disabled = False  # it differed: the full head from then on
        self.record, self.record_dir = settings.record, settings.record_dir
        self.released_sets: dict[str, list[int]] = {}
        self.active_sizes: list[int] = []  # |A| of each request at release (metrics)

    # ----------------------------------------------------------------- compute_logits
    def __call__(self, hidden_states, *args, **kwargs):
        rows = self.rows_of_call(hidden_states)
        if rows is None or self.disabled or args or kwargs:
            if self.rows is not None and not self.disabled:
                warn(f"the drafter's compute_logits got {tuple(hidden_states.shape)} rows for a batch of "
                     f"{self.rows.numel()} requests; this call uses the full head (exact, not compact)")
            self.dense_calls += 1
            return self.dense_compute_logits(hidden_states, *args, **kwargs)
        logits = self._compact(hidden_states, rows)
        if not self.checked:
            self.checked = True
            dense = self.dense_compute_logits(hidden_states)  # under tensor parallelism: gathered, on every rank
            same = here = same_where_active(logits, dense)
            if self.group_name is not None:  # one decision for all ranks, or their next collectives would differ
                from nanospec_fx.parallel.consensus import all_ranks

                same = all_ranks(self.group_name, here, logits.device)
            if not same:
                self.disabled = True
                warn(f"another tensor-parallel rank found that {self.model_name}'s compute_logits differs from its "
                     "compact head: every rank keeps the full head (output unchanged)" if here else
                     f"{self.model_name}'s compute_logits computes more than vLLM's logits processor over the head "
                     "(a bias, a post-op or another head): the drafter keeps its full head (output unchanged)")
                self.dense_calls += 1
                return dense
        self.compact_calls += 1
        return logits

    def rows_of_call(self, hidden_states):
        """The request row of each row of ``hidden_states`` (None: this call cannot be served compact). One row per
        request; a parallel drafter's ``B*K`` rows, request-major, repeat each request's row K times."""
        rows = self.rows
        if rows is None or hidden_states.dim() != 2 or rows.numel() == 0:
            return None
        n, m = hidden_states.shape[0], rows.numel()
        if n == m:
            return rows
        if self.parallel and n % m == 0:
            return rows.repeat_interleave(n // m)
        return None

    def _compact(self, hidden_states, rows):
        if self.prepare is not None:
            hidden_states = self.prepare(hidden_states)
        x = hidden_states.to(self.vocabs.weight.dtype)
        logits = self.vocabs.logits(x, rows)
        if self.soft_cap is not None:  # vLLM's LogitsProcessor post-ops, keeping -inf at inactive tokens
            inactive = logits.isneginf()
            logits = (self.soft_cap * (logits / self.soft_cap).tanh()).masked_fill(inactive, float("-inf"))
        if self.scale != 1.0:
            logits = logits * self.scale
        logits = logits.to(self.head_dtype or hidden_states.dtype)
        if self.draft_to_target is None:
            return logits
        # EAGLE-3: vLLM's drafter returns logits over the target vocabulary, -inf outside the draft vocabulary.
        full = logits.new_full((logits.shape[0], self.target_vocab_size), float("-inf"))
        full[:, self.draft_to_target] = logits
        return full

    # ----------------------------------------------------------------- request rows
    def sync_rows(self, req_ids: list, seen_tokens) -> list | None:
        """Give every request of the batch a row, seeded with ``seen_tokens(rid)`` (its prompt and outputs, or
        None); return ``req_ids``, or None when the rows ran out (the step runs dense). Static policy: nothing to
        assign, every request reads the shared row."""
        from nanospec_fx.integrations.vllm.config import ENV_MAX_REQUESTS

        if self.static:
            return req_ids
        for rid in req_ids:
            if rid in self.vocabs:
                continue
            if self.vocabs.free_rows == 0:
                warn(f"{len(req_ids)} requests in the batch but {self.vocabs.max_requests} request rows "
                     f"({ENV_MAX_REQUESTS}); such steps use the full head (exact, not compact)")
                return None
            self.vocabs.assign(rid)
            self.assigned += 1
            seen = seen_tokens(rid)
            if seen:
                self.vocabs.observe(rid, seen, validate=False)
        return req_ids

    def rows_for(self, req_ids: list):
        """The request row of each batch row (static policy: the shared row for all)."""
        return self.vocabs.rows_for([STATIC_ROW] * len(req_ids) if self.static else req_ids)

    def release(self, rid) -> None:
        if rid not in self.vocabs or rid == STATIC_ROW:
            return
        if self.record:  # reads the set on the host: a device sync, so only when asked for
            self.released_sets[rid] = sorted(self.vocabs.token_ids(rid).tolist())
            self.active_sizes.append(self.vocabs.active_count(rid))
        self.vocabs.release(rid)
        self.released += 1


def same_where_active(compact, dense) -> bool:
    """Whether the compact logits equal the full ones at every active token (within the dtype's tolerance);
    elsewhere they are -inf by construction."""
    import torch

    if compact.shape != dense.shape:
        return False
    active = torch.isfinite(compact)
    ours, theirs = compact[active].float(), dense[active].float()
    tol = 1e-3 if compact.dtype == torch.float32 else 3e-2
    scale = float(theirs.abs().max()) if theirs.numel() else 1.0
    return bool(torch.allclose(ours, theirs, rtol=tol, atol=tol * max(1.0, scale)))


# --------------------------------------------------------------------------- Model Runner V2 (vLLM 0.33, 0.34)
#: the request id of the empty row that padded batch rows of a V2 step read (never a vLLM request id)
PAD_ROW = ("nanospec", "padding")


class SlotRows:
    """An engine's request slots -> :class:`~nanospec_fx.vocab.request_vocab.RequestVocabs` rows, as a device tensor.

    vLLM's Model Runner V2 names each request of a step by its request-state slot (``idx_mapping``, a device buffer,
    -1 for a padded row) and runs the draft loop inside a captured CUDA graph, so the row of each batch row must be
    found on the device: ``rows(slots)`` is one gather from :attr:`map`, whose last entry (the one -1 reads) points
    at an empty row reserved for padding. :meth:`add` and :meth:`remove` run on the host between steps (one small
    host-to-device write each); :meth:`observe` is device ops only (no host read)."""

    def __init__(self, vocabs, num_slots: int):
        import torch

        if vocabs.max_requests < num_slots + 1:
            raise ValueError(f"{num_slots} request slots need {num_slots + 1} request rows (one for padding), "
                             f"got {vocabs.max_requests}")
        self.vocabs = vocabs
        self.pad = vocabs.assign(PAD_ROW)  # stays empty: nothing is observed into it
        self.map = torch.full((num_slots + 1,), self.pad, dtype=torch.int64, device=vocabs.device)
        self.request_of: dict[int, object] = {}

    def add(self, slot: int, request_id, seen=None) -> None:
        """Request ``request_id`` took slot ``slot``: give it a row, seeded with ``seen`` (its prompt) if any."""
        if slot in self.request_of:
            self.remove(slot)
        row = self.vocabs.assign(request_id)
        self.map[slot] = row
        self.request_of[slot] = request_id
        if seen is not None and len(seen):
            self.vocabs.observe(request_id, seen, validate=False)

    def remove(self, slot: int) -> None:
        request_id = self.request_of.pop(slot, None)
        if request_id is not None:
            self.vocabs.release(request_id)
        self.map[slot] = self.pad

    def rows(self, slots):
        """int64 rows of the batch rows named by ``slots`` (-1: padding -> the empty row). Device ops only."""
        return self.map[slots.long()]

    def observe(self, slots, tokens, valid=None) -> None:
        """``tokens [B, n]`` (or ``[B]``) join the sets of the requests in ``slots [B]``; -1 ids, entries where
        ``valid`` is False, and padded rows (slot -1) join nothing. Device ops only."""
        import torch

        slots = slots.long()
        tokens = tokens.long().reshape(slots.numel(), -1)
        if valid is not None:
            tokens = tokens.masked_fill(~valid.reshape(tokens.shape), -1)
        rows = torch.where(slots >= 0, self.map[slots.clamp(min=0)], torch.full_like(slots, -1))
        self.vocabs.observe_rows(rows, tokens)


class _CompactApply:
    """The ``quant_method`` of :class:`CompactLMHead`: vLLM's ``LogitsProcessor`` computes a head's logits as
    ``lm_head.quant_method.apply(lm_head, hidden_states, bias=...)``."""

    def __init__(self, head: CompactLMHead):
        self.head = head

    def apply(self, layer, x, bias=None):
        return self.head.logits(x, bias)


class CompactLMHead(torch.nn.Module):
    """A module for a drafter's ``lm_head`` slot that vLLM's ``LogitsProcessor`` reads as it reads the
    ``ParallelLMHead`` it replaces (as vLLM's own quantized draft head does): ``quant_method.apply``, ``weight``,
    ``tp_size``, ``shard_indices``, ``org_vocab_size``, ``num_embeddings_per_partition``. Its logits are each batch
    row's request's compact head, -inf elsewhere (vocabulary padding columns included): the rows come from ``slots``
    (the engine's per-step device buffer of request slots, read at call time: V2's ``speculator.idx_mapping``)
    through ``slot_rows``, so a captured graph replays with the step's requests. A parallel drafter's
    ``B * positions_per_request`` rows are request-major. The target's head is untouched (it verifies dense)."""

    def __init__(self, source, vocabs, slot_rows: SlotRows, slots, positions_per_request: int = 1):
        super().__init__()
        self.weight = source.weight  # shared, not copied (LogitsProcessor reads its dtype and device)
        self.tp_size, self.tp_rank = 1, 0
        self.org_vocab_size = int(getattr(source, "org_vocab_size", source.weight.shape[0]))
        self.num_embeddings_per_partition = int(source.weight.shape[0])
        self.embedding_dim = int(source.weight.shape[1])
        self.shard_indices = getattr(source, "shard_indices", None)
        self.quant_method = _CompactApply(self)
        self.vocabs, self.slot_rows, self.slots = vocabs, slot_rows, slots
        self.positions_per_request = positions_per_request
        self.compact_calls = self.dense_calls = 0  # Python-side: under a captured graph, counted at capture

    def logits(self, x, bias=None):
        n, k = (x.shape[0] if x.dim() == 2 else -1), self.positions_per_request
        if bias is not None or x.dim() != 2 or n % k or n // k > self.slots.numel():
            self.dense_calls += 1  # a shape-static decision: the same on every replay of a captured graph
            return torch.nn.functional.linear(x, self.weight, bias)
        slots = self.slots[: n // k]
        if k > 1:
            slots = slots.repeat_interleave(k)
        out = self.vocabs.logits(x.to(self.weight.dtype), self.slot_rows.rows(slots)).to(x.dtype)
        pad = self.num_embeddings_per_partition - out.shape[-1]  # vocabulary padding rows: never a token
        if pad:
            out = torch.nn.functional.pad(out, (0, pad), value=float("-inf"))
        self.compact_calls += 1
        return out
