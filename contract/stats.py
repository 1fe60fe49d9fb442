"""Small statistics shared by the harness, the simulator and the benchmark scripts: LoadGen's latency percentile,
its early-stopping test and Poisson arrival times. Plain Python, no imports from the rest of the project."""

from __future__ import annotations

import math
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


def permuted_draws(pool: int, count: int, seed: int = 0) -> list[int]:
    """`count` sample indices drawn as LoadGen draws them with sample_concatenate_permutation (which mlperf.conf sets
    for q3vl): whole shuffled passes over the `pool` loaded samples, one after another (seeded), so that every
    `pool` queries issue each sample once."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < count:
        order = list(range(pool))
        rng.shuffle(order)
        out.extend(order)
    return out[:count]


def _binomial_cdf(k: int, n: int, p: float) -> float:
    """P[X <= k] for X ~ Binomial(n, p), summed in log space."""
    log_p, log_q = math.log(p), math.log1p(-p)
    return sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q)
               for i in range(min(k, n) + 1))


def early_stopping_min_queries(over: int, q: float = 0.99, confidence: float = 0.99) -> int:
    """The fewest queries with which LoadGen's early stopping accepts a q-percentile bound when `over` queries exceeded
    it: the least n with P[Binomial(n, 1 - q) <= over] <= 1 - confidence (loadgen/early_stopping.cc,
    MinPassingQueriesFinder, zero tolerance; https://github.com/mlcommons/inference). 459 with none over at p99."""
    if over < 0:
        raise ValueError(f"over must be >= 0, got {over}")
    lo, hi = over + 1, max(over + 2, 2 * math.ceil((over + 1) / (1 - q)))
    while _binomial_cdf(over, hi, 1 - q) > 1 - confidence:
        lo, hi = hi, 2 * hi
    while lo < hi:  # the CDF falls as n grows
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if _binomial_cdf(over, mid, 1 - q) > 1 - confidence else (lo, mid)
    return lo


def early_stopping_met(latencies: list[float], bound: float, q: float = 0.99, confidence: float = 0.99) -> bool:
    """LoadGen's early-stopping verdict on a latency run: enough queries for the ones over `bound` (q-percentile)."""
    over = sum(1 for latency in latencies if latency > bound)
    return len(latencies) >= early_stopping_min_queries(over, q, confidence)
