"""The console carries the harness's own lines (issue 33, item 17): Ray's log lines of a run go to the run's
ray.log, pip's and the build backend's output to .venv/bootstrap.log (its tail on the console only when a step
fails), and making the tiny checkpoint prints no progress bar of transformers'."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from harness.ray_log import RAY_LOGGER, RayLogFile

REPO = Path(__file__).resolve().parent.parent

RAY_START = """
import sys
from pathlib import Path
from harness.ray_workers import init_ray
from harness.system_config import RaySection
session = init_ray(RaySection(num_cpus=1, num_gpus=0), address=None, log_file=Path(sys.argv[1]))
session.close()
import logging
logging.getLogger("ray").warning("after the session: the console again")
"""


def test_an_embedded_rays_own_lines_go_to_the_log_file_and_the_console_gets_them_back_after(tmp_path):
    log = tmp_path / "runs" / "ray.log"
    done = subprocess.run([sys.executable, "-c", RAY_START, str(log)], cwd=REPO, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    written = log.read_text()
    assert "Started a local Ray instance" in written
    assert "Started a local Ray instance" not in done.stderr and "authentication" not in done.stderr.lower()
    [line] = done.stderr.strip().splitlines()  # Ray's own handler again, once the session is closed
    assert line.endswith("WARNING <string>:9 -- after the session: the console again"), done.stderr[-3000:]


def test_the_ray_loggers_handlers_are_swapped_for_the_file_and_restored(tmp_path):
    ray_logger = logging.getLogger(RAY_LOGGER)
    before = list(ray_logger.handlers)
    log = RayLogFile(tmp_path / "ray.log")
    log.open()
    try:
        logging.getLogger("ray._private.worker").warning("a line of Ray's")
        assert [type(h) for h in ray_logger.handlers] == [logging.FileHandler]
    finally:
        log.close()
    log.close()  # idempotent
    assert ray_logger.handlers == before
    assert "a line of Ray's" in (tmp_path / "ray.log").read_text()


FAKE_PYTHON = """#!/usr/bin/env bash
# Stands in for .venv/bin/python: pip's chatter on both streams; fails an editable install when asked to.
echo "Looking in links: /opt/wheels"
echo "  BuildBackendWarning: Editable installation." >&2
if [[ "${FAIL_EDITABLE:-}" == 1 && " $* " == *" -e "* ]]; then echo "ERROR: no matching distribution" >&2; exit 1; fi
args=("$@")
for i in "${!args[@]}"; do [[ ${args[$i]} == --target ]] && mkdir -p "${args[$((i + 1))]}"; done
exit 0
"""


def bootstrap_copy(tmp_path: Path) -> Path:
    """scripts/bootstrap.sh in a copy of the repository's shape, with a fake .venv/bin/python."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "bootstrap.sh", root / "scripts" / "bootstrap.sh")
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    python = root / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return root


def run_bootstrap(root: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(root / "scripts" / "bootstrap.sh")], capture_output=True, text=True,
                          env=os.environ | env, timeout=60)


def test_bootstrap_keeps_pips_output_off_the_console_and_in_its_log(tmp_path):
    root = bootstrap_copy(tmp_path)
    done = run_bootstrap(root)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines and all(line.startswith("[bootstrap] ") for line in lines), done.stderr
    log = (root / ".venv" / "bootstrap.log").read_text()
    assert "BuildBackendWarning" in log and "Looking in links" in log
    assert (root / ".venv" / ".q3vl-installed").is_file()


def test_a_failing_bootstrap_step_shows_the_logs_tail_and_fails(tmp_path):
    root = bootstrap_copy(tmp_path)
    done = run_bootstrap(root, FAIL_EDITABLE="1")
    assert done.returncode == 1
    assert "[bootstrap] failed: .venv/bin/python -m pip install -q -e .[test]" in done.stderr
    assert "ERROR: no matching distribution" in done.stderr  # the log's tail
    assert not (root / ".venv" / ".q3vl-installed").exists()


def test_making_the_tiny_checkpoint_prints_no_progress_bar(tmp_path, capfd):
    from workers.tiny_checkpoint import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path / "tiny", arch="dense", seed=5)
    out, err = capfd.readouterr()
    assert "Writing model shards" not in out + err
