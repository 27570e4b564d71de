"""FX graph passes of nanospec: find the LM head, rewrite it, observe token inputs.

In stage order (each imports only the ones above it; ``tests/test_layout.py`` reads this list and checks it):

* ``graph``             - helpers every pass shares: ``call_arg`` (one index convention), ``node_name`` (the one way
  an op is named), ``where``, ``map_nodes`` (what a pass found, remapped into a copy of the graph, every field)
* ``contract``          - what the passes and the backend hand each other: ``DenseFallback``, ``StateNodes``,
  ``RewriteReport``, ``ObserveInto``
* ``grad_mode``         - whether autograd records where the head runs; inserted ops kept in the mode eager ran them
* ``effects``           - what a node writes and may alias (op schemas); which nodes are known pure
* ``patterns``          - what is matched and why: node values, post-ops, consumers, writes
* ``projections``       - which calls project a hidden state onto a weight (linear, matmul, addmm, bmm, einsum)
* ``stacked_heads``     - Medusa heads stacked in one [K, V, H] weight (one einsum / batched matmul): one set for K
* ``vocab_views``       - views, reshapes and permutations that keep every token's column whole
* ``transforms``        - where the graph runs inside torch.vmap / torch.func transforms (no nanospec op goes there)
* ``lora_delta``        - a LoRA delta on a head (``W(h) + s * B(A(h))``): one head over one set, not two heads
* ``lookups``           - which table rows a graph reads by integer ids (token embeddings, unreadable lookups)
* ``row_weight``        - a head weight computed row by row (quantised, parametrised): only the active rows
* ``find_head``         - which projection is the LM head
* ``graph_position``    - whether a graph is a whole call or a piece of one split by graph breaks
* ``heads_meet``        - where the logits of two heads meet in one op (no one active set is exact there)
* ``region``            - the compact part of a head's vocabulary region, and its materialisation
* ``compact_consumers`` - top-k / argmax read straight from the compact logits
* ``chain_walk``        - one step of the rewrite's walk: what a use of a chain value becomes
* ``rewrite_head``      - head -> compact logits -> post-ops -> scatter
* ``observe_inputs``    - token ids fed to the drafter, and the target's top-k, join the active vocabulary
* ``vocab_parallel``    - vocabulary-parallel heads (a package, its own stage list): gathers and exchanges of the
  logits recognised and collapsed into one projection for ``rewrite_head``

The contract these passes implement (README, "The contract"):

* **Post-op chain.** From the head's ``[..., V]`` output, the maximal run of elementwise ops (in place or
  not, bans written with setitem/masked_fill/index_put/scatter of constants, casts) and of views that keep
  each token's column (flatten, transpose/permute/mT, view(n, -1), reshape, [..., -1], squeeze/unsqueeze,
  contiguous; reshape/flatten/contiguous/casts alias the logits only where eager returns them or a view of them,
  else they are a copy of their own). An op is elementwise only in its elementwise form (``z.max()`` is a
  reduction), and an operand read only for its dtype/device/shape (``bias.type_as(z)``) is not the logits.
  It ends at the first op that is neither: a normalisation (softmax, log_softmax, an elementwise
  op whose other operand is computed from the logits such as ``z - z.logsumexp(...)``), a reduction, a
  selection, sampling or a graph output.
* **Oracle.** The compiled drafter equals the eager dense one in which every chain tensor read by anything
  outside the chain holds -inf at inactive tokens; everything after the chain is plain IEEE arithmetic.
* **Fed ids.** Every id the call looks up in a table with >= V rows is active before any head of the call
  reads the set (ids computed from a head's output: before every later read). Where a pass cannot prove
  this (an unreadable lookup, a graph that is only a piece of the call, a write to the head weight, grad
  mode at a trainable head or at a chain step with an operand that needs gradients, a step on a view it
  cannot map), the head runs dense with one warning. Ids a
  head-less whole call (a prefill) looks up are kept with their table and the call's other parameters and
  buffers (``nanospec_fx.vocab.prefill``), and observed by each head of a graph that looks up that table and receives
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
