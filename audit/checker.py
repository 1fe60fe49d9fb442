"""Audits a submission tree (`<division>/<submitter>/...`) the way the MLCommons submission checker would
for qwen3-vl-235b-a22b: every rule in `audit.rules.RULES` yields one PASS/FAIL/WARN/SKIP finding."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from audit.rules import RULES
from audit.rules.base import (Outcome, Rule, ScenarioContext, SubmissionContext, SystemContext, Unavailable,
                              failed)
from audit.rules.rounds import DEFAULT_VERSION, DIVISIONS, ROUNDS

# FAIL rejects the result; WARN is information that never rejects; SKIP means the rule could not run
# because a file it needs is missing or unreadable (the rule that owns that file FAILs).
REJECTING = "FAIL"


@dataclass(frozen=True)
class Finding:
    rule_id: str
    scenario: str
    status: str
    reason: str
    file: str

    def line(self) -> str:
        return f"{self.status:<4}  {self.rule_id}  {self.scenario}  {self.reason}  ({self.file})"


@dataclass(frozen=True)
class AuditReport:
    tree: Path
    version: str
    findings: tuple[Finding, ...]

    @property
    def failures(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.status == REJECTING)

    @property
    def accepted(self) -> bool:
        return bool(self.findings) and not self.failures

    def verdict(self) -> str:
        warnings = sum(f.status == "WARN" for f in self.findings)
        if self.accepted:
            return (f"VERDICT  ACCEPTED  {len(self.findings)} checks, none failed ({warnings} warning(s)); "
                    f"rules of {self.version}")
        names = ", ".join(f"{f.rule_id} ({f.scenario})" for f in self.failures[:8])
        more = " ..." if len(self.failures) > 8 else ""
        return (f"VERDICT  REJECTED  {len(self.failures)} of {len(self.findings)} checks failed: "
                f"{names}{more}; rules of {self.version}")

    def lines(self) -> list[str]:
        return [f.line() for f in self.findings] + [self.verdict()]


def audit_tree(tree: Path, version: str = DEFAULT_VERSION, submitter: str | None = None) -> AuditReport:
    """Applies every rule to every `<division>/<submitter>/` under `tree` (only `submitter` if given).

    `tree` is the directory that holds `closed/` and/or `open/`, or one `<division>/<submitter>/` directory
    (then only that submission is audited)."""
    if version not in ROUNDS:
        raise ValueError(f"unknown round {version!r}; known: {', '.join(ROUNDS)}")
    tree = Path(tree)
    if not tree.is_dir():
        raise FileNotFoundError(f"submission tree {tree} is not a directory")
    root, division, submitter = _submission_root(tree, submitter)
    findings = list(_audit(root, version, submitter, division))
    return AuditReport(tree=root, version=version, findings=tuple(findings))


def _submission_root(tree: Path, submitter: str | None) -> tuple[Path, str | None, str | None]:
    """(the dir holding the divisions, division filter, submitter filter) for either form of `tree`."""
    holds_division = any((tree / d).is_dir() for d in DIVISIONS)
    if holds_division or tree.absolute().parent.name not in DIVISIONS:
        return tree, None, submitter
    if submitter is not None and submitter != tree.name:
        raise ValueError(f"{tree} is the submission of {tree.name!r}, but --submitter {submitter!r} was given")
    parent = tree.absolute().parent
    return parent.parent, parent.name, tree.name


def _audit(tree: Path, version: str, submitter: str | None, division: str | None = None) -> Iterator[Finding]:
    def finding(rule_id: str, scenario: str, outcome: Outcome) -> Finding:
        file = outcome.file.relative_to(tree) if outcome.file.is_relative_to(tree) else outcome.file
        return Finding(rule_id, scenario, outcome.status, outcome.reason, str(file))

    divisions = sorted(p.name for p in tree.iterdir() if p.is_dir() and not p.name.startswith("."))
    unknown = [d for d in divisions if d not in DIVISIONS]
    if unknown or not divisions:
        reason = (f"unknown division dirs: {', '.join(unknown)}" if unknown else "no closed/ or open/ directory")
        reason += " (TREE is the directory that holds closed/ and/or open/, or one <division>/<submitter>/ in it)"
        yield finding("layout", "-", failed(reason, tree))
    submissions = [SubmissionContext(tree, d, s.name, ROUNDS[version])
                   for d in divisions if d in DIVISIONS and division in (None, d)
                   for s in sorted((tree / d).iterdir())
                   if s.is_dir() and not s.name.startswith(".") and submitter in (None, s.name)]
    if submitter is not None and not submissions:
        yield finding("layout", "-", failed(f"no <division>/{submitter}/ directory", tree))
    for sub in submissions:
        for rule in _rules("submission"):
            yield finding(rule.id, "-", _run(rule, sub))
        for system in sub.systems_with_results():
            sys_ctx = SystemContext(sub, system)
            if not sys_ctx.results_dir.is_dir():
                continue
            for rule in _rules("system"):
                yield finding(rule.id, "-", _run(rule, sys_ctx))
            for scenario in sys_ctx.scenario_dirs():
                if scenario not in sub.round.allowed_scenarios:
                    continue  # scenario-set names it
                scen_ctx = ScenarioContext(sys_ctx, scenario)
                for rule in _rules("scenario"):
                    if scenario in rule.scenarios and sub.division in rule.divisions:
                        yield finding(rule.id, scenario, _run(rule, scen_ctx))


def _rules(scope: str) -> list[Rule]:
    return [r for r in RULES if r.scope == scope]


def _run(rule: Rule, ctx: Any) -> Outcome:
    try:
        return rule.check(ctx)
    except Unavailable as e:
        return Outcome("SKIP", e.reason, e.file)
    except OSError as e:
        return failed(f"cannot read: {e}", Path(getattr(e, "filename", None) or "."))
