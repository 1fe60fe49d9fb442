"""Poisson load levels of the multi-GPU bench (scripts/bench_multi_gpu.py): arrivals of one level, the levels
at fractions of the offline rate, and their p50/p99 beside the scenarios' latency bounds."""

from __future__ import annotations

import math
import statistics
import time

from contract.stats import percentile, poisson_arrivals
from lab.plan.latency import BOUND_MS

P99_LIMITS_S = (BOUND_MS["server"] / 1e3, BOUND_MS["interactive"] / 1e3)  # (12.0, 1.5)


def capped_arrivals(qps: float, requests: int, cap_s: float, seed: int) -> list[float]:
    """Seconds from the level's start at which its requests arrive: Poisson at `qps`, none after cap_s."""
    return [a for a in poisson_arrivals(qps, requests, seed) if a <= cap_s]


def qps_search(measure, offline_rate: float, args, share: float = 1.0) -> dict:
    """Poisson levels at args.qps_fractions of the offline rate (this process takes `share` of the arrivals);
    measure(qps, requests, cap_s, seed, tag) runs one level and returns its latencies (inf: unfinished).
    Stops when the part's time is spent. Latencies are returned for a caller that merges instances."""
    levels, deadline = [], args.part_deadline
    for i, fraction in enumerate(float(f) for f in args.qps_fractions.split(",")):
        qps = fraction * offline_rate * share
        level_s = min(args.qps_level_s, args.qps_requests * share / qps)
        if time.time() + level_s + P99_LIMITS_S[0] + 5 > deadline:
            levels.append({"fraction": fraction, "skipped": "part time spent"})
            break
        lat = measure(qps, math.ceil(args.qps_requests * share), level_s, 1000 + i, f"q{i}")
        levels.append({"fraction": fraction, "qps": round(qps, 3), "requests": len(lat), "latencies_s": [round(x, 3) for x in lat]})
    return {"levels": levels}


def summarize_levels(levels: list[dict]) -> dict:
    """p50/p99 per level and the highest QPS tried whose p99 is under each limit (None: not even the lowest)."""
    out, best = [], {limit: None for limit in P99_LIMITS_S}
    for level in levels:
        if "latencies_s" not in level:
            out.append(level)
            continue
        lat = level["latencies_s"]
        row = {k: v for k, v in level.items() if k != "latencies_s"}
        if not lat:  # no arrival fell inside the level's window: nothing to rate
            out.append({**row, "note": "no arrivals"})
            continue
        row.update(p50_s=round(statistics.median(lat), 3), p99_s=round(percentile(lat, 0.99), 3), unfinished=sum(math.isinf(x) for x in lat))
        out.append(row)
        for limit in P99_LIMITS_S:
            if row["p99_s"] < limit and (best[limit] is None or row["qps"] > best[limit]):
                best[limit] = row["qps"]
    return {"levels": out, "max_qps_p99_under_12s": best[12.0], "max_qps_p99_under_1_5s": best[1.5]}
