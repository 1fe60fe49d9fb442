"""Every rule the audit applies to a qwen3-vl-235b-a22b submission, in report order; the round tables
(seeds, targets, scenario sets) live in `audit.rules.rounds`."""

from audit.rules import log_values, scenario_files, system_desc
from audit.rules.base import Rule


def _report_order(rule: Rule) -> int:
    return next((i for i, prefix in enumerate(("perf-", "accuracy-")) if rule.id.startswith(prefix)), 2)


# Submission and system rules first, then per scenario: performance, accuracy, the scenario's own files.
RULES: tuple[Rule, ...] = system_desc.RULES + tuple(
    sorted(scenario_files.RULES + log_values.RULES, key=_report_order))

__all__ = ["RULES", "Rule"]
