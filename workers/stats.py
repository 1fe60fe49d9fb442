"""Small statistics shared by the harness, the simulator and the benchmark scripts: LoadGen's latency percentile
and Poisson arrival times. Plain Python, no imports from the rest of the project."""

from __future__ import annotations

import random
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float, empty: float = float("nan")) -> float:
    """The q-quantile (0 <= q < 1) as LoadGen reports it: the ascending values' element at index floor(q * n),
    so p99 of 100 values is the largest (https://github.com/mlcommons/inference/blob/master/loadgen/results.cc,
    PerformanceSummary::ProcessLatencies). `empty` when there are no values."""
    ordered = sorted(values)
    if not ordered:
        return empty
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def poisson_arrivals(qps: float, count: int, seed: int = 0) -> list[float]:
    """Seconds from the start at which `count` requests of a Poisson process at `qps` arrive (exponential gaps,
    seeded: the same seed gives the same arrivals)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        t += rng.expovariate(qps)
        out.append(t)
    return out
