"""Percentiles, one definition for the gateway's rollback windows, the benchmarks and the tests."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def nearest_rank(ordered: Sequence[float], q: float) -> float:
    """The `q`-quantile (0 < q <= 1) of an ascending, non-empty sequence by the nearest-rank method: the
    smallest value with at least q of the values at or below it (p99 of 100 values is the 99th)."""
    if not ordered:
        raise ValueError("no values")
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def percentile(values: Iterable[float], q: float) -> float:
    """`nearest_rank` of `values` in any order."""
    return nearest_rank(sorted(values), q)
