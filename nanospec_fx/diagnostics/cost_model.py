"""A bytes-and-FLOPs model of the LM head, dense vs nanospec, in sympy.

The draft head is memory-bound (a handful of rows against a [V, H] matrix), so its time
follows the bytes it moves. Dense reads the whole weight. nanospec reads the cached rows that its
implementation (``path``) actually computes - Triton: the ``active`` ones (tiles past the count are
skipped); the CPU host path: ``bucket(active)`` of them (:func:`nanospec_fx.kernels.host.bucket`);
the device-side torch reference: all ``capacity`` rows - and writes either the [rows, V] logits
(when something downstream needs them) or only the [rows, C] compact logits (top-k / argmax run on
them). Times are counted in bytes at the bandwidth the compact head streams with: nanospec costs
``fixed + bytes`` (a call's fixed cost - dispatch, launches, a few small ops, cold caches - that no
byte count sees), dense ``max(bytes / efficiency, FLOPs / flops_per_byte)`` (a CPU's dense
few-row product streams below that bandwidth and turns compute-bound from a few rows on); the
constants are per implementation (:data:`MACHINE`). Expressions stay symbolic in ``rows``
(dynamic shapes from torch's ShapeEnv) and ``active``.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

rows, active = sympy.symbols("rows active", positive=True, integer=True)
bucket = sympy.Function("bucket")  # the host path's computed rows for `active` (kernels.host.bucket)

PATHS = ("triton", "host", "reference")

#: Per implementation: (a nanospec head call's fixed cost in bytes, the dense head's bandwidth
#: efficiency, the dense head's FLOPs per byte when compute-bound, None: never).
#: host / reference: fitted to the head benchmark on the 2-core CPU test machine, fp32, one thread,
#: cold caches, 1 and 4 rows (docs/kernels.md, "CPU cost follows |A|"): ~0.24 ms fixed at the
#: ~13 GB/s the compact head streams; the dense sgemv streams at 60% of that (~8 GB/s) and the
#: 4-row dense product is compute-bound (~7 GFLOP/s). triton: *assumed*, not measured (no GPU
#: timing yet): ~3 launches of ~5 us at ~4 TB/s; the dense head bandwidth-bound like the kernels.
MACHINE: dict[str, tuple[int, float, float | None]] = {
    "host": (3_100_000, 0.6, 0.725),
    "reference": (3_100_000, 0.6, 0.725),
    "triton": (60_000_000, 1.0, None),
}


@dataclass(frozen=True)
class HeadCost:
    vocab_size: int
    hidden_size: int
    bytes_per_element: int = 2
    compact_output: bool = False  # consumers read compact logits: no [rows, V] output
    path: str = "triton"  # the implementation that runs the ops (nanospec_fx.kernels.dispatch.path_for)
    capacity: int | None = None  # C: the reference computes all of it, compact outputs are [rows, C]
    fixed_bytes: int = 0  # a nanospec call's fixed cost, as bytes (MACHINE[path] for a real head)
    dense_efficiency: float = 1.0  # the dense head's bandwidth relative to the compact head's
    dense_flops_per_byte: float | None = None  # a matmul turns compute-bound at this (dense and compact); None: never

    @classmethod
    def for_path(cls, vocab_size: int, hidden_size: int, bytes_per_element: int, compact_output: bool, path: str,
                 capacity: int, machine=None) -> "HeadCost":
        """The model of a head run by ``path`` (kernels.dispatch.path_for), with that path's :data:`MACHINE`
        constants, or ``machine``'s (a :class:`nanospec_fx.diagnostics.calibration.MachineConstants` measured here)."""
        constants = MACHINE[path] if machine is None else (
            machine.fixed_bytes, machine.dense_efficiency, machine.dense_flops_per_byte)
        return cls(vocab_size, hidden_size, bytes_per_element, compact_output, path, capacity, *constants)

    def __post_init__(self):
        if self.path not in PATHS:
            raise ValueError(f"path must be one of {PATHS}, got {self.path!r}")

    @property
    def computed_rows(self) -> sympy.Expr:
        """Cached rows the head multiplies, as a function of ``active``."""
        if self.path == "host":
            return bucket(active)
        if self.path == "reference" and self.capacity is not None:
            return sympy.Integer(self.capacity)
        return active

    @property
    def dense_bytes(self) -> sympy.Expr:
        V, H, b = self.vocab_size, self.hidden_size, self.bytes_per_element
        return b * (V * H + rows * H + rows * V)

    def _nanospec_bytes(self, computed: sympy.Expr, n_active: sympy.Expr) -> sympy.Expr:
        V, H, b = self.vocab_size, self.hidden_size, self.bytes_per_element
        out = rows * (self.capacity if self.capacity is not None else n_active) if self.compact_output else rows * V
        return b * (computed * H + rows * H + out) + 8 * n_active  # + the int64 slot -> token ids

    @property
    def nanospec_bytes(self) -> sympy.Expr:
        return self._nanospec_bytes(self.computed_rows, active)

    @property
    def dense_flops(self) -> sympy.Expr:
        return 2 * rows * self.hidden_size * self.vocab_size

    @property
    def nanospec_flops(self) -> sympy.Expr:
        return 2 * rows * self.hidden_size * self.computed_rows

    @property
    def dense_time(self) -> sympy.Expr:
        """Dense head time, in bytes at the compact head's bandwidth."""
        streamed = self.dense_bytes / sympy.nsimplify(self.dense_efficiency)
        if self.dense_flops_per_byte is None:
            return streamed
        return sympy.Max(streamed, self.dense_flops / sympy.nsimplify(self.dense_flops_per_byte))

    @property
    def nanospec_time(self) -> sympy.Expr:
        """nanospec head time, in bytes: the fixed cost of each op call plus the bytes moved, or, where the
        few-row product is compute-bound on this machine (``dense_flops_per_byte``: a CPU's skinny matmul), its
        FLOPs."""
        fixed = self.fixed_bytes * self.op_calls
        if self.dense_flops_per_byte is None:
            return fixed + self.nanospec_bytes
        return fixed + sympy.Max(self.nanospec_bytes, self.nanospec_flops / sympy.nsimplify(self.dense_flops_per_byte))

    @property
    def op_calls(self) -> int:
        """nanospec op calls per head call, each paying the fixed cost: the compact head, and the scatter to
        [rows, V] when something reads the full logits."""
        return 1 if self.compact_output else 2

    @property
    def speedup(self) -> sympy.Expr:
        """Predicted head speedup: dense time / nanospec time (without a fixed cost or a FLOP bound:
        dense bytes / nanospec bytes)."""
        return sympy.simplify(self.dense_time / self.nanospec_time)

    def _at(self, expr: sympy.Expr, n_active: int) -> sympy.Expr:
        if self.path == "host":
            from nanospec_fx.kernels.host import bucket as host_bucket

            expr = expr.subs(bucket(active), host_bucket(n_active, self.capacity or n_active))
        return expr.subs(active, n_active)

    def predict(self, n_rows: int, n_active: int) -> float:
        """Predicted dense time / nanospec time for ``n_rows`` rows and ``n_active`` active tokens."""
        return float(self._at(self.dense_time / self.nanospec_time, n_active).subs(rows, n_rows))

    def break_even_active(self, n_rows: int) -> float:
        """Active-set size at which nanospec moves as many bytes as the dense head."""
        a = sympy.Symbol("a", real=True)  # `active` is an integer symbol; the crossing need not be
        computed = a if self.path == "host" else self.computed_rows.subs(active, a)  # host: the bucket, within 25%
        nanospec = self._nanospec_bytes(computed, a).subs(rows, n_rows)
        solution = sympy.solve(sympy.Eq(self.dense_bytes.subs(rows, n_rows), nanospec), a)
        return float(solution[0]) if solution else float("inf")


