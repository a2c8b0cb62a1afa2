"""Exact latency percentiles as Spark SQL's `percentile` computes them (linear interpolation
between closest ranks), shared by the oracle and the Spark reconciliation so both give the same
floats bit for bit.

Pure arithmetic: no I/O, no pyspark.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

PERCENTILES = (0.5, 0.95, 0.99)
LATENCY_COLUMNS = ("latency_p50_ms", "latency_p95_ms", "latency_p99_ms", "latency_max_ms")


def percentile_position(n: int, p: float) -> tuple[float, int, int]:
    """Spark SQL `percentile` (exact) over n values: the position (n - 1) * p in the sorted values
    and the two 0-based ranks around it (equal when the position is whole)."""
    position = (n - 1) * p
    return position, math.floor(position), math.ceil(position)


def interpolate(position: float, lower: int, higher: int, lo_v: float, hi_v: float) -> float:
    """Spark's linear interpolation between the values at ranks `lower` and `higher` (same float
    operations in the same order, so the result is bit for bit Spark's)."""
    if higher == lower or lo_v == hi_v:
        return lo_v
    return (higher - position) * lo_v + (position - lower) * hi_v


def spark_percentile(values: Sequence[float], p: float) -> float:
    """Spark SQL `percentile` (exact): linear interpolation at position (n - 1) * p."""
    xs = sorted(values)
    position, lower, higher = percentile_position(len(xs), p)
    return interpolate(position, lower, higher, xs[lower], xs[higher])


def latency_columns(values: Sequence[float]) -> dict[str, float | None]:
    """The report's latency columns (p50, p95, p99, max) of a list of latencies; None when empty."""
    if not values:
        return dict.fromkeys(LATENCY_COLUMNS)
    p50, p95, p99 = (spark_percentile(values, p) for p in PERCENTILES)
    return {"latency_p50_ms": p50, "latency_p95_ms": p95, "latency_p99_ms": p99,
            "latency_max_ms": max(values)}
