"""An interrupted run (SIGINT or SIGTERM while LoadGen runs) tears down Ray, the router and the workers (no
process of the run is left), never leaves an output directory that looks like a complete submission, keeps the
previous run's raw logs as they were, and says so on a line of its own (not on the progress bar's)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from harness.fault_soak import HarnessRun, soak_system
from harness.process_tree import descendants

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "tests" / "harness"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return state[state.rindex(")") + 2] != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_during_the_loadgen_test_stops_every_process_and_writes_no_submission(sig, tmp_path):
    run = HarnessRun(soak_system(tmp_path, 20, qps=1.0), tmp_path / "out", CACHE, progress=True)
    previous = run.scenario_dir / "accuracy" / "mlperf_log_accuracy.json"
    previous.parent.mkdir(parents=True)
    previous.write_text("[]\n")  # a previous run's raw log
    run.start()
    run.wait_for_loadgen()
    assert run.wait_for_inflight(1), run.process.communicate()[1][-3000:]
    started = descendants(run.pid)
    kinds = {"raylet": "raylet", "gcs_server": "gcs_server", "router": " -m router ", "worker": "ray::ModelWorker",
             "loadgen": "-m harness run-test"}
    for kind, marker in kinds.items():
        assert any(marker in f" {cmd} " for cmd in started.values()), f"no {kind} process before the signal"
    os.kill(run.pid, sig)
    run.process.wait(timeout=120)
    assert run.process.returncode == 130
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(alive(pid) for pid in started):
        time.sleep(0.5)
    left = {pid: cmd for pid, cmd in started.items() if alive(pid)}
    assert left == {}, f"processes left behind: {left}"
    assert not (run.output / "submission").exists()
    assert previous.read_text() == "[]\n"
    assert [p.name for p in run.scenario_dir.parent.iterdir() if p.name.startswith(".")] == []  # nothing staged left
    stderr = run.process.stderr.read()
    assert f"interrupted by {signal.Signals(sig).name}" in stderr
    for line in stderr.splitlines():  # tqdm redraws with \r, which splitlines() also splits at
        for marker in ("[q3vl]", "run_submission.sh:"):
            assert marker not in line or line.startswith(marker), f"{marker} shares a line: {line!r}"
