"""FX graph passes of nanospec: find the LM head, rewrite it, observe token inputs.

* ``patterns``       - what is matched and why (projections, post-ops, consumers)
* ``find_head``      - which projection is the LM head
* ``rewrite_head``   - head -> compact logits -> post-ops -> scatter
* ``observe_inputs`` - token ids fed to the drafter join the active vocabulary
"""
from .find_head import HeadMatch, HeadSelectionError, find_heads
from .observe_inputs import insert_observers, token_id_lookups
from .rewrite_head import RewriteReport, StateNodes, rewrite_head

__all__ = [
    "HeadMatch", "HeadSelectionError", "find_heads", "insert_observers", "token_id_lookups",
    "RewriteReport", "StateNodes", "rewrite_head",
]
