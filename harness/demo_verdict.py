"""What the embedded default's REJECTED means: cpu-tiny is a demonstration of the pipeline, not a submission (a
random tiny model, a small synthetic catalogue, runs of seconds on CPU), so the audit rejects it by design.

After the verdict of a cpu-tiny run the console says so: one line per limit of the demo that explains some of the
failed rules, naming them and linking the MLCommons submission checker's source that applies each; any failure
the demo's limits do not explain is named as such; the last line says what a real submission needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from audit.checker import AuditReport
from harness.system_config import SystemConfig

CHECKER = "https://github.com/mlcommons/inference/blob/master/tools/submission/submission_checker"
REAL_SUBMISSION = ("a real submission needs the model's weights (model.checkpoint), the datasets (datasets:, "
                   "downloaded as the README's \"Running a real submission\" says) and a GPU system YAML "
                   "(mlperf_configs/h200x8.yaml or your own): ./run_submission.sh --system h200x8 --scenario offline")


@dataclass(frozen=True)
class DemoLimit:
    """One way cpu-tiny falls short of a submission, the audit rules that reject it for that, and the checker's
    source that applies those rules."""

    describe: Callable[[SystemConfig, str], str]
    rules: tuple[str, ...]
    source: str


def _samples(config: SystemConfig, scenario: str) -> str:
    return (f"{config.dataset_size(scenario)} synthetic samples, not the real dataset's "
            f"{'8,000' if scenario == 'interactive' else '48,289'}")


def _duration(config: SystemConfig, scenario: str) -> str:
    seconds = config.scenario(scenario).min_duration_ms / 1000
    few = "" if scenario == "offline" else ", and too few queries for LoadGen's early stopping"  # none in Offline
    return f"short runs: min_duration {seconds:g} s, not 600 s{few}"


LIMITS: tuple[DemoLimit, ...] = (
    DemoLimit(lambda config, scenario: "a random tiny model: its answers score an F1 of about 0 against the "
              "round's target", ("accuracy-f1",), f"{CHECKER}/checks/accuracy_check.py"),
    DemoLimit(_samples, ("accuracy-sample-count", "accuracy-total-count", "perf-sample-count",
                         "perf-offline-samples-per-query"), f"{CHECKER}/constants.py"),
    DemoLimit(_duration, ("perf-min-duration", "perf-result-valid", "perf-early-stopping"),
              f"{CHECKER}/checks/performance_check.py"),
    DemoLimit(lambda config, scenario: "a tiny model on CPU cores: its p99 latency can exceed the scenario's bound",
              ("perf-latency-constraint",), f"{CHECKER}/checks/performance_check.py"),
    DemoLimit(lambda config, scenario: "one scenario per run: a submission holds Offline and Server or Interactive",
              ("scenario-set",), f"{CHECKER}/loader.py"),
)


def demo_verdict_lines(report: AuditReport, config: SystemConfig, scenario: str) -> list[str]:
    """The lines to print under a cpu-tiny verdict (none when the audit accepted the tree)."""
    if report.accepted:
        return []
    failed = {finding.rule_id for finding in report.failures}
    lines = [f"expected for the embedded default {config.system.name}, a demonstration of the pipeline and not a "
             "submission; the audit rejects it for:"]
    for limit in LIMITS:
        rules = [rule for rule in limit.rules if rule in failed]
        if rules:
            lines.append(f"  {limit.describe(config, scenario)} ({', '.join(rules)}; {limit.source})")
    explained = {rule for limit in LIMITS for rule in limit.rules}
    unexplained = sorted({f"{f.rule_id} ({f.scenario})" for f in report.failures if f.rule_id not in explained})
    if unexplained:
        lines.append(f"  not explained by the demo's limits, so look at these: {', '.join(unexplained)}")
    lines.append(REAL_SUBMISSION)
    return lines
