"""One run at a time per --output: a second run into an output that a live run holds is refused at once (exit 2,
naming the lock file and its holder's pid) and touches nothing there; a lock whose holder died blocks nothing.
The first run, completed, replaces the earlier run's router log whole (written aside, renamed into place)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.output_lock import LOCK_FILE, OutputInUse, OutputLock
from harness.system_config import ConfigError
from lab.soak.fault_soak import HarnessRun, soak_system
from lab.soak.process_tree import ProcessWatch

REPO = Path(__file__).resolve().parent.parent
CACHE = REPO / ".cache" / "tests" / "harness"

HOLDER = """
import sys
from pathlib import Path
from harness.output_lock import OutputLock
OutputLock(Path(sys.argv[1])).acquire()
print("held", flush=True)
sys.stdin.read()  # holds the lock until killed
"""


def lock_held_by_another_process(output: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(output)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_an_output_held_by_a_live_process_is_refused_naming_the_lock_file_and_its_holder(tmp_path):
    holder = lock_held_by_another_process(tmp_path / "out")
    try:
        with pytest.raises(OutputInUse) as refused:
            OutputLock(tmp_path / "out").acquire()
    finally:
        holder.kill()
        holder.wait()
    assert isinstance(refused.value, ConfigError)  # exit 2, one line
    assert str(tmp_path / "out" / LOCK_FILE) in str(refused.value)
    assert f"pid {holder.pid}" in str(refused.value)


def test_a_lock_left_by_a_killed_process_does_not_block_and_a_released_lock_leaves_no_file(tmp_path):
    holder = lock_held_by_another_process(tmp_path / "out")
    holder.send_signal(signal.SIGKILL)  # dies holding it: the file stays, with its pid
    holder.wait()
    lock_path = tmp_path / "out" / LOCK_FILE
    assert lock_path.read_text().strip() == str(holder.pid)
    lock = OutputLock(tmp_path / "out")
    lock.acquire()
    assert lock_path.read_text().strip() == str(os.getpid())
    lock.release()
    assert not lock_path.exists()
    with OutputLock(tmp_path / "out"):  # and it can be taken again
        assert lock_path.is_file()
    assert not lock_path.exists()


@pytest.mark.slow
def test_a_second_run_into_the_same_output_is_refused_at_once_and_the_first_finishes_untouched(tmp_path):
    first = HarnessRun(soak_system(tmp_path / "first", 8, qps=2.0), tmp_path / "out", CACHE)
    second = HarnessRun(soak_system(tmp_path / "second", 8, qps=2.0), tmp_path / "out", CACHE)  # its own ports
    earlier_log = first.scenario_dir / "router.log"  # an earlier run's, in the same output
    earlier_log.parent.mkdir(parents=True)
    earlier_log.write_text("router listening on 127.0.0.1:1 (an earlier run)\n")
    first.start()
    watch = ProcessWatch(first.pid)
    try:
        # The first run is starting its system: its staging dir exists, LoadGen is yet to read user.conf from it.
        assert watch.wait_for("raylet/raylet", timeout_s=300), first.process.communicate()[1][-3000:]
        second.start()
        second_err = second.process.communicate(timeout=60)[1]
        first_err = first.process.communicate(timeout=300)[1]
    finally:
        second.kill()
        first.kill()
    assert second.process.returncode == 2, second_err[-3000:]
    assert str(tmp_path / "out" / LOCK_FILE) in second_err and f"pid {first.pid}" in second_err, second_err
    assert first.process.returncode == 1, first_err[-3000:]  # ran to the end: the audit rejects cpu-tiny
    assert "LoadGen rejected" not in first_err
    assert (first.scenario_dir / "accuracy" / "mlperf_log_accuracy.json").is_file()
    log = earlier_log.read_text()  # replaced whole by the first run's, not appended to
    assert "an earlier run" not in log and log.count("router listening on") == 1
    assert (first.scenario_dir / "router.yaml").is_file()
    assert (tmp_path / "out" / "submission").is_dir()
    assert not (tmp_path / "out" / LOCK_FILE).exists()
