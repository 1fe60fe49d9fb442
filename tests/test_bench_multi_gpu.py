"""bench_multi_gpu's Poisson search, shared by every layout (the PD split included): levels at fractions of the
offline rate, skipped once the part's time is spent, and the highest rate whose p99 stays under 12 s / 1.5 s."""

from __future__ import annotations

import argparse
import math
import time

from scripts.bench_multi_gpu import qps_search, summarize_levels


def search_args(**kw) -> argparse.Namespace:
    defaults = dict(qps_fractions="0.5,0.7,0.85", qps_requests=20, qps_level_s=2.0, part_deadline=math.inf)
    return argparse.Namespace(**{**defaults, **kw})


def test_each_level_runs_at_its_fraction_of_the_offline_rate_and_the_best_rate_under_each_limit_is_kept():
    latency_at = {5.0: 1.0, 7.0: 3.0, 8.5: math.inf}  # the last level leaves requests unfinished
    calls = []

    def measure(qps, requests, cap_s, seed, tag):
        calls.append((round(qps, 3), requests, tag))
        return [0.5] * 98 + [latency_at[round(qps, 3)]] * 2  # p99 of 100: the second-highest

    summary = summarize_levels(qps_search(measure, 10.0, search_args())["levels"])
    assert calls == [(5.0, 20, "q0"), (7.0, 20, "q1"), (8.5, 20, "q2")]
    assert [level["unfinished"] for level in summary["levels"]] == [0, 0, 2]
    assert (summary["max_qps_p99_under_12s"], summary["max_qps_p99_under_1_5s"]) == (7.0, 5.0)


def test_levels_stop_when_the_part_time_is_spent():
    summary = summarize_levels(qps_search(lambda *a: [0.1], 10.0, search_args(part_deadline=time.time() + 5))["levels"])
    assert summary["levels"] == [{"fraction": 0.5, "skipped": "part time spent"}]
    assert summary["max_qps_p99_under_12s"] is None
