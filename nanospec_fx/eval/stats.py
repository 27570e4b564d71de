"""Intervals for the benchmarks' ratios: one request is one observation, so a figure says how much the
requests disagree (a single pooled ratio hides that, and two separate runs add their own drift)."""
from __future__ import annotations

import random
import statistics


def median_interval(values: list[float], level: float = 0.95, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float, float]:
    """``(median, low, high)``: the median of ``values`` and a percentile-bootstrap interval for it
    (requests resampled with replacement; a fixed seed, so a JSON is reproducible from its rows)."""
    values = [float(v) for v in values if v == v]  # NaN: a request with no time measured
    if not values:
        return float("nan"), float("nan"), float("nan")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - level) / 2
    low = medians[int(tail * (resamples - 1))]
    high = medians[int(round((1 - tail) * (resamples - 1)))]
    return statistics.median(values), low, high


def paired_ratios(numerator: dict, denominator: dict) -> list[float]:
    """``numerator[k] / denominator[k]`` for every key both have (a request measured under both settings)."""
    return [numerator[k] / denominator[k] for k in numerator if k in denominator and denominator[k]]
