"""scripts/bench_router_burst.py on a small burst: a real router process and a simulated worker process, every
request answered and counted, the probe's figures present (the script's numbers are measured, not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_a_small_burst_is_answered_whole_and_reported_as_one_json_object():
    result = subprocess.run(
        [sys.executable, "scripts/bench_router_burst.py", "--requests", "24", "--image-mb", "0.2"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["answered"] == sum(report["outcomes"].values()) == 24
    assert report["worker_marked_down"] == 0
    assert {"router_slowest_call_s", "worker_slowest_call_s", "router_failed_calls"} <= report.keys()
