"""The user.conf generated from a system config gives LoadGen the intended effective TestSettings
(read back with TestSettings.FromConfig in a fresh process, as a real test does)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.scenarios import Scenario
from harness.system_config import load_system_config
from harness.user_conf import MODEL_KEY, render_user_conf

REPO = Path(__file__).resolve().parents[1]
ROUND_SEEDS = (2085463073848966840, 2747215439041700203, 16159082839903944936)  # v6.1, LoadGen 6.0.17
MLPERF_CONF_PERFORMANCE_SAMPLES = 48289  # qwen3-vl-235b-a22b.*.performance_sample_count_override in mlperf.conf

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
    assert s["performance_sample_count_override"] == MLPERF_CONF_PERFORMANCE_SAMPLES  # the whole catalogue


def test_interactive_is_the_server_scenario_with_a_1500_ms_target(tmp_path):
    s = effective("cpu-tiny", "interactive", tmp_path, mode="accuracy")
    assert s["scenario"] == 2 and s["mode"] == 1  # Server, AccuracyOnly
    assert s["server_target_latency_ns"] == 1_500_000_000


def test_loading_the_whole_dataset_leaves_mlperf_conf_performance_sample_count_in_force(tmp_path):
    config = load_system_config("h200x8")
    assert config.scenario("interactive").performance_sample_count == config.dataset_size("interactive") == 8000
    assert "performance_sample_count_override =" not in render_user_conf(config, Scenario("interactive"))
    assert effective("h200x8", "interactive", tmp_path)["performance_sample_count_override"] == 48289


def test_loading_part_of_the_dataset_writes_its_own_count(tmp_path):
    data = yaml.safe_load((REPO / "mlperf_configs" / "cpu-tiny.yaml").read_text())
    data["scenarios"]["interactive"]["performance_sample_count"] = 10
    path = tmp_path / "part.yaml"
    path.write_text(yaml.safe_dump(data))
    assert effective(str(path), "interactive", tmp_path)["performance_sample_count_override"] == 10


_RUN_INTERACTIVE = """
import array, json, sys, threading
from pathlib import Path
import mlperf_loadgen as lg
from harness.qsl import StoreQSL
from harness.scenarios import LoadGenMode, Scenario
from harness.system_config import load_system_config
from harness.user_conf import load_test_settings, write_user_conf
config, scenario, out = load_system_config("cpu-tiny"), Scenario("interactive"), Path(sys.argv[1])
settings = load_test_settings(write_user_conf(config, scenario, out / "user.conf"), scenario, LoadGenMode.PERFORMANCE)
settings.min_duration_ms, settings.min_query_count, settings.server_target_qps = 10, 48, 2000.0
loaded = set()
class Store:
    def load(self, indices): loaded.update(indices)
    def unload(self, indices): pass
qsl = StoreQSL(Store(), config.dataset_size("interactive"), config.scenario("interactive").performance_sample_count)
payload = array.array("B", b"{}")
address, length = payload.buffer_info()
def issue(samples):
    threading.Thread(target=lambda: lg.QuerySamplesComplete(
        [lg.QuerySampleResponse(q.id, address, length, 1) for q in samples]), daemon=True).start()
sut = lg.ConstructSUT(issue, lambda: None)
log = lg.LogSettings()
log.log_output.outdir = str(out)
lg.StartTestWithLogSettings(sut, qsl.handle, settings, log)
qsl.close()
lg.DestroySUT(sut)
print(json.dumps(sorted(loaded)))
"""


def test_a_real_interactive_run_logs_the_checkers_count_and_loads_the_whole_catalogue(tmp_path):
    from audit.loadgen_logs import parse_detail_log

    out = subprocess.run([sys.executable, "-c", _RUN_INTERACTIVE, str(tmp_path)], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=120, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    log = parse_detail_log(tmp_path / "mlperf_log_detail.txt")
    assert log["effective_performance_sample_count"] == MLPERF_CONF_PERFORMANCE_SAMPLES  # the audit's minimum
    assert log["qsl_reported_total_count"] == log["qsl_reported_performance_count"] == 24
    assert loaded == list(range(24))


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


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO)}
