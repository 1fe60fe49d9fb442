"""The peak finder: bisection over target QPS (against a fake point), LoadGen's own verdicts read back, and one
real search on cpu-tiny through LoadGen, the router and Ray workers, whose report holds every point's logs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from audit.loadgen_logs import parse_detail_log, parse_summary_log
from harness.plot import read_sample_latencies
from harness.system_config import CONFIG_DIR
from lab.peak.finder import PeakFinder, PeakSearch, bisect_max_valid, point_queries, read_point, wait_for_released_gpus
from tests.helpers.loadgen_fixtures import SLOW_BOUND_MS, LoadGenRunSpec, run_loadgen
from workers.core.step_trace import read_requests, read_steps
from workers.tiny_checkpoint import TINY_OVERRIDES

REPO = Path(__file__).resolve().parents[1]


def knee(limit: float, tried: list[float]):
    """A fake point: valid up to `limit` QPS; records what was tried."""

    def run_point(qps: float) -> bool:
        tried.append(qps)
        return qps <= limit

    return run_point


def test_bisection_starts_at_the_first_point_and_halves_the_bracket():
    tried: list[float] = []
    best = bisect_max_valid(knee(7.3, tried), high=13.5, first=0.8 * 13.5, steps=6, resolution=0.05)
    assert tried == [10.8, 5.4, 8.1, 6.75, 7.4, 7.05]
    assert best == 7.05


def test_bisection_returns_the_highest_valid_point_not_the_last():
    tried: list[float] = []
    best = bisect_max_valid(knee(6.0, tried), high=10.0, first=5.0, steps=3, resolution=0.05)
    assert tried == [5.0, 7.5, 6.25]
    assert best == 5.0


def test_bisection_with_no_valid_point_finds_none():
    tried: list[float] = []
    assert bisect_max_valid(knee(0.0, tried), high=13.5, first=3.375, steps=4, resolution=0.05) is None
    assert tried == [3.35, 1.65, 0.8, 0.4]


def test_bisection_never_tries_above_the_offline_rate_nor_a_point_twice():
    tried: list[float] = []
    best = bisect_max_valid(knee(100.0, tried), high=2.0, first=2.0, steps=10, resolution=0.05)
    assert max(tried) <= 2.0 and len(tried) == len(set(tried))
    assert best == max(tried)
    assert len(tried) < 10  # the bracket closed below the resolution


def test_bisection_stops_before_a_point_that_does_not_fit():
    tried: list[float] = []
    best = bisect_max_valid(knee(7.3, tried), high=13.5, first=10.8, steps=6, resolution=0.05,
                            fits=lambda qps: len(tried) < 2)
    assert tried == [10.8, 5.4]
    assert best == 5.4


def test_a_server_point_issues_whole_passes_over_the_loaded_samples():
    assert point_queries(8.0, 60_000, 100, 1500) == 1500  # 480 queries needed, one pass of 1,500
    assert point_queries(8.0, 60_000, 100, 300) == 600
    assert point_queries(1.0, 1_000, 500, 300) == 600  # min_query_count dominates


def test_the_next_cluster_waits_until_the_stopped_ones_gpu_processes_are_gone():
    polls = iter([["4242", "4243"], ["4243"], []])
    asked: list[int] = []

    def processes():
        asked.append(1)
        return next(polls)

    assert wait_for_released_gpus(timeout_s=600, poll_s=0, processes=processes) is True
    assert len(asked) == 3


def test_without_nvidia_smi_the_search_goes_on_with_a_warning(capsys):
    assert wait_for_released_gpus(timeout_s=600, poll_s=0, processes=lambda: None) is False
    assert "GPU memory may still be held" in capsys.readouterr().err


def test_a_search_without_offline_needs_the_offline_rate():
    with pytest.raises(ValidationError, match="offline_samples_per_s"):
        PeakSearch(scenarios=("server",))
    with pytest.raises(ValidationError, match="offline_samples_per_s"):
        PeakSearch(offline_samples_per_s=10.0)
    assert PeakSearch(scenarios=("server",), offline_samples_per_s=10.0).scenarios == ("server",)


def test_offline_is_measured_first_and_each_scenario_once():
    with pytest.raises(ValidationError, match="offline comes first"):
        PeakSearch(scenarios=("server", "offline"))
    with pytest.raises(ValidationError, match="each at most once"):
        PeakSearch(scenarios=("offline", "server", "server"))


def test_a_point_is_read_from_loadgens_logs(tmp_path):
    log_dir = run_loadgen(LoadGenRunSpec(scenario="Server", mode="PerformanceOnly", target_qps=200.0,
                                         server_target_latency_ms=1000), tmp_path)
    point = read_point(log_dir, "server", 200.0)
    detail = parse_detail_log(log_dir / "mlperf_log_detail.txt")
    assert point.verdict == detail["result_validity"]
    assert point.summary_result == parse_summary_log(log_dir / "mlperf_log_summary.txt").get("Result is")
    assert point.samples_per_s == detail["result_completed_samples_per_sec"]
    assert point.p99_s == detail["result_99.00_percentile_latency_ns"] / 1e9
    assert point.p50_s <= point.p90_s <= point.p99_s
    assert point.queries == detail["result_query_count"]
    assert point.checks["early_stopping_met"] == detail["early_stopping_met"]
    assert point.over_bound_queries == detail["result_overlatency_query_count"] == 0
    assert point.queries_early_stopping_needs == 459


def test_a_latency_point_says_how_many_queries_missed_the_bound_and_what_early_stopping_then_needs(tmp_path):
    log_dir = run_loadgen(LoadGenRunSpec(scenario="Server", mode="PerformanceOnly", total_samples=50,
                                         min_duration_ms=100, min_query_count=100, target_qps=500.0,
                                         server_target_latency_ms=SLOW_BOUND_MS, slow_queries=2), tmp_path)
    point = read_point(log_dir, "server", 500.0)
    assert (point.over_bound_queries, point.queries_early_stopping_needs) == (2, 838)
    assert point.verdict == "INVALID" and "at least 738 more queries" in point.early_stopping
    offline = read_point(run_loadgen(LoadGenRunSpec(scenario="Offline", mode="PerformanceOnly"), tmp_path / "off"),
                         "offline", 400.0)
    assert offline.over_bound_queries is None and offline.queries_early_stopping_needs is None


def tiny_search_system(tmp_path: Path) -> Path:
    """cpu-tiny, smaller, with shorter answers and on one worker; its checkpoint generated on first use (random
    weights of the tiny shape); Offline on other engine settings, so that the search must start a second cluster."""
    data = yaml.safe_load((CONFIG_DIR / "cpu-tiny.yaml").read_text())
    data["model"] = {"generate": {"preset": "qwen3-vl-30b-a3b", "overrides": TINY_OVERRIDES["moe"]},
                     "dtype": "float32"}
    data["engine"]["load_format"] = "random"
    data["datasets"]["product-catalogue"]["path"] = "synthetic:8"
    data["datasets"]["catalogue-8k"]["path"] = "synthetic:8"
    data["workers"]["pools"][0]["count"] = 1
    data["scenarios"]["offline"]["engine"] = {"max_num_batched_tokens": 1024}
    data["requests"]["max_tokens"] = 16  # a faster engine: higher rates, so shorter points
    for section in data["scenarios"].values():
        section["performance_sample_count"] = 4
    path = tmp_path / "cpu-tiny-search.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
def test_a_real_search_on_cpu_tiny_reports_every_point_as_loadgen_logged_it(tmp_path):
    report_path = tmp_path / "peak.json"
    result = subprocess.run(
        [sys.executable, "scripts/find_peak.py", "--system", str(tiny_search_system(tmp_path)),
         "--json", str(report_path), "--output", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"),
         "--min-duration-ms", "1000", "--min-query-count", "4", "--offline-query-count", "8", "--steps", "2",
         "--commit", "abc123",
         "--step-trace-dir", str(tmp_path / "steps")],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert json.loads(result.stdout.strip().splitlines()[-1]) == report  # the last stdout line is the report

    assert (report["system"], report["device"], report["commit"]) == ("cpu-tiny", "cpu", "abc123")
    assert report["workload"]["max_tokens"] == 16 and report["workload"]["min_duration_ms"] == 1000
    assert report["workload"]["scenarios"]["offline"]["engine"]["max_num_batched_tokens"] == 1024
    assert {name: (w["samples"], w["catalogue_profile"]) for name, w in report["workload"]["scenarios"].items()} == {
        "offline": (8, "small"), "server": (8, "small"), "interactive": (8, "small")}
    assert [start["for"] for start in report["cluster_starts"]] == ["offline", "server"]  # Interactive reused it

    points = report["points"]
    assert [p["scenario"] for p in points] == ["offline", "server", "server", "interactive", "interactive"]
    offline = points[0]
    assert report["offline_samples_per_s"] == offline["samples_per_s"] > 0
    assert points[1]["target_qps"] <= report["offline_samples_per_s"]
    for point in points:
        log_dir = Path(point["log_dir"])
        detail = parse_detail_log(log_dir / "mlperf_log_detail.txt")
        assert point["verdict"] == detail["result_validity"]
        assert point["summary_result"] == parse_summary_log(log_dir / "mlperf_log_summary.txt").get("Result is")
        assert point["p99_s"] == detail["result_99.00_percentile_latency_ns"] / 1e9
        assert detail["effective_min_duration_ms"] == 1000 and detail["effective_performance_sample_count"] == 4
        if point["scenario"] == "offline":  # one query of at least --offline-query-count samples
            assert detail["effective_samples_per_query"] == 8
        else:
            assert detail["effective_min_query_count"] == 4
        if point["scenario"] != "offline":
            assert detail["effective_target_latency_ns"] == (
                1_500_000_000 if point["scenario"] == "interactive" else 12_000_000_000)
    for name in ("server", "interactive"):
        valid = [p["target_qps"] for p in points if p["scenario"] == name and p["verdict"] == "VALID"]
        assert report[f"{name}_max_valid_qps"] == (max(valid) if valid else None)
    for point in points:  # the tail anatomy: LoadGen's slowest queries with their prompts' sizes
        if point["scenario"] == "offline":
            assert "tail" not in point
            continue
        tail = point["tail"]
        slowest = max(read_sample_latencies(Path(point["log_dir"]) / "mlperf_log_trace.json"), key=lambda s: s.latency_s)
        assert tail["queries"] == point["queries"] and tail["tail_queries"] >= 1
        assert (tail["slowest"][0]["sample_index"], tail["slowest"][0]["latency_s"]) == (
            slowest.sample_index, round(slowest.latency_s, 3))
        assert tail["slowest"][0]["prompt_tokens"] > 0
        # every query over the scenario's bound, as many as LoadGen's log counts (its early stopping counts them)
        assert len(tail["over_bound"]) == point["over_bound_queries"]
        # ... and where its time went, from the engines' request lines of this point alone (the Server points share
        # one cluster, so its trace holds both): every query matched, the slowest one's phases add up to its latency
        timeline = tail["timeline"]
        assert timeline["matched_queries"] == point["queries"]
        first = timeline["slowest"][0]
        assert (first["sample_index"], first["latency_s"]) == (slowest.sample_index, round(slowest.latency_s, 3))
        spent = sum(v for k, v in first.items() if k not in ("sample_index", "latency_s", "issued_s"))
        assert spent == pytest.approx(slowest.latency_s, abs=2e-3) and first["outside_engine_s"] > 0
    # the engines' step trace of the same run: steps with their times, and a line for every request they served,
    # each through the worker's serving engine (so with its wait for a preparation thread)
    steps, requests = read_steps(tmp_path / "steps"), read_requests(tmp_path / "steps")
    assert steps and all(ms > 0 for _, ms in steps)
    assert len(requests) >= sum(p["queries"] for p in points if p["scenario"] != "offline")
    for line in requests:
        assert line["submitted_s"] <= line["prepare_started_s"] <= line["prepared_s"] <= line["admitted_s"]
        assert line["finish_reason"] in ("length", "stop")


def test_engine_settings_from_the_command_line_go_over_the_systems_engine_and_a_bad_key_fails_before_anything_starts(tmp_path):
    from lab.peak.finder import PeakFinder, PeakSearch
    from harness.system_config import ConfigError

    system = tiny_search_system(tmp_path)
    args = (PeakSearch(), tmp_path / "out", tmp_path / "cache", tmp_path / "peak.json")
    finder = PeakFinder(str(system), *args, engine_overrides={"mixed_step_graphs": False, "max_num_batched_tokens": 512},
                        step_trace_dir=tmp_path / "steps")
    assert finder.config.engine["mixed_step_graphs"] is False
    assert finder.config.engine["step_trace_dir"] == str((tmp_path / "steps").resolve())
    assert finder.config.for_scenario("server").engine["max_num_batched_tokens"] == 512
    assert finder.config.for_scenario("offline").engine["max_num_batched_tokens"] == 1024  # the scenario's own wins
    with pytest.raises(ConfigError, match="mixed_step_graph"):
        PeakFinder(str(system), *args, engine_overrides={"mixed_step_graph": False})


def test_find_peak_reads_engine_settings_as_yaml_and_refuses_one_without_a_value():
    import argparse

    from lab.peak.finder import engine_setting

    assert engine_setting("mixed_step_graphs=false") == ("mixed_step_graphs", False)
    assert engine_setting("max_num_batched_tokens=16384") == ("max_num_batched_tokens", 16384)
    assert engine_setting("step_trace_dir=/tmp/a=b") == ("step_trace_dir", "/tmp/a=b")
    for bad in ("mixed_step_graphs", "=1"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected KEY=VALUE"):
            engine_setting(bad)
    result = subprocess.run([sys.executable, "scripts/find_peak.py", "--engine", "mixed_step_graphs"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "expected KEY=VALUE" in result.stderr


HOLD_OUTPUT = """
import sys
from pathlib import Path
from harness.output_lock import OutputLock
OutputLock(Path(sys.argv[1])).acquire()
print("held", flush=True)
sys.stdin.read()  # holds the lock until killed
"""


def test_a_search_into_an_output_another_run_holds_is_refused_at_once_and_writes_nothing(tmp_path, monkeypatch):
    import lab.peak.finder
    from harness.output_lock import LOCK_FILE, OutputInUse

    def went_on(*args):
        raise AssertionError("the search went on into an output another run holds")

    monkeypatch.setattr(lab.peak.finder, "resolve_checkpoint", went_on)  # what the search does first
    holder = subprocess.Popen([sys.executable, "-c", HOLD_OUTPUT, str(tmp_path / "out")], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        search = PeakSearch(scenarios=("server",), offline_samples_per_s=1.0)
        finder = PeakFinder(str(tiny_search_system(tmp_path)), search, tmp_path / "out", tmp_path / "cache",
                            tmp_path / "peak.json")
        with pytest.raises(OutputInUse, match=f"pid {holder.pid} holds {tmp_path / 'out' / LOCK_FILE}"):
            finder.run()
        cli = subprocess.run([sys.executable, "scripts/find_peak.py", "--output", str(tmp_path / "out"),
                              "--json", str(tmp_path / "cli.json"), "--scenarios", "server",
                              "--offline-samples-per-s", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert cli.returncode == 2 and f"pid {holder.pid}" in cli.stderr, cli.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [LOCK_FILE]  # no point, no cluster dir
    assert not (tmp_path / "peak.json").exists() and not (tmp_path / "cli.json").exists()
    assert not (tmp_path / "cache").exists()  # nothing was made either
