"""When LoadGen calls a performance run INVALID, the audit names LoadGen's failing check(s) with the value LoadGen
measured and the one it needed, read from LoadGen's own logs of real runs of a trivial SUT: an Offline run shorter
than its min_duration, a Server run over its latency bound (and so short of early stopping), a Server run too short
for early stopping alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from audit.loadgen_logs import parse_detail_log, parse_summary_log
from audit.rules.loadgen_validity import explain_validity, failing_checks
from tests.helpers.loadgen_fixtures import SLOW_BOUND_MS, LoadGenRunSpec, rewrite_detail_values, run_loadgen


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("validity")
    specs = {
        # One query of 20 samples answered at once: far shorter than its 3 s min_duration.
        "offline-short": LoadGenRunSpec("Offline", "PerformanceOnly", min_duration_ms=3000, target_qps=1.0),
        # 5 of 40 queries answered 1.5 s late, over a 0.5 s bound that the others meet.
        "server-slow": LoadGenRunSpec("Server", "PerformanceOnly", server_target_latency_ms=SLOW_BOUND_MS, slow_queries=5),
        "server-few": LoadGenRunSpec("Server", "PerformanceOnly"),  # 40 queries, all in time
    }
    return {name: run_loadgen(spec, base / name) for name, spec in specs.items()}


def logs(run_dir: Path):
    return parse_detail_log(run_dir / "mlperf_log_detail.txt"), parse_summary_log(run_dir / "mlperf_log_summary.txt")


def test_an_offline_run_shorter_than_its_min_duration_names_the_duration_measured_and_needed(runs):
    detail, summary = logs(runs["offline-short"])
    assert summary.get("Result is") == "INVALID" and summary.get("Min duration satisfied") == "NO"
    [check] = failing_checks(detail, summary)
    measured = f"{detail['result_max_latency_ns'] / 1e9:.3g} s"
    assert check == (f"min duration: the last of its 20 samples completed {measured} after the query was issued; "
                     "LoadGen needs min_duration 3 s")
    reason = explain_validity(detail, summary)
    assert reason.startswith("result_validity = INVALID, need == VALID: min duration: ")
    assert "LoadGen's advice: 'Increase expected QPS" in reason


def test_a_server_run_over_its_latency_bound_names_the_percentile_and_the_early_stopping_estimate(runs):
    detail, summary = logs(runs["server-slow"])
    assert summary.get("Performance constraints satisfied") == "NO"
    latency, early = failing_checks(detail, summary)
    p99 = f"{detail['result_99.00_percentile_latency_ns'] / 1e9:.3g} s"
    assert latency == f"latency bound: measured p99 {p99} over target_latency 0.5 s"
    assert early.startswith(f"early stopping: 5 of {detail['result_query_count']} queries over 0.5 s: "
                            "* Run unsuccessful.")
    assert "more queries" in early
    assert "LoadGen's advice: 'Reduce target QPS to improve latency.'" in explain_validity(detail, summary)


def test_a_server_run_too_short_for_early_stopping_names_that_alone(runs):
    detail, summary = logs(runs["server-few"])
    assert summary.get("Early stopping satisfied") == "NO"
    [check] = failing_checks(detail, summary)
    assert check.startswith(f"early stopping: 0 of {detail['result_query_count']} queries over 12 s: ")
    assert "Would need to run at least" in check


def test_a_run_that_issued_too_few_queries_names_the_counts(runs, tmp_path):
    log = tmp_path / "mlperf_log_detail.txt"
    log.write_text((runs["server-few"] / "mlperf_log_detail.txt").read_text())
    rewrite_detail_values(log, {"result_min_queries_met": False, "early_stopping_met": True,
                                "effective_min_query_count": 100})
    [check] = failing_checks(parse_detail_log(log))
    assert check == "min queries: 40 queries issued; LoadGen needs min_query_count 100 and min_sample_count 20"


def test_a_flag_the_detail_log_lacks_is_read_from_the_summary_beside_it(runs, tmp_path):
    """The summary's "Min duration satisfied : NO" still names the check when no result_min_duration_met is logged."""
    kept = [line for line in (runs["offline-short"] / "mlperf_log_detail.txt").read_text().splitlines(keepends=True)
            if not line.startswith(":::MLLOG ") or json.loads(line[9:])["key"] != "result_min_duration_met"]
    (tmp_path / "mlperf_log_detail.txt").write_text("".join(kept))
    (tmp_path / "mlperf_log_summary.txt").write_text((runs["offline-short"] / "mlperf_log_summary.txt").read_text())
    detail = parse_detail_log(tmp_path / "mlperf_log_detail.txt")
    assert "result_min_duration_met" not in detail
    [check] = failing_checks(detail)  # the summary found beside the detail log
    assert check.startswith("min duration: ")


def test_a_valid_run_says_which_conditions_loadgen_checked(runs, tmp_path):
    log = tmp_path / "mlperf_log_detail.txt"
    log.write_text((runs["server-few"] / "mlperf_log_detail.txt").read_text())
    rewrite_detail_values(log, {"result_validity": "VALID", "early_stopping_met": True})
    detail = parse_detail_log(log)
    assert failing_checks(detail) == []
    assert explain_validity(detail) == ("result_validity = VALID (LoadGen: min duration, min queries, latency bound, "
                                        "early stopping met)")
