"""Vocabulary-parallel LM heads: each rank projects onto its shard ``[V / tp, H]`` of the head, and the graph either
gathers the slices into ``[..., V]`` or selects on its slice and exchanges (value, id) candidates. Both forms are
recognised exactly and collapsed into one projection onto the whole vocabulary, which ``rewrite_head`` makes
compact; what cannot be proven such a form stays dense with a note saying why.

Modules, each importing only the ones above it:

* ``collectives``     - which nodes are c10d functional collectives; this process's rank in a named group
* ``slices``          - this rank's slice of the logits: its elementwise prefix, shapes compared, graph order
* ``layouts``         - how gathered slices are laid out, followed op by op (``layout_after``)
* ``gather``          - a gather of the slices into ``[..., V]`` (plain collectives or a DTensor head)
* ``exchange_values`` - what an exchange of candidates is (``Exchange``) and the values its recognition follows
* ``id_dtypes``       - which dtypes hold ids and values exactly (ids may travel as floats)
* ``exchange_steps``  - one recogniser per op of an exchange (local selection, offset, pack, pick, lookup)
* ``exchange``        - the exchange followed from the local selection to the pick (``match_exchange``)
* ``collapse``        - either form replaced by one projection onto the whole vocabulary
* ``heads``           - the vocabulary-parallel heads of a graph (``gathered_heads``), collapsed in the backend's copy
* ``observe``         - observers of a replicated state made row fetches from the owner shards
* ``topk``            - a target's top-k over logits that stay sharded, for its observer
"""
