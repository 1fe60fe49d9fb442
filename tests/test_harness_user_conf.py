"""The user.conf generated from a system config gives LoadGen the intended effective TestSettings
(read back with TestSettings.FromConfig in a fresh process, as a real test does)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.scenarios import Scenario
from harness.system_config import load_system_config
from harness.user_conf import MODEL_KEY, render_user_conf

REPO = Path(__file__).resolve().parents[1]
ROUND_SEEDS = (2085463073848966840, 2747215439041700203, 16159082839903944936)  # v6.1, LoadGen 6.0.17

_READ_BACK = """
import json, sys
from pathlib import Path
from harness.scenarios import LoadGenMode, Scenario
from harness.system_config import load_system_config
from harness.user_conf import load_test_settings, write_user_conf
config = load_system_config(sys.argv[1])
scenario = Scenario(sys.argv[2])
path = write_user_conf(config, scenario, Path(sys.argv[3]) / "user.conf")
s = load_test_settings(path, scenario, LoadGenMode(sys.argv[4]))
print(json.dumps({k: (int(v) if k in ("scenario", "mode") else v) for k, v in (
    (k, getattr(s, k)) for k in ("scenario", "mode", "server_target_qps", "offline_expected_qps",
    "server_target_latency_ns", "server_target_latency_percentile", "min_duration_ms", "min_query_count",
    "performance_sample_count_override", "sample_concatenate_permutation", "use_token_latencies",
    "qsl_rng_seed", "sample_index_rng_seed", "schedule_rng_seed"))}))
"""


def effective(system: str, scenario: str, tmp_path: Path, mode: str = "performance") -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _READ_BACK, system, scenario, str(tmp_path), mode],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_server_settings_come_from_the_system_config(tmp_path):
    section = load_system_config("cpu-tiny").scenario("server")
    s = effective("cpu-tiny", "server", tmp_path)
    assert s["scenario"] == 2 and s["mode"] == 2  # Server, PerformanceOnly
    assert s["server_target_qps"] == section.target_qps
    assert s["server_target_latency_ns"] == 12_000_000_000
    assert s["server_target_latency_percentile"] == pytest.approx(0.99)
    assert s["min_duration_ms"] == section.min_duration_ms
    assert s["min_query_count"] == section.min_query_count
    assert s["performance_sample_count_override"] == section.performance_sample_count


def test_interactive_is_the_server_scenario_with_a_1500_ms_target(tmp_path):
    section = load_system_config("cpu-tiny").scenario("interactive")
    s = effective("cpu-tiny", "interactive", tmp_path, mode="accuracy")
    assert s["scenario"] == 2 and s["mode"] == 1  # Server, AccuracyOnly
    assert s["server_target_latency_ns"] == 1_500_000_000
    assert s["performance_sample_count_override"] == section.performance_sample_count


def test_offline_overrides_mlperf_conf_min_query_count(tmp_path):
    section = load_system_config("cpu-tiny").scenario("offline")
    s = effective("cpu-tiny", "offline", tmp_path)
    assert s["scenario"] == 3
    assert s["offline_expected_qps"] == section.target_qps
    assert s["min_query_count"] == section.min_query_count  # mlperf.conf says 48289


def test_mlperf_conf_keys_the_user_conf_does_not_set_stay_in_force(tmp_path):
    s = effective("h200x8", "server", tmp_path)
    assert (s["qsl_rng_seed"], s["sample_index_rng_seed"], s["schedule_rng_seed"]) == ROUND_SEEDS
    assert s["sample_concatenate_permutation"] is True
    assert s["use_token_latencies"] is False
    assert s["min_duration_ms"] == 600000 and s["performance_sample_count_override"] == 48289


def test_user_conf_uses_only_the_benchmark_model_key():
    config = load_system_config("cpu-tiny")
    for scenario in Scenario:
        lines = [l for l in render_user_conf(config, scenario).splitlines() if l and not l.startswith("#")]
        assert all(l.startswith(f"{MODEL_KEY}.{scenario.loadgen_name}.") for l in lines), lines
