"""Tensor-parallel drafters: the public names of the replicated compact row cache of a vocabulary-parallel LM head.

A vocabulary-parallel head holds ``V / tp`` rows of the head on each rank; the dense drafter computes its slice of
the logits and all-gathers ``[..., V]`` at every draft step. Compiled with ``backend="nanospec"``, every rank keeps
the *same* active set and *all* active rows, and computes the whole compact head locally: **no logits collective**
(docs/tensor-parallel.md). The parts, each in its own module:

* :mod:`nanospec_fx.collectives`: which rows this rank holds (:class:`VocabShard`) and the checked row fetch (one
  all-reduce carrying the check that every rank fetched the same ids; :class:`RanksDiverged` on every rank if not);
* :mod:`nanospec_fx.consensus`: what a rank decides alone before a collective (a compile, a refresh), agreed through
  the group's store with a timeout (:func:`agree`, :func:`store_exchange`, :func:`all_ranks`);
* :mod:`nanospec_fx.sharded_state`: the replicated states (:class:`ShardedActiveVocab`,
  :class:`ShardedRequestVocabs`);
* ``passes/vocab_parallel/observe.py``: a compiled graph's observers of such a state, as row fetches;
* :mod:`nanospec_fx.compiler.head_kind`: what the backend does for such a head, in one place.
"""
from __future__ import annotations

from nanospec_fx.collectives import (
    CHECK_COLUMNS, ID_LIMBS, RanksDiverged, VocabShard, agree_on_count, fetch_bias, fetch_checked, fetch_rows,
    local_shard, raise_if_diverged, resolve_group, state_digest,
)
from nanospec_fx.consensus import FAILURE_KEY, agree, all_ranks, explain_failure, store_exchange
from nanospec_fx.sharded_state import (
    AgreesOnRanks, ShardedActiveVocab, ShardedRequestVocabs, fetch_observed, sharded_state_for, write_observed,
    write_request_rows, write_rows, write_slots,
)

__all__ = [
    "CHECK_COLUMNS", "FAILURE_KEY", "ID_LIMBS", "AgreesOnRanks", "RanksDiverged", "ShardedActiveVocab",
    "ShardedRequestVocabs", "VocabShard", "agree", "agree_on_count", "all_ranks", "explain_failure", "fetch_bias",
    "fetch_checked", "fetch_observed", "fetch_rows", "local_shard", "raise_if_diverged", "resolve_group",
    "sharded_state_for", "state_digest", "store_exchange", "write_observed", "write_request_rows", "write_rows",
    "write_slots",
]
