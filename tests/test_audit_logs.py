"""LoadGen's logs are read as LoadGen 6.0.17 writes them: the detail log's checked keys and errors, and the
summary's result lines, from real runs of a trivial SUT."""

from __future__ import annotations

import pytest

from audit.loadgen_logs import CHECKED_DETAIL_KEYS, LogParseError, parse_detail_log, parse_summary_log
from audit.rules.rounds import ROUNDS
from tests.helpers.loadgen_fixtures import LoadGenRunSpec, append_detail_entry, run_loadgen


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("loadgen")
    specs = {
        "offline-perf": LoadGenRunSpec("Offline", "PerformanceOnly"),
        "server-perf": LoadGenRunSpec("Server", "PerformanceOnly"),
        "offline-acc": LoadGenRunSpec("Offline", "AccuracyOnly"),
        "server-twice": LoadGenRunSpec("Server", "PerformanceOnly", load_config_twice=True),
    }
    return {name: run_loadgen(spec, base / name) for name, spec in specs.items()}


def test_offline_performance_detail_log_has_every_checked_key_loadgen_writes(runs):
    log = parse_detail_log(runs["offline-perf"] / "mlperf_log_detail.txt")
    not_logged_when_off = {"requested_use_token_latencies", "result_completed_samples_per_sec"}
    assert set(CHECKED_DETAIL_KEYS) - set(log.checked_values) == not_logged_when_off
    assert log["effective_scenario"] == "Offline"
    assert log["loadgen_version"].startswith("6.0.17")
    assert log["effective_sample_concatenate_permutation"] is True
    assert log["result_validity"] == "INVALID"  # a 50 ms run is too short
    assert log["result_samples_per_second"] > 0
    assert log.errors == ()


def test_seeds_come_from_loadgens_embedded_mlperf_conf_and_are_the_v6_1_seeds(runs):
    log = parse_detail_log(runs["server-perf"] / "mlperf_log_detail.txt")
    seeds = ROUNDS["v6.1"].seeds
    assert (log["effective_qsl_rng_seed"], log["effective_sample_index_rng_seed"],
            log["effective_schedule_rng_seed"]) == (seeds.qsl, seeds.sample_index, seeds.schedule)
    assert log["effective_target_latency_ns"] == 12_000_000_000  # qwen3-vl-235b-a22b.Server.target_latency


def test_server_log_has_early_stopping_and_completed_rate_but_no_token_latency_flag(runs):
    log = parse_detail_log(runs["server-perf"] / "mlperf_log_detail.txt")
    assert log["early_stopping_met"] in (True, False)
    assert isinstance(log["early_stopping_result"], str)
    assert log["result_completed_samples_per_sec"] > 0
    assert "requested_use_token_latencies" not in log


def test_accuracy_run_logs_sample_counts_but_no_result(runs):
    log = parse_detail_log(runs["offline-acc"] / "mlperf_log_detail.txt")
    assert log["effective_accuracy_sample_count"] == 20
    assert log["qsl_reported_total_count"] == 20
    assert "result_validity" not in log


def test_loading_the_config_twice_is_a_loadgen_error(runs):
    log = parse_detail_log(runs["server-twice"] / "mlperf_log_detail.txt")
    [error] = log.errors
    assert error.key == "error_invalid_config"
    assert "Multiple conf files" in error.value
    assert parse_summary_log(runs["server-twice"] / "mlperf_log_summary.txt").num_errors == 1


def test_repeated_key_keeps_its_first_value(runs, tmp_path):
    path = tmp_path / "mlperf_log_detail.txt"
    path.write_text((runs["offline-perf"] / "mlperf_log_detail.txt").read_text())
    append_detail_entry(path, "result_validity", "VALID")
    assert parse_detail_log(path)["result_validity"] == "INVALID"


def test_missing_key_error_names_the_file_and_key(runs):
    log = parse_detail_log(runs["offline-acc"] / "mlperf_log_detail.txt")
    with pytest.raises(KeyError, match="result_validity"):
        log["result_validity"]


def test_malformed_mllog_line_names_file_and_line(tmp_path):
    path = tmp_path / "mlperf_log_detail.txt"
    path.write_text(':::MLLOG {"key": "sut_name", "value": "PySUT"}\n:::MLLOG {"key": broken\n')
    with pytest.raises(LogParseError, match=r"mlperf_log_detail.txt:2"):
        parse_detail_log(path)


def test_file_without_mllog_entries_is_not_a_detail_log(tmp_path):
    path = tmp_path / "mlperf_log_detail.txt"
    path.write_text("hello\n")
    with pytest.raises(LogParseError, match="no :::MLLOG entries"):
        parse_detail_log(path)


def test_summary_reads_result_lines_and_test_parameters(runs):
    offline = parse_summary_log(runs["offline-perf"] / "mlperf_log_summary.txt")
    server = parse_summary_log(runs["server-perf"] / "mlperf_log_summary.txt")
    assert offline.get("Scenario") == "Offline" and server.get("Scenario") == "Server"
    assert offline.get("SUT name") == "PySUT"
    assert not offline.result_is_valid and offline.get("Min duration satisfied") == "NO"
    assert float(offline.get("Samples per second")) > 0
    assert float(server.get("Completed samples per second")) > 0
    assert server.get("target_latency (ns)") == "12000000000"
    assert offline.num_errors == 0


def test_accuracy_summary_has_only_error_and_warning_lines(runs):
    summary = parse_summary_log(runs["offline-acc"] / "mlperf_log_summary.txt")
    assert summary.values == {} and summary.num_errors == 0


def test_text_that_is_not_a_summary_is_rejected(tmp_path):
    path = tmp_path / "mlperf_log_summary.txt"
    path.write_text("something else\n")
    with pytest.raises(LogParseError, match="not a LoadGen summary log"):
        parse_summary_log(path)
