"""The audit applies each submission rule: a tree built from real LoadGen logs (doctored to official-length
values) passes every rule, and breaking one thing fails exactly the rule that names it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Callable

import pytest

from audit.__main__ import main as audit_main
from audit.checker import audit_tree
from audit.rules import RULES
from audit.rules.rounds import MODEL, ROUNDS
from audit.submission_tree import SubmissionTreeBuilder
from tests.helpers.loadgen_fixtures import (SUBMITTER, SYSTEM, SYSTEM_JSON, add_scenario, append_detail_entry,
                                            make_source_root, official_runs, rewrite_detail_values)


@pytest.fixture(scope="module")
def golden_tree(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("golden")
    runs = official_runs(base / "runs")
    with SubmissionTreeBuilder(base / "tree", submitter=SUBMITTER, system_name=SYSTEM) as builder:
        builder.add_system_description(SYSTEM_JSON)
        repo = make_source_root(base / "repo")
        builder.add_source(repo)
        builder.add_calibration(repo / "checkpoint")
        for scenario in ("Offline", "Server", "Interactive"):
            add_scenario(builder, scenario, runs)
    return base / "tree"


@pytest.fixture
def tree(golden_tree, tmp_path) -> Path:
    copy = tmp_path / "tree"
    shutil.copytree(golden_tree, copy)
    return copy


def sub(tree: Path) -> Path:
    return tree / "closed" / SUBMITTER


def scen(tree: Path, scenario: str) -> Path:
    return sub(tree) / "results" / SYSTEM / MODEL / scenario


def failures(tree: Path, version: str = "v6.1") -> set[tuple[str, str]]:
    return {(f.rule_id, f.scenario) for f in audit_tree(tree, version=version).failures}


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def perf_log(tree: Path, scenario: str) -> Path:
    return scen(tree, scenario) / "performance" / "run_1" / "mlperf_log_detail.txt"


def acc_log(tree: Path, scenario: str) -> Path:
    return scen(tree, scenario) / "accuracy" / "mlperf_log_detail.txt"


def set_f1(tree: Path, scenario: str, f1: float) -> None:
    path = scen(tree, scenario) / "accuracy" / "accuracy.txt"
    path.write_text(re.sub(r'\{"f1": [\d.]+\}', '{"f1": %s}' % f1, path.read_text()))


def system_json(tree: Path) -> Path:
    return sub(tree) / "systems" / f"{SYSTEM}.json"


def test_golden_tree_passes_every_rule(golden_tree):
    report = audit_tree(golden_tree)
    assert report.accepted, "\n".join(report.lines())
    assert {f.status for f in report.findings} == {"PASS"}
    checked = {f.rule_id for f in report.findings}
    assert checked == {r.id for r in RULES}  # every rule ran (F1 and hash apply to closed)


# The fields a system description with is_network set must carry (the checker's network-mode list).
NETWORK_FIELDS = {k: "x" for k in ("network_type", "network_media", "network_rate", "nic_loadgen", "number_nic_loadgen",
                                   "net_software_stack_loadgen", "network_protocol", "number_connections", "nic_sut",
                                   "number_nic_sut", "net_software_stack_sut", "network_topology")}

# (rule that must fail, scenario column, how to break the golden tree)
BREAKAGES: list[tuple[str, str, Callable[[Path], None]]] = [
    ("layout", "-", lambda t: (t / "preview").mkdir()),
    ("src-dir", "-", lambda t: shutil.rmtree(sub(t) / "src")),
    ("results-present", "-", lambda t: (sub(t) / "results" / SYSTEM / MODEL).rename(
        sub(t) / "results" / SYSTEM / "llama2-70b-99.9")),
    ("calibration-doc", "-", lambda t: (sub(t) / "calibration.md").unlink()),
    ("system-description", "-", lambda t: system_json(t).unlink()),
    ("system-required-fields", "-", lambda t: edit_json(system_json(t), hw_notes=None)),
    ("system-meaningful-fields", "-", lambda t: edit_json(system_json(t), cooling="")),
    ("system-status", "-", lambda t: edit_json(system_json(t), status="released")),
    ("system-type", "-", lambda t: edit_json(system_json(t), system_type="mobile")),
    ("system-type", "-", lambda t: edit_json(system_json(t), system_type="Datacenter")),
    ("system-status", "-", lambda t: edit_json(system_json(t), status=" rdi")),
    ("system-required-fields", "-", lambda t: edit_json(system_json(t), is_network="false")),
    ("system-network", "-", lambda t: edit_json(system_json(t), is_network="True", **NETWORK_FIELDS)),
    ("system-benchmarks", "-", lambda t: (sub(t) / "results" / SYSTEM / "llama2-70b").mkdir()),
    ("system-division", "-", lambda t: edit_json(system_json(t), division="open")),
    ("system-submitter", "-", lambda t: edit_json(system_json(t), submitter="SomeoneElse")),
    ("scenario-set", "-", lambda t: shutil.rmtree(scen(t, "Offline"))),
    ("scenario-set", "-", lambda t: [shutil.rmtree(scen(t, s)) for s in ("Server", "Interactive")]),
    ("scenario-set", "-", lambda t: (scen(t, "Offline").parent / "SingleStream").mkdir()),
    ("perf-files", "Server", lambda t: (perf_log(t, "Server").parent / "mlperf_log_trace.json").write_text("")),
    ("perf-files", "Offline", lambda t: (perf_log(t, "Offline").parent / "mlperf_log_summary.txt").unlink()),
    ("perf-loadgen-errors", "Offline", lambda t: append_detail_entry(
        perf_log(t, "Offline"), "error_invalid_config", "Multiple conf files are used.", is_error=True)),
    ("perf-scenario", "Server", lambda t: rewrite_detail_values(perf_log(t, "Server"),
                                                                {"effective_scenario": "Offline"})),
    ("perf-qsl-rng-seed", "Offline", lambda t: rewrite_detail_values(perf_log(t, "Offline"),
                                                                     {"effective_qsl_rng_seed": 0})),
    ("perf-sample-index-rng-seed", "Server", lambda t: rewrite_detail_values(
        perf_log(t, "Server"), {"effective_sample_index_rng_seed": 14276810075590677512})),
    ("perf-schedule-rng-seed", "Interactive", lambda t: rewrite_detail_values(
        perf_log(t, "Interactive"), {"effective_schedule_rng_seed": 1})),
    ("perf-sample-count", "Offline", lambda t: rewrite_detail_values(
        perf_log(t, "Offline"), {"effective_performance_sample_count": 48288})),
    ("perf-sample-count", "Interactive", lambda t: rewrite_detail_values(  # the 8k catalogue's size is not enough
        perf_log(t, "Interactive"), {"effective_performance_sample_count": 8000})),
    ("perf-offline-samples-per-query", "Offline", lambda t: rewrite_detail_values(
        perf_log(t, "Offline"), {"effective_samples_per_query": 22})),
    ("perf-min-duration", "Server", lambda t: rewrite_detail_values(
        perf_log(t, "Server"), {"effective_min_duration_ms": 599999})),
    ("perf-equal-issue", "Offline", lambda t: rewrite_detail_values(
        perf_log(t, "Offline"), {"effective_sample_concatenate_permutation": False})),
    ("perf-token-latencies-off", "Server", lambda t: append_detail_entry(
        perf_log(t, "Server"), "requested_use_token_latencies", True)),
    ("perf-result-valid", "Offline", lambda t: rewrite_detail_values(perf_log(t, "Offline"),
                                                                     {"result_validity": "INVALID"})),
    ("perf-result-metric", "Offline", lambda t: rewrite_detail_values(perf_log(t, "Offline"),
                                                                      {"result_samples_per_second": 0})),
    ("perf-early-stopping", "Interactive", lambda t: rewrite_detail_values(
        perf_log(t, "Interactive"), {"early_stopping_met": False})),
    ("perf-latency-constraint", "Server", lambda t: rewrite_detail_values(
        perf_log(t, "Server"), {"effective_target_latency_ns": 12_000_000_001})),
    ("accuracy-files", "Server", lambda t: (acc_log(t, "Server").parent / "notes.txt").write_text("x")),
    ("accuracy-loadgen-errors", "Interactive", lambda t: append_detail_entry(
        acc_log(t, "Interactive"), "error_runtime", "sample completed twice", is_error=True)),
    ("accuracy-scenario", "Offline", lambda t: rewrite_detail_values(acc_log(t, "Offline"),
                                                                     {"effective_scenario": "Server"})),
    ("accuracy-sample-count", "Server", lambda t: rewrite_detail_values(
        acc_log(t, "Server"), {"effective_accuracy_sample_count": 48288})),
    ("accuracy-total-count", "Interactive", lambda t: rewrite_detail_values(
        acc_log(t, "Interactive"), {"qsl_reported_total_count": 48289})),
    ("accuracy-f1", "Offline", lambda t: set_f1(t, "Offline", 0.7823)),
    ("accuracy-hash", "Server", lambda t: (acc_log(t, "Server").parent / "accuracy.txt").write_text(
        'Results\n\n{"f1": 0.79}\n')),
    ("accuracy-log-size", "Offline", lambda t: (acc_log(t, "Offline").parent / "mlperf_log_accuracy.json")
     .write_text("[" + " " * 10240 + "]")),
    ("measurements", "Server", lambda t: edit_json(scen(t, "Server") / "measurements.json", retraining="")),
    ("user-conf", "Offline", lambda t: (scen(t, "Offline") / "user.conf").write_text("\n")),
    ("readme", "Interactive", lambda t: (scen(t, "Interactive") / "README.md").unlink()),
]


@pytest.mark.parametrize("rule_id,scenario,breakage", BREAKAGES,
                         ids=[f"{r}-{s}-{i}" for i, (r, s, _) in enumerate(BREAKAGES)])
def test_breaking_one_thing_fails_exactly_its_rule(tree, rule_id, scenario, breakage):
    breakage(tree)
    assert failures(tree) == {(rule_id, scenario)}


def test_every_rejecting_rule_has_a_breakage_test():
    informational = {"failed-samples-performance", "failed-samples-accuracy", "compliance"}
    assert {r.id for r in RULES} - informational <= {b[0] for b in BREAKAGES}


def test_interactive_is_held_to_1_5_s_although_the_official_checker_allows_12_s(tree):
    rewrite_detail_values(perf_log(tree, "Interactive"), {"effective_target_latency_ns": 12_000_000_000})
    report = audit_tree(tree)
    [finding] = report.failures
    assert (finding.rule_id, finding.scenario) == ("perf-latency-constraint", "Interactive")
    assert "1.5 s" in finding.reason and "12 s" in finding.reason


def test_interactive_f1_target_is_lower_than_offline(tree):
    set_f1(tree, "Interactive", 0.781)
    set_f1(tree, "Offline", 0.781)
    assert failures(tree) == {("accuracy-f1", "Offline")}


def test_missing_detail_log_fails_its_files_rule_and_skips_the_rules_that_read_it(tree):
    perf_log(tree, "Server").unlink()
    report = audit_tree(tree)
    assert {(f.rule_id, f.scenario) for f in report.failures} == {("perf-files", "Server")}
    skipped = {f.rule_id for f in report.findings if f.status == "SKIP"}
    assert {"perf-min-duration", "perf-early-stopping", "perf-qsl-rng-seed"} <= skipped


def test_failed_samples_are_reported_as_warnings_without_rejecting(tree):
    record = [{"sample_index": 7, "error": "image decode failed: truncated JPEG"}]
    (scen(tree, "Server") / "failed_samples_performance.json").write_text(json.dumps(record))
    report = audit_tree(tree)
    assert report.accepted
    [warning] = [f for f in report.findings if f.status == "WARN"]
    assert (warning.rule_id, warning.scenario) == ("failed-samples-performance", "Server")
    assert "#7" in warning.reason


def test_compliance_dirs_are_not_required_and_extra_ones_are_reported(tree):
    report = audit_tree(tree)
    assert all("none in v6.1" in f.reason for f in report.findings if f.rule_id == "compliance")
    (scen(tree, "Offline") / "TEST01").mkdir()
    report = audit_tree(tree)
    assert report.accepted
    [warning] = [f for f in report.findings if f.status == "WARN"]
    assert (warning.rule_id, warning.scenario) == ("compliance", "Offline") and "TEST01" in warning.reason


def test_v6_0_rules_reject_v6_1_seeds_and_the_interactive_scenario(tree):
    failed = failures(tree, version="v6.0")
    assert ("scenario-set", "-") in failed
    assert {("perf-qsl-rng-seed", s) for s in ("Offline", "Server")} <= failed
    assert not any(s == "Interactive" for _, s in failed)  # an unknown scenario dir is not audited further
    assert ROUNDS["v6.0"].required_scenarios == ("Offline", "Server")


def test_open_division_has_no_accuracy_target(tree):
    (tree / "closed").rename(tree / "open")
    edit_json(tree / "open" / SUBMITTER / "systems" / f"{SYSTEM}.json", division="open")
    path = tree / "open" / SUBMITTER / "results" / SYSTEM / MODEL / "Offline" / "accuracy" / "accuracy.txt"
    path.write_text('Results\n\n{"f1": 0.1}\n')
    report = audit_tree(tree)
    assert report.accepted, "\n".join(report.lines())
    assert "accuracy-f1" not in {f.rule_id for f in report.findings}


def test_submitter_filter_audits_only_that_submitter(tree):
    assert audit_tree(tree, submitter=SUBMITTER).accepted
    assert {(f.rule_id, f.status) for f in audit_tree(tree, submitter="Nobody").findings} == {("layout", "FAIL")}


def test_cli_prints_one_line_per_rule_and_exits_by_verdict(tree, capsys):
    assert audit_main([str(tree)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("VERDICT  ACCEPTED")
    assert all(re.match(r"^(PASS|FAIL|WARN|SKIP)  \S+  \S+  .+  \(.+\)$", line) for line in lines[:-1])
    rewrite_detail_values(perf_log(tree, "Offline"), {"result_validity": "INVALID"})
    assert audit_main([str(tree), "--version", "v6.1"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^FAIL  perf-result-valid  Offline  result_validity = INVALID", out, re.MULTILINE)
    assert "VERDICT  REJECTED  1 of" in out


def test_cli_exits_2_when_there_is_no_tree(tmp_path, capsys):
    assert audit_main([str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_f1_written_in_scientific_notation_is_read_as_written(tree):
    path = scen(tree, "Offline") / "accuracy" / "accuracy.txt"
    path.write_text(re.sub(r'\{"f1": [\d.]+\}', '{"f1": 6.9e-06}', path.read_text()))
    [finding] = audit_tree(tree).failures
    assert (finding.rule_id, finding.scenario) == ("accuracy-f1", "Offline")
    assert "6.9e-06" in finding.reason and "reads as 6.9" in finding.reason


def test_f1_in_positional_notation_below_target_fails_on_its_value(tree):
    set_f1(tree, "Offline", "0.0000069")
    [finding] = audit_tree(tree).failures
    assert finding.rule_id == "accuracy-f1" and "F1 0.00001 < target" in finding.reason


def test_measured_latency_over_the_constraint_fails_with_the_measured_and_target_values(tree):
    rewrite_detail_values(perf_log(tree, "Interactive"), {
        "result_99.00_percentile_latency_ns": 3_820_000_000, "result_validity": "INVALID",
        "result_overlatency_query_count": 31,
        "early_stopping_result": " * Run unsuccessful.\n * Processed 40 queries.\n * Would need to run at least "
                                 "9000 more queries"})
    by_rule = {f.rule_id: f for f in audit_tree(tree).failures}
    assert set(by_rule) == {"perf-latency-constraint", "perf-result-valid"}
    reason = by_rule["perf-latency-constraint"].reason
    assert "measured p99 3.82 s" in reason and "constraint 1.5 s" in reason
    assert "31 of 40 queries over 1.5 s" in reason and "at least 9000 more queries" in reason


def test_an_invalid_result_names_loadgens_failing_check_with_the_measured_and_needed_values(tree):
    rewrite_detail_values(perf_log(tree, "Offline"), {
        "result_validity": "INVALID", "result_min_duration_met": False, "result_max_latency_ns": 8_210_000_000})
    [finding] = audit_tree(tree).failures
    assert (finding.rule_id, finding.scenario) == ("perf-result-valid", "Offline")
    assert finding.reason.startswith("result_validity = INVALID, need == VALID: min duration: the last of its ")
    assert "samples completed 8.21 s after the query was issued; LoadGen needs min_duration 600 s" in finding.reason


def test_cli_accepts_one_submission_dir_as_the_readme_quotes_it(tree, capsys):
    (tree / "closed" / "Other").mkdir()  # an incomplete submission beside ours is not audited
    assert audit_main([str(sub(tree))]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("VERDICT  ACCEPTED")
    assert audit_main([str(tree)]) == 1  # the whole tree includes Other
    assert audit_main([str(sub(tree)), "--submitter", "Other"]) == 2


def test_cli_help_names_both_forms_of_the_tree(capsys):
    with pytest.raises(SystemExit):
        audit_main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "the directory holding closed/" in help_text and "closed/<submitter>" in help_text


@pytest.mark.parametrize("value", ["true", "TRUE", True])
def test_network_mode_in_a_closed_submission_fails_as_the_checker_rejects_it(tree, value):
    edit_json(system_json(tree), is_network=value)
    by_rule = {f.rule_id: f for f in audit_tree(tree).failures}
    assert set(by_rule) == {"system-network", "system-required-fields"}
    assert "network_type" in by_rule["system-required-fields"].reason
    edit_json(system_json(tree), **NETWORK_FIELDS)
    [finding] = audit_tree(tree).failures
    assert finding.rule_id == "system-network"
    expected = "not a string" if value is True else "incorrect network mode (=True) for division 'closed'"
    assert expected in finding.reason


def test_status_is_lower_cased_as_the_checker_does_but_not_stripped(tree):
    edit_json(system_json(tree), status="RDI")
    assert failures(tree) == set()
    edit_json(system_json(tree), status=["rdi"])
    [finding] = audit_tree(tree).failures
    assert finding.rule_id == "system-status" and "stops with an error" in finding.reason


@pytest.mark.parametrize("folder", ["llama3.1-8b", "llama3_1-8b"])
def test_results_of_another_benchmark_fail_as_the_checker_judges_them_by_that_benchmarks_rules(tree, folder):
    shutil.copytree(scen(tree, "Offline"), sub(tree) / "results" / SYSTEM / folder / "Offline")
    report = audit_tree(tree)
    assert not report.accepted
    [finding] = report.failures
    assert (finding.rule_id, finding.scenario) == ("system-benchmarks", "-")
    assert f"{folder}/Offline" in finding.reason and "llama3.1-8b's own rules" in finding.reason
    assert "Missing TEST06 in compliance dir" in finding.reason  # the checker's words for llama3.1-8b
    assert "rejects the whole submission" in finding.reason


def test_an_empty_folder_of_another_benchmark_is_reported_not_failed(tree):
    (sub(tree) / "results" / SYSTEM / "gpt-oss-120b").mkdir()  # the checker finds no scenario in it to judge
    report = audit_tree(tree)
    assert report.accepted
    [warning] = [f for f in report.findings if f.status == "WARN"]
    assert warning.rule_id == "system-benchmarks" and "gpt-oss-120b" in warning.reason


@pytest.mark.parametrize("changes", [{"submitter": SUBMITTER.lower()}, {"division": "Closed"},
                                     {"submitter": SUBMITTER.upper(), "division": "CLOSED"}])
def test_submitter_and_division_are_compared_lower_cased_as_the_checker_does(tree, changes):
    edit_json(system_json(tree), **changes)
    assert failures(tree) == set()


@pytest.mark.parametrize("field", ["submitter", "division"])
def test_a_submitter_or_division_that_is_not_a_string_fails(tree, field):
    edit_json(system_json(tree), **{field: ["x"]})
    [finding] = audit_tree(tree).failures
    assert finding.rule_id == f"system-{field}" and "is not a string" in finding.reason


def test_calibration_doc_may_live_under_documentation(tree):
    (sub(tree) / "documentation").mkdir()
    (sub(tree) / "calibration.md").rename(sub(tree) / "documentation" / "calibration.md")
    assert failures(tree) == set()
