"""FX graph passes of nanospec: find the LM head, rewrite it, observe token inputs.

* ``patterns``       - what is matched and why (projections, post-ops, consumers)
* ``find_head``      - which projection is the LM head
* ``rewrite_head``   - head -> compact logits -> post-ops -> scatter
* ``observe_inputs`` - token ids fed to the drafter, and the target's top-k, join the active vocabulary
"""
from .find_head import HeadMatch, HeadSelectionError, find_heads
from .observe_inputs import (
    ObserveInto, insert_input_observers, insert_observe, insert_topk_observers, snapshot_state_reads, token_id_lookups,
)
from .rewrite_head import DenseFallback, RewriteReport, StateNodes, rewrite_head

__all__ = [
    "HeadMatch", "HeadSelectionError", "find_heads", "ObserveInto", "insert_input_observers", "insert_observe",
    "insert_topk_observers", "snapshot_state_reads", "token_id_lookups", "DenseFallback",
    "RewriteReport", "StateNodes", "rewrite_head",
]
