"""Tensor parallelism at run time: the replicated compact row cache of a vocabulary-parallel head, the
collectives it runs and what the ranks agree on before running them."""
