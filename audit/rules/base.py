"""The rule machinery: a `Rule` is an id, a scope and a check over a context (submission, system or
scenario dir); a check returns an `Outcome`, or raises `Unavailable` when the file it needs is unusable."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from audit.loadgen_logs import DetailLog, LogParseError, parse_detail_log
from audit.rules.rounds import MODEL, SCENARIOS, RoundRules

Status = Literal["PASS", "FAIL", "WARN", "SKIP"]
Scope = Literal["submission", "system", "scenario"]


class Unavailable(Exception):
    """The input a rule needs is missing or unreadable; another rule already fails for that file."""

    def __init__(self, reason: str, file: Path):
        super().__init__(reason)
        self.reason = reason
        self.file = file


@dataclass(frozen=True)
class Outcome:
    status: Status
    reason: str
    file: Path


def passed(reason: str, file: Path) -> Outcome:
    return Outcome("PASS", reason, file)


def failed(reason: str, file: Path) -> Outcome:
    return Outcome("FAIL", reason, file)


def check_that(ok: bool, reason: str, file: Path) -> Outcome:
    return Outcome("PASS" if ok else "FAIL", reason, file)


@dataclass
class SubmissionContext:
    """One `<division>/<submitter>/` directory of the tree being audited."""

    tree: Path
    division: str
    submitter: str
    round: RoundRules

    @property
    def root(self) -> Path:
        return self.tree / self.division / self.submitter

    def systems_with_results(self) -> list[str]:
        results = self.root / "results"
        return sorted(p.name for p in results.iterdir() if p.is_dir()) if results.is_dir() else []


@dataclass
class SystemContext:
    """One system of a submission: its `systems/<name>.json` and its results for this benchmark."""

    submission: SubmissionContext
    system: str

    @property
    def description_path(self) -> Path:
        return self.submission.root / "systems" / f"{self.system}.json"

    @property
    def results_dir(self) -> Path:
        return self.submission.root / "results" / self.system / MODEL

    def scenario_dirs(self) -> list[str]:
        d = self.results_dir
        return sorted(p.name for p in d.iterdir() if p.is_dir()) if d.is_dir() else []

    def description(self) -> dict[str, Any]:
        return read_json_object(self.description_path)


@dataclass
class ScenarioContext:
    """One `results/<system>/<model>/<Scenario>/` dir; parses each LoadGen log at most once."""

    system: SystemContext
    scenario: str
    _details: dict[Path, DetailLog] = field(default_factory=dict, repr=False)

    @property
    def round(self) -> RoundRules:
        return self.system.submission.round

    @property
    def division(self) -> str:
        return self.system.submission.division

    @property
    def dir(self) -> Path:
        return self.system.results_dir / self.scenario

    @property
    def performance_dir(self) -> Path:
        return self.dir / "performance" / "run_1"

    @property
    def accuracy_dir(self) -> Path:
        return self.dir / "accuracy"

    def run_dir(self, run: Literal["performance", "accuracy"]) -> Path:
        return self.performance_dir if run == "performance" else self.accuracy_dir

    def detail_log(self, run: Literal["performance", "accuracy"]) -> DetailLog:
        path = self.run_dir(run) / "mlperf_log_detail.txt"
        if path not in self._details:
            if not path.is_file():
                raise Unavailable("not checked: LoadGen detail log missing", path)
            try:
                self._details[path] = parse_detail_log(path)
            except (LogParseError, UnicodeDecodeError) as e:
                raise Unavailable(f"not checked: unreadable LoadGen detail log ({e})", path) from e
        return self._details[path]


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or `Unavailable` naming why not."""
    if not path.is_file():
        raise Unavailable("not checked: file missing", path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Unavailable(f"not checked: invalid JSON ({e})", path) from e
    if not isinstance(data, dict):
        raise Unavailable("not checked: JSON is not an object", path)
    return data


@dataclass(frozen=True)
class Rule:
    """One check the submission checker makes; `scenarios`/`divisions` limit where it applies."""

    id: str
    scope: Scope
    description: str
    check: Callable[[Any], Outcome]
    scenarios: tuple[str, ...] = SCENARIOS
    divisions: tuple[str, ...] = ("closed", "open")
