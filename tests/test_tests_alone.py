"""scripts/tests_alone.py, CI's check that test files pass alone: each file runs in a pytest process of its own with
a fresh, empty TMPDIR (a fresh machine's /tmp) and no RAY_TMPDIR, so a file relying on what another left there fails;
the sample names files that exist, the multinode one among them. The script runs as CI runs it, a process of its own
(no test imports scripts/; tests/test_import_graph.py)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "tests_alone.py"


def run_script(*files: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, files)], cwd=REPO, env=os.environ | env,
                          capture_output=True, text=True, timeout=600)


def sample() -> list[str]:
    """The script's SAMPLE, read from its source: the test files it runs by default."""
    tree = ast.parse(SCRIPT.read_text(encoding="utf-8"))
    (value,) = [node.value for node in tree.body if isinstance(node, ast.AnnAssign) and node.target.id == "SAMPLE"]
    return [name for name, _ in ast.literal_eval(value)]

RELIES_ON_OTHERS = '''
import tempfile
from pathlib import Path

def test_what_another_test_made():
    assert (Path(tempfile.gettempdir()) / "ray").is_dir()  # as /tmp/ray exists once some Ray has run
'''

FRESH = '''
import os
import tempfile
from pathlib import Path

def test_the_temp_dir_is_fresh_and_ray_follows_it():
    assert list(Path(tempfile.gettempdir()).iterdir()) == []
    assert "RAY_TMPDIR" not in os.environ
'''


def test_a_file_that_passes_only_after_another_fails_alone(tmp_path):
    (tmp_path / "ray").mkdir()  # what the whole suite leaves behind in TMPDIR: it passes there ...
    (tmp_path / "test_relies.py").write_text(RELIES_ON_OTHERS)
    result = run_script(tmp_path / "test_relies.py", TMPDIR=str(tmp_path))  # ... and not alone
    assert result.returncode == 1
    assert result.stdout.startswith(f"FAIL  {tmp_path / 'test_relies.py'} alone: 1 failed")


def test_each_file_gets_an_empty_temp_dir_and_no_ray_tmpdir(tmp_path):
    (tmp_path / "test_fresh.py").write_text(FRESH)
    result = run_script(tmp_path / "test_fresh.py", RAY_TMPDIR=str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(f"PASS  {tmp_path / 'test_fresh.py'} alone: 1 passed")


def test_the_sample_holds_the_multinode_test_and_only_files_that_exist():
    files = sample()
    assert "tests/test_scale_multinode.py" in files
    assert all((REPO / name).is_file() for name in files) and len(set(files)) == len(files)
