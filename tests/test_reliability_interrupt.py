"""An interrupted run (SIGINT or SIGTERM while the system starts or while LoadGen runs) exits 130, tears down Ray,
the router and the workers (no process of the run is left, nor the embedded Ray's temp dir), never leaves an
output directory that looks like a complete submission, keeps the previous run's raw logs and router log as they
were, and says so on a line of its own (not on the progress bar's)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from harness.ray_network import temp_dirs_of
from lab.soak.fault_soak import HarnessRun, soak_system
from lab.soak.process_tree import ProcessWatch, descendants

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "tests" / "harness"
EXIT_TIMEOUT_S = 150.0  # teardown after the signal: actors still building their engines, then Ray


def previous_router_log(run: HarnessRun) -> dict[Path, str]:
    """A good earlier run's router log and config in the scenario dir (a later run must not append to them)."""
    files = {run.scenario_dir / "router.log": "router listening on 127.0.0.1:1 (an earlier run)\n",
             run.scenario_dir / "router.yaml": "listen: 127.0.0.1:1\n"}
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return files


def assert_interrupted_cleanly(run: HarnessRun, watch: ProcessWatch, sig: signal.Signals, stderr: str) -> None:
    assert run.process.returncode == 130, stderr[-3000:]
    assert f"interrupted by {sig.name}" in stderr, stderr[-3000:]
    assert "SystemError" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert watch.left_running() == {}, "processes left behind"
    assert temp_dirs_of(run.pid) == [], "the embedded Ray's temp dir was left behind"
    assert not (run.output / "submission").exists()
    assert [p.name for p in run.scenario_dir.parent.iterdir() if p.name.startswith(".")] == []  # nothing staged


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_during_the_loadgen_test_stops_every_process_and_writes_no_submission(sig, tmp_path):
    run = HarnessRun(soak_system(tmp_path, 20, qps=1.0), tmp_path / "out", CACHE, progress=True)
    previous = run.scenario_dir / "accuracy" / "mlperf_log_accuracy.json"
    previous.parent.mkdir(parents=True)
    previous.write_text("[]\n")  # a previous run's raw log
    router_files = previous_router_log(run)
    run.start()
    watch = ProcessWatch(run.pid)
    try:
        run.wait_for_loadgen()
        assert run.wait_for_inflight(1), run.process.communicate()[1][-3000:]
        kinds = {"raylet": "raylet", "gcs_server": "gcs_server", "router": " -m router ",
                 "worker": "ray::ModelWorker", "loadgen": "-m harness run-test"}
        started = descendants(run.pid)
        for kind, marker in kinds.items():
            assert any(marker in f" {cmd} " for cmd in started.values()), f"no {kind} process before the signal"
        os.kill(run.pid, sig)
        stderr = run.process.communicate(timeout=EXIT_TIMEOUT_S)[1]
    finally:
        run.kill()
    assert_interrupted_cleanly(run, watch, sig, stderr)
    assert previous.read_text() == "[]\n"
    assert {path: path.read_text() for path in router_files} == router_files
    for line in stderr.splitlines():  # tqdm redraws with \r, which splitlines() also splits at
        for marker in ("[q3vl]", "run_submission.sh:"):
            assert marker not in line or line.startswith(marker), f"{marker} shares a line: {line!r}"


# Moments of the start-up, each marked by the program whose process has just appeared: ray.init is starting its
# API server (an interrupt there was caught and logged by Ray, and the run went on), ray.init has connected the
# driver and the raylet prestarts Python workers (an interrupt there crashed the harness and left the temp dir),
# the worker actors are building their engines (the harness waits in ray.get).
START_MOMENTS = {"ray-api-server": "ray/dashboard/dashboard.py", "driver-connected": "workers/default_worker.py",
                 "actors-building": "ray::ModelWorker"}


@pytest.mark.slow
@pytest.mark.parametrize("moment", list(START_MOMENTS))
def test_sigint_while_the_system_starts_exits_130_and_leaves_nothing_running(moment, tmp_path):
    run = HarnessRun(soak_system(tmp_path, 8, qps=2.0), tmp_path / "out", CACHE)
    router_files = previous_router_log(run)
    run.start()
    watch = ProcessWatch(run.pid)
    try:
        assert watch.wait_for(START_MOMENTS[moment], timeout_s=300), run.process.communicate()[1][-3000:]
        os.kill(run.pid, signal.SIGINT)
        stderr = run.process.communicate(timeout=EXIT_TIMEOUT_S)[1]
    finally:
        run.kill()
    assert_interrupted_cleanly(run, watch, signal.SIGINT, stderr)
    assert {path: path.read_text() for path in router_files} == router_files
