"""The submission tree is built aside and appears only when complete; later runs merge their scenarios in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from audit.checker import audit_tree
from audit.rules.rounds import MODEL
from audit.submission_tree import SOURCE_ENTRIES, IncompleteTree, SubmissionTreeBuilder, scenario_dir_name
from tests.helpers.loadgen_fixtures import (MEASUREMENTS, SUBMITTER, SYSTEM, SYSTEM_JSON, accuracy_result, add_scenario,
                                            make_source_root, official_runs)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return official_runs(tmp_path_factory.mktemp("runs"))


@pytest.fixture
def repo(tmp_path) -> Path:
    return make_source_root(tmp_path / "repo")


def test_src_holds_every_package_of_the_repository():
    packages = {path.name for path in REPO.iterdir() if (path / "__init__.py").is_file()}
    assert {"contract", "lab", "harness", "router", "workers", "audit", "scripts"} <= packages
    assert packages <= set(SOURCE_ENTRIES)


def test_src_copies_the_contract_and_the_lab_beside_the_product(tmp_path, repo):
    for package in ("contract", "lab"):
        (repo / package).mkdir()
        (repo / package / "__init__.py").write_text(f'"""{package}"""\n')
    b = builder(tmp_path / "out")
    b.begin()
    try:
        src = b.add_source(repo)
        assert {p.name for p in src.iterdir()} == {"contract", "harness", "lab", "pyproject.toml"}
        assert (src / "lab" / "__init__.py").read_text() == '"""lab"""\n'
    finally:
        b.abort()


def builder(out: Path) -> SubmissionTreeBuilder:
    return SubmissionTreeBuilder(out, submitter=SUBMITTER, system_name=SYSTEM)


def build(out: Path, runs, repo: Path, scenarios) -> Path:
    with builder(out) as b:
        b.add_system_description(SYSTEM_JSON)
        b.add_source(repo)
        b.add_calibration(repo / "checkpoint")
        for scenario in scenarios:
            add_scenario(b, scenario, runs)
    return out


def results(out: Path) -> Path:
    return out / "closed" / SUBMITTER / "results" / SYSTEM / MODEL


def visible(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if not p.name.startswith("."))


def test_tree_appears_only_at_commit_and_passes_the_audit(tmp_path, runs, repo):
    out = tmp_path / "submission"
    with builder(out) as b:
        b.add_system_description(SYSTEM_JSON)
        b.add_source(repo)
        b.add_calibration(repo / "checkpoint")
        for scenario in ("Offline", "Server"):
            add_scenario(b, scenario, runs)
        assert not out.exists() and visible(tmp_path) == ["repo"]  # only a hidden .submission.partial-*
    assert visible(tmp_path) == ["repo", "submission"]
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []
    report = audit_tree(out)
    assert report.accepted, "\n".join(report.lines())


def test_exception_mid_build_leaves_no_tree_and_no_staging(tmp_path, runs, repo):
    out = tmp_path / "submission"
    with pytest.raises(RuntimeError, match="worker died"):
        with builder(out) as b:
            b.add_system_description(SYSTEM_JSON)
            b.add_performance_run("Offline", runs[("Offline", "performance")])
            raise RuntimeError("worker died")
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []


def test_exception_mid_build_leaves_the_existing_tree_as_it_was(tmp_path, runs, repo):
    out = build(tmp_path / "submission", runs, repo, ["Offline"])
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(KeyError):
        with builder(out) as b:
            b.add_performance_run("Server", runs[("Server", "performance")])
            raise KeyError("interrupted")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_incomplete_tree_is_not_committed(tmp_path, runs, repo):
    out = tmp_path / "submission"
    with pytest.raises(IncompleteTree, match="README.md"):
        with builder(out) as b:
            b.add_system_description(SYSTEM_JSON)
            b.add_source(repo)
            b.add_calibration(repo / "checkpoint")
            b.add_performance_run("Offline", runs[("Offline", "performance")])
            b.add_measurements("Offline", MEASUREMENTS)
            b.add_user_conf("Offline", runs[("Offline", "performance")] / "user.conf")
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []


def test_second_scenario_run_merges_into_the_existing_tree(tmp_path, runs, repo):
    out = build(tmp_path / "submission", runs, repo, ["Offline"])
    offline_log = (results(out) / "Offline" / "performance" / "run_1" / "mlperf_log_detail.txt").read_bytes()
    with builder(out) as b:
        add_scenario(b, "Server", runs)
    assert visible(results(out)) == ["Offline", "Server"]
    assert (results(out) / "Offline" / "performance" / "run_1" / "mlperf_log_detail.txt").read_bytes() == offline_log
    assert audit_tree(out).accepted


def test_rerun_replaces_a_run_and_keeps_other_readme_sections(tmp_path, runs, repo):
    out = build(tmp_path / "submission", runs, repo, ["Offline"])
    with builder(out) as b:
        b.add_accuracy_run("Offline", runs[("Offline", "accuracy")], accuracy_result(0.80))
        b.add_readme("offline", ["./run_submission.sh", "--mode", "accuracy"], "accuracy")
    acc = results(out) / "Offline" / "accuracy"
    assert '{"f1": 0.8}' in (acc / "accuracy.txt").read_text()
    readme = (results(out) / "Offline" / "README.md").read_text()
    assert "## accuracy" in readme and "--mode accuracy" in readme
    assert "## performance" in readme and "--scenario offline" in readme


def test_runs_hold_only_loadgen_files_and_failed_samples_are_filed_in_the_scenario_dir(tmp_path, runs, repo):
    perf_src = runs[("Server", "performance")]
    (perf_src / "failed_samples.json").write_text(json.dumps([{"sample_index": 3, "error": "bad image"}]))
    try:
        out = build(tmp_path / "submission", runs, repo, ["Offline", "Server"])
    finally:
        (perf_src / "failed_samples.json").unlink()
    server = results(out) / "Server"
    assert visible(server / "performance" / "run_1") == ["mlperf_log_detail.txt", "mlperf_log_summary.txt"]
    assert visible(server / "accuracy") == ["accuracy.txt", "mlperf_log_accuracy.json", "mlperf_log_detail.txt",
                                            "mlperf_log_summary.txt"]
    assert json.loads((server / "failed_samples_performance.json").read_text())[0]["sample_index"] == 3
    assert not (server / "failed_samples_accuracy.json").exists()
    # A rerun without failures removes the stale record.
    with builder(out) as b:
        b.add_performance_run("Server", perf_src)
    assert not (server / "failed_samples_performance.json").exists()


def test_accuracy_log_is_hashed_and_truncated(tmp_path, runs, repo):
    out = build(tmp_path / "submission", runs, repo, ["Offline"])
    acc = results(out) / "Offline" / "accuracy"
    assert (acc / "mlperf_log_accuracy.json").stat().st_size <= 10240
    assert (runs[("Offline", "accuracy")] / "mlperf_log_accuracy.json").stat().st_size > 10240
    assert (acc / "accuracy.txt").read_text().count("hash=") == 2  # evaluation's hash + the appended one


def test_system_description_takes_the_trees_submitter_and_division(tmp_path, runs, repo):
    out = tmp_path / "submission"
    with SubmissionTreeBuilder(out, submitter="AcmeAI", system_name=SYSTEM, division="open") as b:
        b.add_system_description(SYSTEM_JSON)
        b.add_source(repo)
        b.add_calibration(repo / "checkpoint")
        add_scenario(b, "Offline", runs)
    desc = json.loads((out / "open" / "AcmeAI" / "systems" / f"{SYSTEM}.json").read_text())
    assert (desc["submitter"], desc["division"]) == ("AcmeAI", "open")
    assert json.loads(SYSTEM_JSON.read_text())["submitter"] == "Q3VLHarness"


def test_source_copy_has_the_packages_without_caches(tmp_path):
    out = tmp_path / "submission"
    b = builder(out)
    b.begin()
    try:
        src = b.add_source(REPO)
        assert (src / "audit" / "checker.py").is_file()
        assert (src / "pyproject.toml").is_file()
        assert not list(src.rglob("__pycache__")) and not list(src.rglob("_generated"))
        assert not (src / "tests").exists()
    finally:
        b.abort()
    assert not out.exists()


def test_scenario_names_are_normalised_and_unknown_ones_rejected():
    assert scenario_dir_name("interactive") == "Interactive"
    with pytest.raises(ValueError, match="SingleStream"):
        scenario_dir_name("SingleStream")


@pytest.mark.parametrize("system_json", sorted((REPO / "mlperf_configs" / "systems").glob("*.json")),
                         ids=lambda p: p.stem)
def test_shipped_system_descriptions_pass_the_system_rules(tmp_path, runs, repo, system_json):
    out = tmp_path / "submission"
    division = json.loads(system_json.read_text())["division"]
    with SubmissionTreeBuilder(out, submitter=SUBMITTER, system_name=system_json.stem, division=division) as b:
        b.add_system_description(system_json)
        b.add_source(repo)
        b.add_calibration(repo / "checkpoint")
        add_scenario(b, "Offline", runs)
        add_scenario(b, "Server", runs)
    report = audit_tree(out)
    assert report.accepted, "\n".join(report.lines())


def test_leftovers_of_a_killed_run_are_cleared_and_an_interrupted_swap_is_undone(tmp_path, runs, repo):
    out = build(tmp_path / "submission", runs, repo, ["Offline"])
    (tmp_path / ".submission.partial-dead").mkdir()  # killed while staging
    retired = tmp_path / ".submission.old-dead"  # killed between commit's two renames
    retired.mkdir()
    out.rename(retired / "tree")
    with builder(out) as b:
        add_scenario(b, "Server", runs)
    assert visible(results(out)) == ["Offline", "Server"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".submission.") and
            not p.name.endswith(".lock")] == []


def test_a_swap_that_fails_halfway_puts_the_old_tree_back_and_leaves_nothing_aside(tmp_path, runs, repo,
                                                                                  monkeypatch):
    import os

    out = build(tmp_path / "submission", runs, repo, ["Offline"])
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    rename = os.rename

    def new_tree_refused(src, dst):  # the staged tree's rename into place, not the old tree's way back
        if Path(dst) == out and Path(src).name.startswith(".submission.partial-"):
            raise OSError(28, "No space left on device")
        return rename(src, dst)

    monkeypatch.setattr(os, "rename", new_tree_refused)
    with pytest.raises(OSError, match="No space left"), builder(out) as b:
        add_scenario(b, "Server", runs)
    monkeypatch.undo()
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo", "submission"]


def _checkpoint(root: Path, config: dict) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_calibration_md_states_unquantized_weights_for_a_checkpoint_without_quantization_config(tmp_path):
    ckpt = _checkpoint(tmp_path / "Qwen3-VL-235B-A22B-Instruct", {"torch_dtype": "bfloat16"})
    out = tmp_path / "submission"
    with builder(out) as b:
        text = b.add_calibration(ckpt).read_text()
        b.add_system_description(SYSTEM_JSON)
        b.add_source(make_source_root(tmp_path / "repo"))
        b.add_readme("Offline", "x", "performance")
        b.add_measurements("Offline", MEASUREMENTS)
        b.add_user_conf("Offline", SYSTEM_JSON)
    assert (out / "closed" / SUBMITTER / "calibration.md").read_text() == text
    assert "unquantized bfloat16" in text and "No quantization and no calibration" in text
    assert "kv_cache_dtype: auto" in text and "fp8" not in text


def test_calibration_md_names_the_fp8_layout_and_an_fp8_kv_cache(tmp_path):
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    ckpt = _checkpoint(tmp_path / "Qwen3-VL-235B-A22B-Instruct-FP8", {"quantization_config": quant})
    b = builder(tmp_path / "submission")
    b.begin()
    text = b.add_calibration(ckpt, kv_cache_dtype="fp8").read_text()
    b.abort()
    assert "Qwen3-VL-235B-A22B-Instruct-FP8" in text
    assert "quant_method fp8, fmt e4m3, weight_block_size [128, 128]" in text
    assert "KV cache: fp8" in text and "unquantized" not in text


    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".submission")] == []


def test_no_lock_file_is_left_after_a_commit_an_incomplete_tree_or_an_exception(tmp_path, runs, repo):
    out = build(tmp_path / "submission", runs, repo, ["Offline"])
    with pytest.raises(IncompleteTree), builder(out) as b:
        b.add_measurements("Server", MEASUREMENTS)  # a scenario without its runs
    with pytest.raises(RuntimeError), builder(out):
        raise RuntimeError("killed mid-build")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo", "submission"]


def test_a_builder_waiting_for_the_lock_takes_the_lock_file_its_holder_left_in_place(tmp_path):
    import fcntl
    import os
    import threading

    from audit.submission_tree import _lock

    path = tmp_path / ".submission.lock"
    first = builder(tmp_path / "submission")
    first.begin()
    held_inode = path.stat().st_ino
    taken: list[int] = []
    waiter = threading.Thread(target=lambda: taken.append(_lock(path)))
    waiter.start()
    # Wait until the waiter blocks on the holder's file, as /proc/locks shows it (the bound only ends a hang).
    for _ in range(2000):
        if any("->" in line and f":{held_inode} " in line for line in Path("/proc/locks").read_text().splitlines()):
            break
        waiter.join(0.05)
    else:
        first.abort()
        pytest.fail("the waiter never blocked on the lock file")
    first.abort()  # unlinks the file the waiter opened, then lets go
    waiter.join()
    assert path.is_file() and os.fstat(taken[0]).st_ino == path.stat().st_ino  # locked afresh, on the file in place
    probe = os.open(path, os.O_RDWR)
    with pytest.raises(BlockingIOError):
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # so a third builder waits for the waiter
    os.close(probe)
    os.close(taken[0])
