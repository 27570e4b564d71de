"""Evaluation of nanospec on real models and text: the ``nanospec-fx`` CLI, benchmarks, coverage,
model/corpus loaders and bundled data. Needs the ``[eval]`` extra; the runtime never imports it."""
