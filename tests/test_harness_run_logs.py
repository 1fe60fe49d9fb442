"""A run's raw logs are staged and moved into place only when the run completes: an interrupted or failed run
never overwrites the previous run's logs, and a completed one replaces only what it wrote."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.interrupts import Interrupted
from harness.run_logs import StagedRunLogs


def previous_run(final: Path) -> None:
    (final / "performance" / "run_1").mkdir(parents=True)
    (final / "performance" / "run_1" / "mlperf_log_summary.txt").write_text("previous summary\n")
    (final / "accuracy").mkdir()
    (final / "accuracy" / "mlperf_log_accuracy.json").write_text("[]\n")
    (final / "latency.png").write_bytes(b"previous plot")
    (final / "router.log").write_text("the previous run's router log\n")


def staged_entries(final: Path) -> list[str]:
    return sorted(p.name for p in final.parent.iterdir() if p.name.startswith(f".{final.name}."))


def test_a_completed_run_replaces_only_the_entries_it_wrote(tmp_path):
    final = tmp_path / "runs" / "cpu-tiny" / "Server"
    previous_run(final)
    with StagedRunLogs(final) as staging:
        assert staging.parent == final.parent and staging != final
        (staging / "performance" / "run_1").mkdir(parents=True)
        (staging / "performance" / "run_1" / "mlperf_log_summary.txt").write_text("new summary\n")
        (staging / "latency.png").write_bytes(b"new plot")
        assert (final / "performance" / "run_1" / "mlperf_log_summary.txt").read_text() == "previous summary\n"
    assert (final / "performance" / "run_1" / "mlperf_log_summary.txt").read_text() == "new summary\n"
    assert (final / "latency.png").read_bytes() == b"new plot"
    assert (final / "accuracy" / "mlperf_log_accuracy.json").read_text() == "[]\n"  # not run this time: kept
    assert (final / "router.log").is_file()
    assert staged_entries(final) == []


@pytest.mark.parametrize("interruption", [Interrupted("SIGINT"), KeyboardInterrupt()])
def test_an_interrupted_run_leaves_the_previous_logs_as_they_were_and_nothing_aside(interruption, tmp_path):
    final = tmp_path / "Server"
    previous_run(final)
    with pytest.raises(type(interruption)), StagedRunLogs(final, discard_on=(Interrupted, KeyboardInterrupt)) as staging:
        (staging / "performance" / "run_1").mkdir(parents=True)
        (staging / "performance" / "run_1" / "mlperf_log_summary.txt").write_text("")  # LoadGen cut short
        raise interruption
    assert (final / "performance" / "run_1" / "mlperf_log_summary.txt").read_text() == "previous summary\n"
    assert (final / "latency.png").read_bytes() == b"previous plot"
    assert staged_entries(final) == []


def test_a_failed_run_keeps_its_logs_aside_until_the_next_run_starts(tmp_path):
    final = tmp_path / "Server"
    previous_run(final)
    with pytest.raises(RuntimeError), StagedRunLogs(final) as staging:
        (staging / "performance").mkdir()
        raise RuntimeError("the LoadGen performance test exited with status 1")
    assert staging.is_dir()  # for reading the failed test's detail log
    assert (final / "performance" / "run_1" / "mlperf_log_summary.txt").read_text() == "previous summary\n"
    with StagedRunLogs(final) as again:
        assert not staging.exists()
    assert staged_entries(final) == [] and not again.exists()
