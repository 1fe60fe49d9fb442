"""bench_multi_gpu's Poisson search, shared by every layout (the PD split included): levels at fractions of the
offline rate, skipped once the part's time is spent, and the highest rate whose p99 stays under 12 s / 1.5 s;
and its CPU smoke mode through the data-parallel and prefill/decode parts."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.bench.poisson_levels import qps_search, summarize_levels

REPO = Path(__file__).resolve().parent.parent


def search_args(**kw) -> argparse.Namespace:
    defaults = dict(qps_fractions="0.5,0.7,0.85", qps_requests=20, qps_level_s=2.0, part_deadline=math.inf)
    return argparse.Namespace(**{**defaults, **kw})


def test_each_level_runs_at_its_fraction_of_the_offline_rate_and_the_best_rate_under_each_limit_is_kept():
    latency_at = {5.0: 1.0, 7.0: 3.0, 8.5: math.inf}  # the last level leaves requests unfinished
    calls = []

    def measure(qps, requests, cap_s, seed, tag):
        calls.append((round(qps, 3), requests, tag))
        return [0.5] * 98 + [latency_at[round(qps, 3)]] * 2  # p99 of 100: one of the two highest

    summary = summarize_levels(qps_search(measure, 10.0, search_args())["levels"])
    assert calls == [(5.0, 20, "q0"), (7.0, 20, "q1"), (8.5, 20, "q2")]
    assert [level["unfinished"] for level in summary["levels"]] == [0, 0, 2]
    assert (summary["max_qps_p99_under_12s"], summary["max_qps_p99_under_1_5s"]) == (7.0, 5.0)


def test_levels_stop_when_the_part_time_is_spent():
    summary = summarize_levels(qps_search(lambda *a: [0.1], 10.0, search_args(part_deadline=time.time() + 5))["levels"])
    assert summary["levels"] == [{"fraction": 0.5, "skipped": "part time spent"}]
    assert summary["max_qps_p99_under_12s"] is None


def test_a_level_without_arrivals_is_reported_but_not_rated():
    levels = [{"fraction": 0.1, "qps": 0.4, "requests": 0, "latencies_s": []},
              {"fraction": 0.5, "qps": 2.0, "requests": 3, "latencies_s": [0.2, 0.3, 0.4]}]
    summary = summarize_levels(levels)
    assert summary["levels"][0] == {"fraction": 0.1, "qps": 0.4, "requests": 0, "note": "no arrivals"}
    assert summary["max_qps_p99_under_1_5s"] == 2.0


@pytest.mark.slow
def test_smoke_mode_runs_the_data_parallel_and_prefill_decode_parts_through_two_poisson_levels(tmp_path):
    """Q3VL_BENCH_SMOKE=1: every part on CPU with tiny dims (gloo ranks, the KV link over gloo), the plumbing only."""
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_multi_gpu.py"), "--parts", "dp2,pd", "--workload", "fixed",
           "--samples", "4", "--qps-fractions", "0.3,0.6", "--qps-requests", "8", "--qps-level-s", "3",
           "--part-timeout", "150", "--out", str(out)]
    subprocess.run(cmd, env={**os.environ, "Q3VL_BENCH_SMOKE": "1"}, check=True, timeout=400, capture_output=True)
    result = json.loads(out.read_text())
    assert "error" not in result["dp2"] and "error" not in result["pd"], result
    assert result["workload"]["kind"] == "fixed" and result["workload"]["samples"] == 4
    assert result["args"]["qps_fractions"] == "0.3,0.6" and result["args"]["qps_level_s"] == 3
    assert [i["samples"] for i in result["dp2"]["instances"]] == [2, 2] and result["dp2"]["samples_per_s"] > 0
    pd = result["pd"]
    assert pd["samples"] == 4 and pd["kv_bytes_per_request"] > 0, pd
    for part in (result["dp2"], pd):
        levels = part["poisson"]["levels"]
        assert [level["fraction"] for level in levels] == [0.3, 0.6], part
        assert all(level.get("unfinished", 0) == 0 for level in levels)
