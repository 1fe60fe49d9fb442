"""Every test file passes alone, not only after others (issue 33, item 14): runs a fixed sample of test files, each
in a pytest process of its own, with a fresh empty TMPDIR standing in for a fresh machine's /tmp (Ray's default temp
dir, /tmp/ray, follows TMPDIR). A file that passes only once another test has made something there fails here.

CI runs it after the suite (.ci/run); about a minute. The sample: the file that failed so
(tests/test_scale_multinode.py: /tmp/ray/ray_current_cluster), and cheap files around shared state: LoadGen's log
files, staged run directories, the output lock, the peak finder's reports. Prints one line per file and exits 1
when any failed.

Usage: .venv/bin/python scripts/tests_alone.py [FILE ...]   (default: the sample)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (test file, pytest -m expression or None for every test in it)
SAMPLE: tuple[tuple[str, str | None], ...] = (
    ("tests/test_scale_multinode.py", None),
    ("tests/test_audit_logs.py", None),
    ("tests/test_harness_run_logs.py", None),
    ("tests/test_reliability_output_lock.py", "not slow"),
    ("tests/test_peak.py", "not slow"),
)


def run_alone(test_file: str, marks: str | None) -> bool:
    """pytest on test_file alone, in a fresh TMPDIR (removed afterwards) with no RAY_TMPDIR; whether it passed."""
    with tempfile.TemporaryDirectory(prefix="q3vl-alone-", dir="/tmp") as fresh_tmp:
        env = {k: v for k, v in os.environ.items() if k != "RAY_TMPDIR"} | {"TMPDIR": fresh_tmp}
        command = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider"]
        if marks is not None:
            command += ["-m", marks]
        result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    last = (result.stdout.strip().splitlines() or ["no output"])[-1]
    print(f"{'PASS' if result.returncode == 0 else 'FAIL'}  {test_file} alone: {last}", flush=True)
    if result.returncode != 0:
        print(result.stdout[-4000:] + result.stderr[-2000:], flush=True)
    return result.returncode == 0


def main(argv: list[str]) -> int:
    sample = [(name, None) for name in argv] if argv else list(SAMPLE)
    failed = [name for name, marks in sample if not run_alone(name, marks)]
    if failed:
        print(f"{len(failed)} of {len(sample)} test files fail when run alone: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
