"""The vocabulary state: one head's active set (shared or per request), its slot policy, its options,
and how a model's head finds its state."""
