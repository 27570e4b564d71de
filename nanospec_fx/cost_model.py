"""A bytes-and-FLOPs model of the LM head, dense vs nanospec, in sympy.

The draft head is memory-bound (a handful of rows against a [V, H] matrix), so its time
follows the bytes it moves. Dense reads the whole weight; nanospec reads the ``active`` rows of
the compact cache, and writes either the [rows, V] logits (when something downstream needs
them) or only [rows, active] compact logits (when top-k / argmax run on them).
Expressions stay symbolic in ``rows`` (dynamic shapes from torch's ShapeEnv) and ``active``.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

rows, active = sympy.symbols("rows active", positive=True, integer=True)


@dataclass(frozen=True)
class HeadCost:
    vocab_size: int
    hidden_size: int
    bytes_per_element: int = 2
    compact_output: bool = False  # consumers read compact logits: no [rows, V] output

    @property
    def dense_bytes(self) -> sympy.Expr:
        V, H, b = self.vocab_size, self.hidden_size, self.bytes_per_element
        return b * (V * H + rows * H + rows * V)

    @property
    def nanospec_bytes(self) -> sympy.Expr:
        V, H, b = self.vocab_size, self.hidden_size, self.bytes_per_element
        out = rows * active if self.compact_output else rows * V
        return b * (active * H + rows * H + out) + 8 * active  # + the int64 slot -> token ids

    @property
    def dense_flops(self) -> sympy.Expr:
        return 2 * rows * self.hidden_size * self.vocab_size

    @property
    def nanospec_flops(self) -> sympy.Expr:
        return 2 * rows * self.hidden_size * active

    @property
    def speedup(self) -> sympy.Expr:
        """Predicted head speedup (bandwidth bound): dense bytes / nanospec bytes."""
        return sympy.simplify(self.dense_bytes / self.nanospec_bytes)

    def predict(self, n_rows: int, n_active: int) -> float:
        return float(self.speedup.subs({rows: n_rows, active: n_active}))

    def break_even_active(self, n_rows: int) -> float:
        """Active-set size at which nanospec moves as many bytes as the dense head."""
        a = sympy.Symbol("a", real=True)  # `active` is an integer symbol; the crossing need not be
        equation = sympy.Eq(self.dense_bytes.subs(rows, n_rows), self.nanospec_bytes.subs({rows: n_rows, active: a}))
        solution = sympy.solve(equation, a)
        return float(solution[0]) if solution else float("inf")
