"""Ctrl-C while a run renames its submission tree into place (the builder the harness makes, under the harness's
own signal handling): the swap is never left half done. The signal is delivered once the new tree is in place,
whole, and nothing is left beside it: no `.submission.old-*` (the retired tree), no `.submission.partial-*`."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from harness.interrupts import Interrupted, interruptible
from harness.pipeline import submission_builder
from harness.system_config import load_system_config
from tests.helpers.loadgen_fixtures import SYSTEM_JSON, add_scenario, make_source_root, official_runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return official_runs(tmp_path_factory.mktemp("runs"), scenarios=("Offline", "Server"))


def lay_out(out: Path, runs, repo: Path, scenario: str) -> None:
    """One run's tree, as the harness lays it out (cpu-tiny's submitter, system and division)."""
    with submission_builder(load_system_config("cpu-tiny"), out) as builder:
        builder.add_system_description(SYSTEM_JSON)
        builder.add_source(repo)
        builder.add_calibration(repo / "checkpoint")
        add_scenario(builder, scenario, runs)


# The swap's file operations, each a moment where Ctrl-C lands: (operation, which of its calls).
SWAP_STEPS = {
    "moving-the-old-tree-aside": ("rename", lambda src, dst, out: Path(src) == out),
    "renaming-the-new-tree-in": ("rename", lambda src, dst, out: Path(dst) == out),
    "deleting-the-old-tree": ("rmtree", lambda path, out: Path(path).name.startswith(f".{out.name}.old-")),
}


@pytest.mark.parametrize("step", list(SWAP_STEPS))
def test_sigint_during_the_final_swap_leaves_the_new_tree_whole_and_nothing_beside_it(step, tmp_path, runs,
                                                                                       monkeypatch):
    repo = make_source_root(tmp_path / "repo")
    out = tmp_path / "submission"
    lay_out(out, runs, repo, "Offline")  # an earlier run's tree
    operation, is_the_call = SWAP_STEPS[step]
    original = {"rename": os.rename, "rmtree": shutil.rmtree}[operation]
    signalled = []

    def ctrl_c_first(*args, **kwargs):  # a real SIGINT to this process just before the operation
        if not signalled and is_the_call(*args[:2 if operation == "rename" else 1], out):
            signalled.append(step)
            signal.raise_signal(signal.SIGINT)
        return original(*args, **kwargs)

    monkeypatch.setattr(os if operation == "rename" else shutil, operation, ctrl_c_first)
    with interruptible(), pytest.raises(Interrupted, match="SIGINT"):
        lay_out(out, runs, repo, "Server")
    assert signalled == [step]
    results = out / "closed" / "Q3VLHarness" / "results" / "cpu-tiny" / "qwen3-vl-235b-a22b"
    assert sorted(p.name for p in results.iterdir()) == ["Offline", "Server"]  # the new tree, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo", "submission"]  # nothing aside, no lock file
