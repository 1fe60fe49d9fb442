"""Under the embedded default's REJECTED verdict, the console says that this is expected and why: each limit of
the demo that explains failed rules names them and links the MLCommons checker source that applies them, a failure
the demo does not explain is named as such, and the last line says what a real submission needs. Other systems
get the audit's lines alone; exit codes stay the audit's."""

from __future__ import annotations

from pathlib import Path

import pytest

from audit.checker import AuditReport, Finding
from audit.submission_tree import SubmissionTreeBuilder
from harness.demo_verdict import CHECKER, REAL_SUBMISSION, demo_verdict_lines
from harness.pipeline import print_audit
from harness.scenarios import Scenario
from harness.system_config import DEFAULT_SYSTEM, load_system_config
from tests.helpers.loadgen_fixtures import (SUBMITTER, SYSTEM, SYSTEM_JSON, add_scenario, make_source_root,
                                            official_runs, rewrite_detail_values)


def report_failing(*rules: tuple[str, str]) -> AuditReport:
    findings = [Finding("src-dir", "-", "PASS", "present", "src")]
    findings += [Finding(rule, scenario, "FAIL", "a reason", "file") for rule, scenario in rules]
    return AuditReport(Path("tree"), "v6.1", tuple(findings))


@pytest.fixture(scope="module")
def cpu_tiny():
    return load_system_config(DEFAULT_SYSTEM)


def test_each_reason_names_its_failed_rules_and_links_the_checker_source_that_applies_them(cpu_tiny):
    report = report_failing(("scenario-set", "-"), ("perf-min-duration", "Offline"), ("accuracy-f1", "Offline"),
                            ("accuracy-sample-count", "Offline"), ("perf-offline-samples-per-query", "Offline"))
    first, *reasons, last = demo_verdict_lines(report, cpu_tiny, "offline")
    assert first.startswith("expected for the embedded default cpu-tiny, a demonstration of the pipeline")
    assert reasons == [
        f"  a random tiny model: its answers score an F1 of about 0 against the round's target (accuracy-f1; "
        f"{CHECKER}/checks/accuracy_check.py)",
        f"  32 synthetic samples, not the real dataset's 48,289 (accuracy-sample-count, "
        f"perf-offline-samples-per-query; {CHECKER}/constants.py)",
        f"  short runs: min_duration {cpu_tiny.scenario('offline').min_duration_ms / 1000:g} s, not 600 s "
        f"(perf-min-duration; {CHECKER}/checks/performance_check.py)",
        f"  one scenario per run: a submission holds Offline and Server or Interactive (scenario-set; "
        f"{CHECKER}/loader.py)",
    ]
    assert last == REAL_SUBMISSION
    assert all(part in last for part in ("weights", "datasets", "GPU system YAML"))


def test_interactive_counts_its_own_catalogue_against_the_8k_set_and_its_queries_against_early_stopping(cpu_tiny):
    lines = demo_verdict_lines(report_failing(("accuracy-total-count", "Interactive"),
                                              ("perf-early-stopping", "Interactive")), cpu_tiny, "interactive")
    assert lines[1].startswith("  24 synthetic samples, not the real dataset's 8,000 (accuracy-total-count; ")
    assert lines[2].startswith("  short runs: min_duration 15 s, not 600 s, and too few queries for LoadGen's early "
                               "stopping (perf-early-stopping; ")


def test_a_failure_the_demo_does_not_explain_is_named_for_a_look(cpu_tiny):
    lines = demo_verdict_lines(report_failing(("accuracy-f1", "Offline"), ("perf-loadgen-errors", "Offline")),
                               cpu_tiny, "offline")
    assert "  not explained by the demo's limits, so look at these: perf-loadgen-errors (Offline)" in lines
    assert lines[-1] == REAL_SUBMISSION


def test_an_accepted_tree_needs_no_explanation(cpu_tiny):
    assert demo_verdict_lines(report_failing(), cpu_tiny, "offline") == []


@pytest.fixture(scope="module")
def rejected_tree(tmp_path_factory) -> Path:
    """A tree of real LoadGen runs with one scenario (Offline) and a result LoadGen called INVALID."""
    base = tmp_path_factory.mktemp("tree")
    runs = official_runs(base / "runs", scenarios=("Offline",))
    rewrite_detail_values(runs[("Offline", "performance")] / "mlperf_log_detail.txt", {"result_validity": "INVALID"})
    with SubmissionTreeBuilder(base / "submission", submitter=SUBMITTER, system_name=SYSTEM) as builder:
        builder.add_system_description(SYSTEM_JSON)
        repo = make_source_root(base / "repo")
        builder.add_source(repo)
        builder.add_calibration(repo / "checkpoint")
        add_scenario(builder, "Offline", runs)
    return base / "submission"


def test_a_cpu_tiny_run_ends_with_the_explanation_and_exit_1(cpu_tiny, rejected_tree, capsys):
    assert print_audit(cpu_tiny, Scenario.OFFLINE, rejected_tree) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("VERDICT  REJECTED")
    err_lines = err.splitlines()
    assert err_lines[-1] == f"[q3vl] {REAL_SUBMISSION}"
    assert any(line.startswith("[q3vl] expected for the embedded default cpu-tiny") for line in err_lines)
    assert any("(scenario-set; " in line for line in err_lines)


def test_another_systems_run_gets_the_audits_lines_alone(rejected_tree, capsys):
    config = load_system_config("h200x1")
    assert print_audit(config, Scenario.OFFLINE, rejected_tree) == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("VERDICT  REJECTED")
    assert "expected for the embedded default" not in err and REAL_SUBMISSION not in err
