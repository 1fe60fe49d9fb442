"""Bad system configs and arguments fail before anything starts: exit status 2 and one line naming the problem
(every top-level key missing, misspelt or mistyped; a checkpoint that is not there; more GPUs than Ray has; a key
given twice; an unsafe submitter name; a CUDA engine where there is no CUDA; an --output that cannot be written)."""

from __future__ import annotations

import contextlib
import copy
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from harness.cli import main
from harness.system_config import CONFIG_DIR, SystemConfig

REPO = Path(__file__).resolve().parent.parent
BASE = yaml.safe_load((CONFIG_DIR / "cpu-tiny.yaml").read_text())
REQUIRED = [key for key in BASE if SystemConfig.model_fields[key].is_required()]


def harness_error(tmp_path: Path, data: dict) -> tuple[int, str]:
    """`python -m harness --scenario server --system <data>` in this process: (exit status, stderr)."""
    system = tmp_path / "system.yaml"
    system.write_text(yaml.safe_dump(data))
    return harness_main(tmp_path, system)


def harness_main(tmp_path: Path, system: Path) -> tuple[int, str]:
    """`python -m harness --scenario server --system <file>` in this process: (exit status, stderr)."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            rc = main(["--scenario", "server", "--system", str(system), "--output", str(tmp_path / "out"),
                       "--cache-dir", str(tmp_path / "cache"), "--no-progress"])
        except SystemExit as exc:
            rc = exc.code
    return rc, stderr.getvalue()


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "error:" in line]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("key", REQUIRED)
def test_a_missing_required_section_is_named(key, tmp_path):
    rc, stderr = harness_error(tmp_path, {k: v for k, v in BASE.items() if k != key})
    assert rc == 2
    assert f"{key}: Field required" in error_line(stderr)
    assert not (tmp_path / "out").exists()  # nothing started, nothing written


@pytest.mark.parametrize("key", list(BASE))
def test_a_misspelt_section_is_named_with_a_suggestion(key, tmp_path):
    data = {(k + "s" if k == key else k): v for k, v in BASE.items()}
    rc, stderr = harness_error(tmp_path, data)
    assert rc == 2
    line = error_line(stderr)
    assert f"{key}s: " in line
    if key in REQUIRED:
        assert f"did you mean {key}?" in line


@pytest.mark.parametrize("key", list(BASE))
def test_a_mistyped_section_is_named(key, tmp_path):
    rc, stderr = harness_error(tmp_path, BASE | {key: 42})
    assert rc == 2
    assert f": {key}: " in error_line(stderr)


def test_a_checkpoint_that_does_not_exist_is_named_before_anything_starts(tmp_path):
    data = BASE | {"model": {"checkpoint": str(tmp_path / "no-such-checkpoint"), "dtype": "float32"}}
    rc, stderr = harness_error(tmp_path, data)
    assert rc == 2
    assert f"model.checkpoint: {tmp_path / 'no-such-checkpoint'} has no config.json" in error_line(stderr)
    assert "starting the router" not in stderr


def test_more_gpus_than_the_cluster_has_is_refused_before_anything_starts(tmp_path):
    pools = [{"role": "aggregated", "count": 2, "gpus_per_worker": 1, "tp": 1}]
    rc, stderr = harness_error(tmp_path, BASE | {"workers": {"pools": pools}})
    assert rc == 2
    assert "workers.pools need 2 GPUs in all; the embedded Ray (section ray) has 0" in error_line(stderr)
    assert "starting the router" not in stderr


def test_run_submission_sh_reports_a_bad_config_in_one_line_with_status_2(tmp_path):
    system = tmp_path / "system.yaml"
    system.write_text(yaml.safe_dump({k: v for k, v in BASE.items() if k != "workers"} | {"worker": BASE["workers"]}))
    result = subprocess.run(["./run_submission.sh", "--scenario", "server", "--system", str(system),
                             "--output", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"run_submission.sh: error: {system}: worker: unknown key; did you mean workers? (workers is required)"]


def test_an_unknown_scenario_argument_is_a_usage_error(tmp_path):
    result = subprocess.run(["./run_submission.sh", "--scenario", "batch"], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "--scenario" in result.stderr


def test_a_submitter_that_is_not_a_path_component_is_refused_before_anything_starts(tmp_path):
    rc, stderr = harness_error(tmp_path, BASE | {"system": BASE["system"] | {"submitter": "../../etc"}})
    assert rc == 2
    assert "system.submitter: " in error_line(stderr) and "'../../etc'" in error_line(stderr)
    assert not (tmp_path / "out").exists()


def test_more_performance_samples_than_a_catalogue_on_disk_holds_is_refused_before_anything_starts(tmp_path):
    from harness.synthetic_catalogue import write_synthetic_catalogue

    write_synthetic_catalogue(tmp_path / "cat", 32, seed=0, dataset="product-catalogue")
    data = copy.deepcopy(BASE)
    data["datasets"]["product-catalogue"]["path"] = str(tmp_path / "cat")
    data["scenarios"]["server"]["performance_sample_count"] = 64
    rc, stderr = harness_error(tmp_path, data)
    assert rc == 2
    assert "scenarios.server.performance_sample_count: 64 is more than the 32 samples" in error_line(stderr)
    assert not (tmp_path / "out").exists()


def test_a_key_given_twice_is_refused_with_both_lines(tmp_path):
    system = tmp_path / "system.yaml"
    system.write_text(yaml.safe_dump(BASE) + "router_shards: 1\nrouter_shards: 2\n")
    last = len(system.read_text().splitlines())
    rc, stderr = harness_main(tmp_path, system)
    assert rc == 2
    assert error_line(stderr) == f"run_submission.sh: error: {system}: duplicate key 'router_shards' on lines {last - 1} and {last}"
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the probe finds CUDA on this machine")
@pytest.mark.parametrize("where", ["engine", "scenarios.server.engine"])
def test_a_cuda_engine_on_a_machine_without_cuda_is_refused_before_anything_starts(where, tmp_path):
    data = copy.deepcopy(BASE)
    if where == "engine":
        data["engine"]["device"] = "cuda"
    else:
        data["scenarios"]["server"]["engine"] = {"device": "cuda:0"}
    rc, stderr = harness_error(tmp_path, data)
    assert rc == 2
    line = error_line(stderr)
    assert f"{where}.device: " in line and "torch.cuda.is_available() is False" in line
    assert not (tmp_path / "out").exists()


def test_an_output_that_cannot_be_written_is_a_usage_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = subprocess.run([sys.executable, "-m", "harness", "--scenario", "server", "--output", str(blocker / "out"),
                             "--cache-dir", str(tmp_path / "cache")], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"run_submission.sh: error: --output: {blocker / 'out'} is not a writable directory: Not a directory"]
    assert not (tmp_path / "cache").exists()  # refused before the checkpoint was made
