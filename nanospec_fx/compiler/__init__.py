"""The compiler: the ``nanospec`` torch.compile backend, in the order it works.

``backend`` (the entry) -> ``options`` (the ``options={...}`` parsed) -> ``plan`` (every decision, as data: which
heads, rewritten or dense and why - ``find``, ``decisions``, ``head_kind``) -> ``execute`` (the plan carried out:
``stages`` rewrite the graph, ``lowering`` hands it to inductor, ``headless`` and ``target`` for graphs without a
head to rewrite and for a target observer) -> ``runtime`` (what runs at every call). ``head_kind`` is the one seam
with tensor parallelism; ``draft_vocab`` names an EAGLE-3 draft vocabulary no option names.
"""