# ----------------------------------------------------------------------------- tensor parallelism
tp, fed = sympy.symbols("tp fed", positive=True, integer=True)  # ranks; token ids a draft step observes
alpha, link, hbm = sympy.symbols("alpha link hbm", positive=True)  # s per ring step; bytes/s per direction; HBM B/s

#: Published figures, used as a model (not a measurement): HBM bandwidth per GPU, and NVLink 4's 900 GB/s per
#: GPU (450 GB/s each way). The latency per ring step ``alpha`` is an assumption (NCCL's tree and low-latency
#: protocols do better on small messages).
GPU_HBM: dict[str, float] = {"H100 SXM (3.35 TB/s)": 3.35e12, "H200 (4.8 TB/s)": 4.8e12}
NVLINK4 = 450e9
ALPHA = 5e-6


@dataclass(frozen=True)
class CollectiveCost:
    """An alpha-beta model of one draft step of a vocabulary-parallel head over ``tp`` ranks, in seconds.

    Dense tensor-parallel head: each rank reads its shard (``V / tp`` rows) from HBM, then a ring all-gather of the
    ``[rows, V]`` logits: ``(tp - 1)`` steps of ``alpha`` plus ``(tp - 1) / tp`` of the payload over the link.
    nanospec: each rank reads the compact cache (``C`` rows), plus the observers' ring all-reduce of the rows of
    the ``fed`` ids the step embeds (``[fed, H]``: ``2 (tp - 1)`` steps); ``nanospec_outside``: the ids observed
    outside the draft step (``observe_inputs=False``), no collective at all. Symbols: :data:`tp`, :data:`rows`,
    :data:`fed`, :data:`alpha`, :data:`link`, :data:`hbm`."""

    vocab_size: int
    hidden_size: int
    capacity: int
    bytes_per_element: int = 2

    @property
    def shard_read(self) -> sympy.Expr:
        return sympy.Integer(self.vocab_size) / tp * self.hidden_size * self.bytes_per_element / hbm

    @property
    def all_gather(self) -> sympy.Expr:
        return (tp - 1) * alpha + (tp - 1) / tp * rows * self.vocab_size * self.bytes_per_element / link

    @property
    def cache_read(self) -> sympy.Expr:
        return sympy.Integer(self.capacity * self.hidden_size * self.bytes_per_element) / hbm

    @property
    def all_reduce(self) -> sympy.Expr:
        return 2 * (tp - 1) * alpha + 2 * (tp - 1) / tp * fed * self.hidden_size * self.bytes_per_element / link

    @property
    def dense(self) -> sympy.Expr:
        return self.shard_read + self.all_gather

    @property
    def nanospec(self) -> sympy.Expr:
        return self.cache_read + self.all_reduce

    @property
    def nanospec_outside(self) -> sympy.Expr:
        return self.cache_read

    def at(self, expr: sympy.Expr, **values: float) -> float:
        """``expr`` in seconds at the given symbol values (``tp=2, rows=10, fed=10, hbm=..., link=..., alpha=...``)."""
        names = {"tp": tp, "rows": rows, "fed": fed, "alpha": alpha, "link": link, "hbm": hbm}
        return float(expr.subs({names[k]: v for k, v in values.items()}))

    def table(self, n_rows: int, n_fed: int, tps=(2, 4, 8), gpus: dict | None = None, alpha_s: float = ALPHA,
              link_bytes: float = NVLINK4) -> list[str]:
        """A markdown table of the model in microseconds, per GPU and tp."""
        lines = ["| GPU (HBM) | tp | dense: shard read + all-gather | nanospec: cache read + fed-id all-reduce | "
                 "nanospec, ids observed outside the step |", "|---|---|---|---|---|"]
        for gpu, bandwidth in (gpus or GPU_HBM).items():
            for t in tps:
                v = dict(tp=t, rows=n_rows, fed=n_fed, alpha=alpha_s, link=link_bytes, hbm=bandwidth)
                read, gather = self.at(self.shard_read, **v) * 1e6, self.at(self.all_gather, **v) * 1e6
                cache, reduce = self.at(self.cache_read, **v) * 1e6, self.at(self.all_reduce, **v) * 1e6
                lines.append(f"| {gpu} | {t} | {read:.1f} + {gather:.1f} = {read + gather:.1f} us | "
                             f"{cache:.1f} + {reduce:.1f} = {cache + reduce:.1f} us | {cache:.1f} us |")
        return lines
