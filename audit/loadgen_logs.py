"""Parse LoadGen's own record of a run: mlperf_log_detail.txt (`:::MLLOG {json}` lines) and
mlperf_log_summary.txt (`key : value` text), the only source the audit trusts for numbers."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DETAIL_MARKER = ":::MLLOG"

# Detail-log keys the submission checker reads for this benchmark (checks/ and results.py of
# https://github.com/mlcommons/inference/tree/master/tools/submission/submission_checker). Keys LoadGen only writes
# in some modes (e.g. `requested_use_token_latencies` only when true, `result_validity` only in performance
# mode) are simply absent from `DetailLog.values` when not logged.
CHECKED_DETAIL_KEYS: tuple[str, ...] = (
    "loadgen_version",
    "sut_name",
    "qsl_reported_total_count",
    "requested_use_token_latencies",
    "effective_scenario",
    "effective_test_mode",
    "effective_sample_concatenate_permutation",
    "effective_performance_sample_count",
    "effective_accuracy_sample_count",
    "effective_qsl_rng_seed",
    "effective_sample_index_rng_seed",
    "effective_schedule_rng_seed",
    "effective_target_latency_ns",
    "effective_min_query_count",
    "effective_samples_per_query",
    "effective_min_duration_ms",
    "early_stopping_met",
    "early_stopping_result",
    "result_99.00_percentile_latency_ns",
    "result_samples_per_second",
    "result_completed_samples_per_sec",
    "result_validity",
)


class LogParseError(ValueError):
    """A LoadGen log file that cannot be read as LoadGen writes it."""


@dataclass(frozen=True)
class LogMessage:
    """One `:::MLLOG` entry that LoadGen flagged as an error or a warning."""

    key: str
    value: Any
    line_no: int


@dataclass(frozen=True)
class DetailLog:
    """The parsed detail log: the first value of every key, plus every error and warning entry."""

    path: Path
    values: dict[str, Any]
    errors: tuple[LogMessage, ...]
    warnings: tuple[LogMessage, ...]

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def __getitem__(self, key: str) -> Any:
        try:
            return self.values[key]
        except KeyError:
            raise KeyError(f"{self.path}: LoadGen detail log has no {key!r} entry") from None

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    @property
    def checked_values(self) -> dict[str, Any]:
        """The subset of `values` the submission checker reads (absent keys left out)."""
        return {k: self.values[k] for k in CHECKED_DETAIL_KEYS if k in self.values}


def parse_detail_log(path: Path) -> DetailLog:
    """Reads every `:::MLLOG` line; a key logged more than once keeps its first value (as the checker does).

    An entry is an error when LoadGen set `metadata.is_error` or its key starts with `error`.
    """
    path = Path(path)
    values: dict[str, Any] = {}
    errors: list[LogMessage] = []
    warnings: list[LogMessage] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.startswith(DETAIL_MARKER):
                continue
            try:
                entry = json.loads(line[len(DETAIL_MARKER):])
                key = entry["key"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise LogParseError(f"{path}:{line_no}: not a LoadGen :::MLLOG entry ({e})") from e
            value = entry.get("value")
            values.setdefault(key, value)
            metadata = entry.get("metadata") or {}
            if metadata.get("is_error") or key.startswith("error"):
                errors.append(LogMessage(key, value, line_no))
            elif metadata.get("is_warning") or key.startswith("warning"):
                warnings.append(LogMessage(key, value, line_no))
    if not values:
        raise LogParseError(f"{path}: no {DETAIL_MARKER} entries (not a LoadGen detail log)")
    return DetailLog(path=path, values=values, errors=tuple(errors), warnings=tuple(warnings))


_SUMMARY_LINE = re.compile(r"^\s*([^:]+?)\s*:\s*(.*?)\s*$")
_ERROR_COUNT = re.compile(r"^(\d+) ERRORS? encountered", re.MULTILINE)
_WARNING_COUNT = re.compile(r"^(\d+) WARNINGS? encountered", re.MULTILINE)


@dataclass(frozen=True)
class SummaryLog:
    """The parsed summary: its `key : value` lines (first occurrence) and the error/warning counts."""

    path: Path
    values: dict[str, str] = field(default_factory=dict)
    num_errors: int = 0
    num_warnings: int = 0

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key, default)

    @property
    def result_is_valid(self) -> bool:
        return self.values.get("Result is") == "VALID"


def parse_summary_log(path: Path) -> SummaryLog:
    """Reads `SUT name : PySUT`-style lines (keys stripped), `Result is : VALID` and the error count."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    # Performance runs start with the results header; accuracy runs only carry the error/warning lines.
    if "MLPerf Results Summary" not in text and " encountered" not in text:
        raise LogParseError(f"{path}: not a LoadGen summary log (no results header, no error/warning lines)")
    values: dict[str, str] = {}
    for line in text.splitlines():
        m = _SUMMARY_LINE.match(line)
        if m and m.group(2):
            values.setdefault(m.group(1), m.group(2))
    errors = _ERROR_COUNT.search(text)
    warnings = _WARNING_COUNT.search(text)
    return SummaryLog(
        path=path,
        values=values,
        num_errors=int(errors.group(1)) if errors else 0,
        num_warnings=int(warnings.group(1)) if warnings else 0,
    )
