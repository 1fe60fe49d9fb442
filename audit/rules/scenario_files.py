"""Rules on the files of one scenario dir: LoadGen run dirs hold exactly the allowed files, no LoadGen
errors, accuracy.txt (F1, hash), the truncated accuracy log, measurements, user.conf, README, compliance."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from audit.loadgen_logs import LogParseError, parse_summary_log
from audit.rules.base import (Outcome, Rule, ScenarioContext, Unavailable, check_that, failed, passed,
                              read_json_object)
from audit.rules.rounds import (ACCURACY_F1_PATTERN, ACCURACY_F1_WRITTEN, ACCURACY_HASH_PATTERN,
                                ACCURACY_OPTIONAL_FILES, ACCURACY_REQUIRED_FILES, COMPLIANCE_TEST_DIR, FILED_FAILED_SAMPLES,
                                MAX_ACCURACY_LOG_SIZE, MEASUREMENTS_REQUIRED_FIELDS, PERF_RUN_OPTIONAL_FILES,
                                PERF_RUN_REQUIRED_FILES)


def _file_list_check(run_dir: Path, required: tuple[str, ...], optional: tuple[str, ...],
                     summary_required: bool) -> Outcome:
    if not run_dir.is_dir():
        return failed("directory missing", run_dir)
    present = {p.name for p in run_dir.iterdir()}
    missing = [f for f in required if f not in present]
    if missing:
        return failed(f"missing {', '.join(missing)}", run_dir)
    extra = sorted(present - set(required) - set(optional))
    if extra:
        return failed(f"unexpected files {', '.join(extra)} (allowed: {', '.join(required + optional)})",
                      run_dir)
    summary = run_dir / "mlperf_log_summary.txt"
    if summary_required or summary.exists():
        try:
            parse_summary_log(summary)
        except (LogParseError, UnicodeDecodeError) as e:
            return failed(f"unreadable LoadGen summary log ({e})", summary)
    return passed(f"{', '.join(sorted(present))}", run_dir)


def _run_files_check(ctx: ScenarioContext, run: Literal["performance", "accuracy"]) -> Outcome:
    if run == "performance":
        outcome = _file_list_check(ctx.performance_dir, PERF_RUN_REQUIRED_FILES, PERF_RUN_OPTIONAL_FILES, True)
    else:
        outcome = _file_list_check(ctx.accuracy_dir, ACCURACY_REQUIRED_FILES, ACCURACY_OPTIONAL_FILES, False)
    if outcome.status == "PASS":
        try:
            ctx.detail_log(run)  # an unreadable detail log is this rule's failure, not a skip
        except Unavailable as e:
            return failed(e.reason.removeprefix("not checked: "), e.file)
    return outcome


def check_performance_files(ctx: ScenarioContext) -> Outcome:
    return _run_files_check(ctx, "performance")


def check_accuracy_files(ctx: ScenarioContext) -> Outcome:
    return _run_files_check(ctx, "accuracy")


def _errors_check(ctx: ScenarioContext, run: str) -> Outcome:
    log = ctx.detail_log(run)
    if not log.errors:
        return passed("no LoadGen errors", log.path)
    shown = "; ".join(f"line {e.line_no} {e.key}: {e.value}" for e in log.errors[:3])
    more = f" (+{len(log.errors) - 3} more)" if len(log.errors) > 3 else ""
    return failed(f"{len(log.errors)} LoadGen error(s): {shown}{more}", log.path)


def check_performance_errors(ctx: ScenarioContext) -> Outcome:
    return _errors_check(ctx, "performance")


def check_accuracy_errors(ctx: ScenarioContext) -> Outcome:
    return _errors_check(ctx, "accuracy")


def _accuracy_txt(ctx: ScenarioContext) -> tuple[Path, str]:
    path = ctx.accuracy_dir / "accuracy.txt"
    if not path.is_file():
        raise Unavailable("not checked: accuracy.txt missing", path)
    return path, path.read_text(encoding="utf-8", errors="replace")


def check_accuracy_f1(ctx: ScenarioContext) -> Outcome:
    path, text = _accuracy_txt(ctx)
    target = ctx.round.accuracy_targets[ctx.scenario]
    line, match = next(((ln, m) for ln, m in ((ln, re.match(ACCURACY_F1_PATTERN, ln)) for ln in text.splitlines())
                        if m), ("", None))
    if match is None:
        return failed('no {"f1": ...} line', path)
    written = re.search(ACCURACY_F1_WRITTEN, line)
    try:
        official, f1 = float(match.group(1)), float(written.group(1)) if written else None
    except ValueError:
        return failed(f"F1 {match.group(1)!r} is not a number", path)
    if f1 is None or f1 != official:
        shown = written.group(1) if written else line.strip()
        return failed(f"F1 written as {shown}, which the checker's pattern reads as {match.group(1)}: "
                      f"write it in positional notation", path)
    return check_that(f1 >= target, f"F1 {f1:.5f} {'>=' if f1 >= target else '<'} target {target:.6f}", path)


def check_accuracy_hash(ctx: ScenarioContext) -> Outcome:
    path, text = _accuracy_txt(ctx)
    hashes = re.findall(ACCURACY_HASH_PATTERN, text, flags=re.MULTILINE)
    return check_that(bool(hashes), f"{len(hashes)} hash= line(s)" if hashes else "no hash= line", path)


def check_accuracy_log_size(ctx: ScenarioContext) -> Outcome:
    path = ctx.accuracy_dir / "mlperf_log_accuracy.json"
    if not path.is_file():
        raise Unavailable("not checked: mlperf_log_accuracy.json missing", path)
    size = path.stat().st_size
    ok = size <= MAX_ACCURACY_LOG_SIZE
    return check_that(ok, f"{size} bytes {'<=' if ok else '>'} {MAX_ACCURACY_LOG_SIZE} "
                          f"({'truncated' if ok else 'run audit.truncate first'})", path)


def check_measurements(ctx: ScenarioContext) -> Outcome:
    path = ctx.dir / "measurements.json"
    try:
        data = read_json_object(path)
    except Unavailable as e:
        return failed(e.reason.removeprefix("not checked: "), path)
    empty = [k for k in MEASUREMENTS_REQUIRED_FIELDS if not data.get(k)]
    return check_that(not empty, f"empty or missing: {', '.join(empty)}" if empty else
                      "all required fields set", path)


def _non_empty_file(path: Path) -> Outcome:
    if not path.is_file():
        return failed("missing", path)
    has_content = bool(path.read_bytes().strip())
    return check_that(has_content, "present" if has_content else "empty", path)


def check_user_conf(ctx: ScenarioContext) -> Outcome:
    return _non_empty_file(ctx.dir / "user.conf")


def check_readme(ctx: ScenarioContext) -> Outcome:
    return _non_empty_file(ctx.dir / "README.md")


def _failed_samples_report(ctx: ScenarioContext, run: str) -> Outcome:
    path = ctx.dir / FILED_FAILED_SAMPLES.format(run=run)
    if not path.exists():
        return passed("no failed samples recorded", path)
    try:
        samples = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        return Outcome("WARN", f"unreadable failed-sample record ({e})", path)
    if not samples:
        return passed("0 failed samples", path)
    shown = ", ".join(f"#{s.get('sample_index')}: {s.get('error')}" for s in samples[:3])
    return Outcome("WARN", f"{len(samples)} sample(s) answered with an error: {shown}"
                           f"{' ...' if len(samples) > 3 else ''}", path)


def check_failed_samples_performance(ctx: ScenarioContext) -> Outcome:
    return _failed_samples_report(ctx, "performance")


def check_failed_samples_accuracy(ctx: ScenarioContext) -> Outcome:
    return _failed_samples_report(ctx, "accuracy")


def check_compliance(ctx: ScenarioContext) -> Outcome:
    required = ctx.round.compliance_tests
    present = sorted(p.name for p in ctx.dir.iterdir() if p.is_dir() and COMPLIANCE_TEST_DIR.match(p.name))
    missing = [t for t in required if t not in present]
    if missing:
        return failed(f"required compliance test dirs missing: {', '.join(missing)}", ctx.dir)
    extra = [t for t in present if t not in required]
    if extra:
        return Outcome("WARN", f"{', '.join(extra)} present but not required for this benchmark in "
                               f"{ctx.round.version}; not verified by this audit", ctx.dir)
    return passed(f"required compliance tests: {', '.join(required) or f'none in {ctx.round.version}'}", ctx.dir)


CLOSED = ("closed",)

RULES: tuple[Rule, ...] = (
    Rule("perf-files", "scenario", "performance/run_1 holds LoadGen's summary and detail logs, nothing else",
         check_performance_files),
    Rule("perf-loadgen-errors", "scenario", "no LoadGen errors in the performance detail log",
         check_performance_errors),
    Rule("accuracy-files", "scenario", "accuracy/ holds the detail log, accuracy.txt and the accuracy log",
         check_accuracy_files),
    Rule("accuracy-loadgen-errors", "scenario", "no LoadGen errors in the accuracy detail log",
         check_accuracy_errors),
    Rule("accuracy-f1", "scenario", "hierarchical F1 in accuracy.txt meets the scenario's target",
         check_accuracy_f1, divisions=CLOSED),
    Rule("accuracy-hash", "scenario", "accuracy.txt carries a hash= line", check_accuracy_hash,
         divisions=CLOSED),
    Rule("accuracy-log-size", "scenario", "mlperf_log_accuracy.json is truncated to at most 10 KiB",
         check_accuracy_log_size),
    Rule("measurements", "scenario", "measurements.json has the required non-empty fields", check_measurements),
    Rule("user-conf", "scenario", "user.conf present and non-empty", check_user_conf),
    Rule("readme", "scenario", "README.md present and non-empty", check_readme),
    Rule("compliance", "scenario", "compliance test dirs the round requires (none for this benchmark)",
         check_compliance, divisions=CLOSED),
    Rule("failed-samples-performance", "scenario", "report samples the harness answered with an error",
         check_failed_samples_performance),
    Rule("failed-samples-accuracy", "scenario", "report samples the harness answered with an error",
         check_failed_samples_accuracy),
)
