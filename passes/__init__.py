"""FX graph passes of nanospec: find the LM head, rewrite it, observe token inputs.

In stage order (each imports only the ones above it):

* ``graph``          - helpers every pass shares: ``call_arg`` (one index convention), ``node_name``, ``where``
* ``contract``       - what the passes and the backend hand each other: ``DenseFallback``, ``StateNodes``,
  ``RewriteReport``, ``ObserveInto``
* ``patterns``       - what is matched and why (projections, post-ops, views, consumers)
* ``lookups``        - which table rows a graph reads by integer ids (token embeddings, unreadable lookups)
* ``find_head``      - which projection is the LM head
* ``row_weight``     - a head weight computed row by row (quantised, parametrised): only the active rows
* ``rewrite_head``   - head -> compact logits -> post-ops -> scatter
* ``observe_inputs`` - token ids fed to the drafter, and the target's top-k, join the active vocabulary
* ``graph_position`` - whether a graph is a whole call or a piece of one split by graph breaks
* ``heads_meet``     - where the logits of two heads meet in one op (no one active set is exact there)
* ``grad_mode``      - whether autograd records where the head runs; inserted ops kept in the mode eager ran them
* ``effects``        - what a node writes and may alias (op schemas); which nodes are known pure
* ``transforms``     - where the graph runs inside torch.vmap / torch.func transforms (no nanospec op goes there)
* ``vocab_parallel`` - vocabulary-parallel heads: the gather of the logits recognised and collapsed
* ``vocab_parallel_select`` - a local max/top-k whose (value, id) candidates are exchanged: a top-k of the full logits
* ``vocab_parallel_heads`` - the vocabulary-parallel heads of a graph (either form), collapsed for ``rewrite_head``

The contract these passes implement (README, "The contract"):

* **Post-op chain.** From the head's ``[..., V]`` output, the maximal run of elementwise ops (in place or
  not, bans written with setitem/masked_fill/index_put/scatter of constants, casts) and of views that keep
  each token's column (flatten, transpose/permute/mT, view(n, -1), reshape, [..., -1], squeeze/unsqueeze,
  contiguous). It ends at the first op that is neither: a normalisation (softmax, log_softmax, an elementwise
  op whose other operand is computed from the logits such as ``z - z.logsumexp(...)``), a reduction, a
  selection, sampling or a graph output.
* **Oracle.** The compiled drafter equals the eager dense one in which every chain tensor read by anything
  outside the chain holds -inf at inactive tokens; everything after the chain is plain IEEE arithmetic.
* **Fed ids.** Every id the call looks up in a table with >= V rows is active before any head of the call
  reads the set (ids computed from a head's output: before every later read). Where a pass cannot prove
  this (an unreadable lookup, a graph that is only a piece of the call, a write to the head weight, grad
  mode at a trainable head, a step on a view it cannot map), the head runs dense with one warning. Ids a
  head-less whole call (a prefill) looks up are kept with their table and the call's other parameters and
  buffers (``nanospec_fx.prefill``), and observed by each head of a graph that looks up that table and receives
  all of those (the same model). A lookup's ids are observed only when all of them are rows it reads (a call
  that raises on a bad id observes nothing).
"""
from .contract import DenseFallback, DenseHead, ObserveInto, RewriteReport, StateNodes
from .find_head import HeadMatch, HeadSelectionError, find_heads
from .grad_mode import grad_enabled_at, grad_modes, keep_grad_modes
from .graph_position import GraphPosition, graph_position
from .heads_meet import find_meetings
from .lookups import token_id_lookups, unobserved_lookup
from .observe_inputs import insert_input_observers, insert_observe, insert_topk_observers, snapshot_state_reads
from .rewrite_head import rewrite_head

__all__ = [
    "HeadMatch", "HeadSelectionError", "find_heads", "ObserveInto", "insert_input_observers", "insert_observe",
    "insert_topk_observers", "snapshot_state_reads", "token_id_lookups", "DenseFallback", "DenseHead",
    "RewriteReport", "StateNodes", "rewrite_head", "grad_enabled_at", "grad_modes", "keep_grad_modes", "GraphPosition",
    "graph_position",
    "unobserved_lookup", "find_meetings",
]
