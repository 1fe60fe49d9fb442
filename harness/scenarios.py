"""The three benchmark scenarios and the run modes, and how each maps onto LoadGen.

Offline issues every sample in one query; Server is Poisson arrivals with p99 <= 12 s; Interactive is
LoadGen's Server scenario with a 1.5 s target on the 8k dataset. Submission mode = performance, then accuracy.
"""

from __future__ import annotations

import enum
from pathlib import Path

import mlperf_loadgen as lg


class Scenario(str, enum.Enum):
    OFFLINE = "offline"
    SERVER = "server"
    INTERACTIVE = "interactive"

    @property
    def loadgen_name(self) -> str:
        """The scenario name LoadGen and mlperf.conf know (no Interactive there)."""
        return "Offline" if self is Scenario.OFFLINE else "Server"

    @property
    def loadgen_scenario(self) -> lg.TestScenario:
        return lg.TestScenario.Offline if self is Scenario.OFFLINE else lg.TestScenario.Server

    @property
    def result_dir_name(self) -> str:
        """The scenario directory in the submission tree."""
        return self.value.capitalize()


class LoadGenMode(str, enum.Enum):
    """One LoadGen test: what a single child process runs."""

    PERFORMANCE = "performance"
    ACCURACY = "accuracy"

    @property
    def loadgen_mode(self) -> lg.TestMode:
        return lg.TestMode.PerformanceOnly if self is LoadGenMode.PERFORMANCE else lg.TestMode.AccuracyOnly


class Mode(str, enum.Enum):
    """What the user asks for: one test, or the pair a submission needs."""

    PERFORMANCE = "performance"
    ACCURACY = "accuracy"
    SUBMISSION = "submission"

    @property
    def tests(self) -> tuple[LoadGenMode, ...]:
        if self is Mode.SUBMISSION:
            return (LoadGenMode.PERFORMANCE, LoadGenMode.ACCURACY)
        return (LoadGenMode(self.value),)


def log_dir_for(scenario_dir: Path, test: LoadGenMode) -> Path:
    """Where LoadGen writes one test's logs, laid out as the submission tree expects."""
    if test is LoadGenMode.PERFORMANCE:
        return scenario_dir / "performance" / "run_1"
    return scenario_dir / "accuracy"
