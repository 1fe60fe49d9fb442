"""Why LoadGen called a performance run INVALID, in LoadGen's own numbers: each of its conditions of VALID that
failed (min duration, min queries, the latency bound, early stopping), with what it measured and what it needed,
read from the run's mlperf_log_detail.txt (mlperf_log_summary.txt's "... satisfied" lines where the detail log
lacks a flag), and LoadGen's own advice (`result_invalid_reason`).

The conditions and what each compares are LoadGen's PerformanceSummary::MinDurationMet, MinQueriesMet,
MinSamplesMet, PerfConstraintsMet and EarlyStopping:
https://github.com/mlcommons/inference/blob/master/loadgen/results.cc
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from audit.loadgen_logs import DetailLog, LogParseError, SummaryLog, parse_summary_log
from audit.rules.base import Outcome, ScenarioContext, check_that

SUMMARY_FILE = "mlperf_log_summary.txt"


def seconds(ns: Any) -> str:
    """A nanosecond count of LoadGen's as seconds, to 3 significant digits ('not logged' when absent)."""
    return f"{ns / 1e9:.3g} s" if isinstance(ns, (int, float)) else "not logged"


def _ms_as_seconds(ms: Any) -> str:
    return seconds(ms * 1e6) if isinstance(ms, (int, float)) else "not logged"


def _min_duration(log: DetailLog) -> str:
    """Offline: the longest sample latency (the one query is issued at the start); Server: when the last query
    was scheduled, (queries - 1) / the scheduled rate, as LoadGen derives that rate from it."""
    needed = f"LoadGen needs min_duration {_ms_as_seconds(log.get('effective_min_duration_ms'))}"
    if log.get("effective_scenario") == "Offline":
        samples = log.get("generated_samples_per_query", "?")
        return (f"the last of its {samples} samples completed {seconds(log.get('result_max_latency_ns'))} after "
                f"the query was issued; {needed}")
    queries, rate = log.get("result_query_count"), log.get("result_scheduled_samples_per_sec")
    if isinstance(queries, int) and isinstance(rate, (int, float)) and rate > 0:
        return f"the last of its {queries} queries was scheduled {(queries - 1) / rate:.3g} s into the run; {needed}"
    return f"the last query's scheduled time is not logged; {needed}"


def _min_queries(log: DetailLog) -> str:
    return (f"{log.get('result_query_count', 'not logged')} queries issued; LoadGen needs min_query_count "
            f"{log.get('effective_min_query_count', 'not logged')} and min_sample_count "
            f"{log.get('effective_min_sample_count', 'not logged')}")


def _percentile(log: DetailLog) -> tuple[str, Any]:
    percentile = log.get("effective_target_latency_percentile", 0.99)
    if not isinstance(percentile, float):
        return "percentile", None
    return f"p{percentile * 100:g}", log.get(f"result_{percentile * 100:.2f}_percentile_latency_ns")


def _latency_bound(log: DetailLog) -> str:
    label, measured = _percentile(log)
    return f"measured {label} {seconds(measured)} over target_latency {seconds(log.get('effective_target_latency_ns'))}"


def _early_stopping(log: DetailLog) -> str:
    estimate = " ".join(str(log.get("early_stopping_result") or "no estimate logged").split())
    over = log.get("result_overlatency_query_count")
    if over is None:
        return estimate
    return (f"{over} of {log.get('result_query_count', '?')} queries over "
            f"{seconds(log.get('effective_target_latency_ns'))}: {estimate}")


@dataclass(frozen=True)
class LoadGenCheck:
    """One of LoadGen's conditions of VALID: its detail-log flag, its line in the summary, what it compared."""

    name: str
    flag: str
    summary_label: str
    explain: Callable[[DetailLog], str]


CHECKS: tuple[LoadGenCheck, ...] = (
    LoadGenCheck("min duration", "result_min_duration_met", "Min duration satisfied", _min_duration),
    LoadGenCheck("min queries", "result_min_queries_met", "Min queries satisfied", _min_queries),
    LoadGenCheck("latency bound", "result_perf_constraints_met", "Performance constraints satisfied", _latency_bound),
    LoadGenCheck("early stopping", "early_stopping_met", "Early stopping satisfied", _early_stopping),
)


def _summary_beside(log: DetailLog) -> SummaryLog | None:
    path = Path(log.path).parent / SUMMARY_FILE
    try:
        return parse_summary_log(path) if path.is_file() else None
    except (LogParseError, UnicodeDecodeError):
        return None  # perf-files fails it


def _met(check: LoadGenCheck, log: DetailLog, summary: SummaryLog | None) -> bool | None:
    """The detail log's flag; else the summary's "Yes"/"NO" line; None when neither says (not this scenario's)."""
    if check.flag in log:
        return log[check.flag] is True
    said = summary.get(check.summary_label) if summary is not None else None
    return None if said is None else said == "Yes"


def failing_checks(log: DetailLog, summary: SummaryLog | None = None) -> list[str]:
    """'name: measured against needed' for every condition LoadGen logged as not met, in LoadGen's order."""
    summary = summary if summary is not None else _summary_beside(log)
    return [f"{check.name}: {check.explain(log)}" for check in CHECKS if _met(check, log, summary) is False]


def explain_validity(log: DetailLog, summary: SummaryLog | None = None) -> str:
    """The verdict with its reasons: which checks failed and LoadGen's advice, or which conditions were met."""
    validity = log.get("result_validity", "not logged")
    if validity == "VALID":
        met = [check.name for check in CHECKS if check.flag in log]
        return f"result_validity = VALID (LoadGen: {', '.join(met) or 'its conditions'} met)"
    failing = failing_checks(log, summary)
    reason = f"result_validity = {validity}, need == VALID: "
    reason += ("; ".join(failing) if failing else "LoadGen logged no failing condition")
    advice = " ".join(str(log.get("result_invalid_reason") or "").split())
    return reason + (f"; LoadGen's advice: {advice!r}" if advice else "")


def check_result_valid(ctx: ScenarioContext) -> Outcome:
    """perf-result-valid: LoadGen judged the run VALID; when it did not, the reason names its failing checks."""
    log = ctx.detail_log("performance")
    return check_that(log.get("result_validity") == "VALID", explain_validity(log), log.path)
