"""One real run per scenario on cpu-tiny (shortened): LoadGen in its own process, the router process, Ray
workers running the real engine on a tiny checkpoint, the submission tree and the audit's verdict; and a run whose
LoadGen tests route in their own process (router.mode embedded)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from audit.loadgen_logs import parse_detail_log
from harness.demo_verdict import REAL_SUBMISSION
from harness.system_config import CONFIG_DIR

REPO = Path(__file__).resolve().parents[1]
MODEL = "qwen3-vl-235b-a22b"
SUBMITTER = "Q3VLHarness"
NUM_SAMPLES = {"offline": 16, "server": 16, "interactive": 12}
# What a random tiny model on a short run must fail, and nothing else: accuracy, and the run's size/length.
ALLOWED_FAILURES = {
    "scenario-set",  # one scenario per run; v6.1 requires Offline and one of Server/Interactive
    "perf-sample-count", "perf-min-duration", "perf-offline-samples-per-query", "perf-result-valid",
    "perf-early-stopping", "accuracy-f1", "accuracy-sample-count", "accuracy-total-count",
    "perf-latency-constraint",  # measured p99 on two shared CPU cores may miss Interactive's 1.5 s
}


def short_cpu_tiny(tmp_path: Path, router_mode: str = "process") -> Path:
    """cpu-tiny with fewer samples and shorter runs, so each scenario finishes in about a minute."""
    data = yaml.safe_load((CONFIG_DIR / "cpu-tiny.yaml").read_text())
    data["router"]["mode"] = router_mode
    data["datasets"]["product-catalogue"]["path"] = f"synthetic:{NUM_SAMPLES['server']}"
    data["datasets"]["catalogue-8k"]["path"] = f"synthetic:{NUM_SAMPLES['interactive']}"
    for name, section in data["scenarios"].items():
        section.update(target_qps=2.0, min_duration_ms=4000, min_query_count=8,
                       performance_sample_count=NUM_SAMPLES[name])
    path = tmp_path / "cpu-tiny-short.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """The tiny checkpoint and catalogues the harness makes on first use, shared by the three runs."""
    return tmp_path_factory.mktemp("harness-cache")


def run_harness(scenario: str, tmp_path: Path, cache: Path, router_mode: str = "process"
                ) -> tuple[subprocess.CompletedProcess, Path]:
    output = tmp_path / "out"
    system = short_cpu_tiny(tmp_path, router_mode)
    result = subprocess.run(
        [sys.executable, "-m", "harness", "--scenario", scenario, "--system", str(system),
         "--output", str(output), "--cache-dir", str(cache), "--no-progress", "--verbose"],
        cwd=REPO, capture_output=True, text=True, timeout=400,
    )
    return result, output


def audit_failures(stdout: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^FAIL\s+(\S+)", stdout, re.MULTILINE)}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["offline", "server", "interactive"])
def test_cpu_tiny_run_produces_loadgen_logs_a_tree_and_an_honest_verdict(scenario, tmp_path, cache_dir):
    result, output = run_harness(scenario, tmp_path, cache_dir)
    assert result.returncode == 1, result.stderr[-3000:]  # the audit rejects a tiny random model
    # The embedded Ray kept its session files in a directory of the harness's, gone once the run is over.
    [ray_temp_dir] = re.findall(r"embedded Ray on loopback, its session files in (\S+)", result.stderr)
    assert not Path(ray_temp_dir).exists()
    dir_name = scenario.capitalize()
    runs = output / "runs" / "cpu-tiny" / dir_name

    # LoadGen's own logs, with the settings the config asked for, and validity as LoadGen's rules imply.
    perf = parse_detail_log(runs / "performance" / "run_1" / "mlperf_log_detail.txt")
    assert perf["effective_scenario"] == ("Offline" if scenario == "offline" else "Server")
    assert perf["effective_min_duration_ms"] == 4000
    if scenario != "offline":
        assert perf["effective_target_latency_ns"] == (1_500_000_000 if scenario == "interactive" else 12_000_000_000)
    conditions = ["result_min_duration_met", "result_min_queries_met", "early_stopping_met"]
    if scenario != "offline":
        conditions.append("result_perf_constraints_met")  # the p99 latency bound
    implied = all(perf[k] is True for k in conditions)
    assert perf["result_validity"] == ("VALID" if implied else "INVALID")
    assert (runs / "latency.png").stat().st_size > 0

    # The accuracy run answered every sample of the dataset exactly once.
    entries = json.loads((runs / "accuracy" / "mlperf_log_accuracy.json").read_text())
    indices = [e["qsl_idx"] for e in entries]
    assert sorted(indices) == list(range(NUM_SAMPLES[scenario]))

    # The submission tree, laid out as MLCommons expects.
    sub = output / "submission" / "closed" / SUBMITTER
    scen = sub / "results" / "cpu-tiny" / MODEL / dir_name
    for path in (sub / "systems" / "cpu-tiny.json", sub / "src" / "harness", scen / "measurements.json",
                 scen / "user.conf", scen / "README.md", scen / "performance" / "run_1" / "mlperf_log_summary.txt",
                 scen / "performance" / "run_1" / "mlperf_log_detail.txt", scen / "accuracy" / "accuracy.txt",
                 scen / "accuracy" / "mlperf_log_accuracy.json"):
        assert path.exists(), path
    assert "hash=" in (scen / "accuracy" / "accuracy.txt").read_text()
    assert (scen / "accuracy" / "mlperf_log_accuracy.json").stat().st_size <= 10 * 1024

    # The audit fails accuracy and the run's size and length, and nothing else.
    failures = audit_failures(result.stdout)
    assert {"accuracy-f1", "perf-min-duration"} <= failures, result.stdout
    assert failures <= ALLOWED_FAILURES, result.stdout
    assert "VERDICT  REJECTED" in result.stdout
    # ... and the console says why that is expected of the embedded default, then what a real submission needs.
    assert result.stderr.splitlines()[-1] == f"[q3vl] {REAL_SUBMISSION}", result.stderr[-3000:]


def served(log: str) -> list[int]:
    """Requests each router of a log served, from its closing line ('router ... served requests LENGTH=3 STOP=2;
    ...')."""
    return [sum(int(n) for n in re.findall(r"=(\d+)", line))
            for line in re.findall(r"served requests ([^;]*);", log)]


@pytest.mark.slow
def test_a_run_routed_in_its_loadgen_processes_answers_every_sample_once_through_them(tmp_path, cache_dir):
    result, output = run_harness("server", tmp_path, cache_dir, router_mode="embedded")
    assert result.returncode == 1, result.stderr[-3000:]  # the audit rejects a tiny random model
    runs = output / "runs" / "cpu-tiny" / "Server"
    entries = json.loads((runs / "accuracy" / "mlperf_log_accuracy.json").read_text())
    assert sorted(e["qsl_idx"] for e in entries) == list(range(NUM_SAMPLES["server"]))
    assert json.loads((runs / "accuracy" / "failed_samples.json").read_text()) == []
    perf = parse_detail_log(runs / "performance" / "run_1" / "mlperf_log_detail.txt")
    # Each LoadGen test (performance, then accuracy) had a router of its own, and both workers registered with it
    embedded = (runs / "embedded-router.log").read_text()
    assert embedded.count("router listening on") == 2
    assert embedded.count("registered at") >= 2 * 2
    performance, accuracy = served(embedded)
    assert performance >= perf["effective_min_query_count"] and accuracy == NUM_SAMPLES["server"]
    assert served((runs / "router.log").read_text()) == [1]  # the router process: the warm-up's request only
    assert "VERDICT  REJECTED" in result.stdout
