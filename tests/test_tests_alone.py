"""scripts/tests_alone.py, CI's check that test files pass alone: each file runs in a pytest process of its own with
a fresh, empty TMPDIR (a fresh machine's /tmp) and no RAY_TMPDIR, so a file relying on what another left there fails;
the sample names files that exist, the multinode one among them."""

from __future__ import annotations

from scripts.tests_alone import REPO, SAMPLE, main, run_alone

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


def test_a_file_that_passes_only_after_another_fails_alone(tmp_path, monkeypatch, capsys):
    (tmp_path / "ray").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # what the whole suite leaves behind: it passes here ...
    (tmp_path / "test_relies.py").write_text(RELIES_ON_OTHERS)
    assert not run_alone(str(tmp_path / "test_relies.py"), None)  # ... and not alone
    assert capsys.readouterr().out.startswith(f"FAIL  {tmp_path / 'test_relies.py'} alone: 1 failed")


def test_each_file_gets_an_empty_temp_dir_and_no_ray_tmpdir(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    (tmp_path / "test_fresh.py").write_text(FRESH)
    assert main([str(tmp_path / "test_fresh.py")]) == 0
    assert capsys.readouterr().out.startswith(f"PASS  {tmp_path / 'test_fresh.py'} alone: 1 passed")


def test_the_sample_holds_the_multinode_test_and_only_files_that_exist():
    files = [name for name, _ in SAMPLE]
    assert "tests/test_scale_multinode.py" in files
    assert all((REPO / name).is_file() for name in files) and len(set(files)) == len(files)
