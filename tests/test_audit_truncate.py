"""Accuracy logs are hashed and truncated as truncate_accuracy_log.py does, and only once."""

from __future__ import annotations

import hashlib
import re

import pytest

from audit.truncate import MissingAccuracyTxt, truncate_accuracy_dir, truncate_submission

ACCURACY_TXT = 'Results\n\n{"f1": 0.79}\n\nhash=abc123'


def make_accuracy_dir(path, log_bytes: bytes, accuracy_txt: str | None = ACCURACY_TXT):
    path.mkdir(parents=True)
    (path / "mlperf_log_accuracy.json").write_bytes(log_bytes)
    if accuracy_txt is not None:
        (path / "accuracy.txt").write_text(accuracy_txt)
    return path


def big_log() -> bytes:
    entries = ",\n".join('{ "seq_id" : %d, "qsl_idx" : %d, "data" : "%s" }' % (i, i, "7B" * 40) for i in range(200))
    return ("[\n" + entries + "\n]\n").encode()


def test_large_log_gets_its_hash_appended_and_is_cut_to_head_and_tail(tmp_path):
    log = big_log()
    acc = make_accuracy_dir(tmp_path / "accuracy", log)
    assert truncate_accuracy_dir(acc) is True
    text = (acc / "accuracy.txt").read_text()
    assert text == ACCURACY_TXT + f"\nhash={hashlib.sha256(log).hexdigest()}\n"
    assert (acc / "mlperf_log_accuracy.json").read_bytes() == log[:4096] + b"\n\n...\n\n" + log[-4096:]


def test_truncation_is_idempotent(tmp_path):
    acc = make_accuracy_dir(tmp_path / "accuracy", big_log())
    truncate_accuracy_dir(acc)
    before = {p.name: p.read_bytes() for p in acc.iterdir()}
    assert truncate_accuracy_dir(acc) is False
    assert {p.name: p.read_bytes() for p in acc.iterdir()} == before


def test_small_log_without_hash_gets_a_hash_and_stays_whole(tmp_path):
    log = b'[\n{ "seq_id" : 0, "qsl_idx" : 0, "data" : "7B7D" }\n]\n'
    acc = make_accuracy_dir(tmp_path / "accuracy", log, accuracy_txt='Results\n\n{"f1": 0.79}\n')
    assert truncate_accuracy_dir(acc) is True
    assert re.search(r"^hash=[0-9a-f]{64}$", (acc / "accuracy.txt").read_text(), re.MULTILINE)
    assert (acc / "mlperf_log_accuracy.json").read_bytes() == log
    assert truncate_accuracy_dir(acc) is False


def test_small_log_already_hashed_is_left_alone(tmp_path):
    acc = make_accuracy_dir(tmp_path / "accuracy", b"[]\n")
    assert truncate_accuracy_dir(acc) is False
    assert (acc / "accuracy.txt").read_text() == ACCURACY_TXT


def test_missing_accuracy_txt_is_an_error_naming_the_file(tmp_path):
    acc = make_accuracy_dir(tmp_path / "accuracy", big_log(), accuracy_txt=None)
    with pytest.raises(MissingAccuracyTxt, match="accuracy.txt missing"):
        truncate_accuracy_dir(acc)
    assert len((acc / "mlperf_log_accuracy.json").read_bytes()) > 10240


def test_truncate_submission_visits_every_scenario_accuracy_dir(tmp_path):
    results = tmp_path / "closed" / "Org" / "results" / "sys" / "qwen3-vl-235b-a22b"
    dirs = [make_accuracy_dir(results / s / "accuracy", big_log()) for s in ("Offline", "Server")]
    assert truncate_submission(tmp_path) == dirs
    assert truncate_submission(tmp_path) == []


def test_cli_truncates_a_tree_and_reports_when_nothing_is_left(tmp_path, capsys):
    from audit.truncate import main

    acc = make_accuracy_dir(tmp_path / "closed" / "Org" / "results" / "s" / "qwen3-vl-235b-a22b" / "Server"
                            / "accuracy", big_log())
    assert main([str(tmp_path)]) == 0
    assert str(acc) in capsys.readouterr().out
    assert main([str(tmp_path)]) == 0
    assert "nothing to do" in capsys.readouterr().out
