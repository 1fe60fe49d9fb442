"""Faults on the real path (`python -m harness`: LoadGen -> router process -> Ray workers on cpu-tiny): worker
SIGKILL and SIGSTOP, router SIGKILL, and a catalogue of bad samples. Every accuracy run must answer each
sample exactly once (LoadGen's accuracy log), lose none, and show the migrations or restarts it took. Worker faults
are met alike when LoadGen's queries are routed in the SUT's own process (router.mode embedded)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.embedded_routing import LOG_FILE as EMBEDDED_LOG
from harness.synthetic_catalogue import write_synthetic_catalogue
from lab.soak.fault_soak import HarnessRun, soak_system

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "tests" / "harness"
SAMPLES = 24


def assert_every_sample_answered_once(report, failed_expected: set[int] = frozenset()) -> None:
    assert report.returncode == 1, report.stderr_tail  # the audit rejects a tiny random model, nothing else
    assert report.issued == SAMPLES
    assert report.answered_twice == 0
    assert report.loadgen_errors == 0
    assert {f["sample_index"] for f in report.failed_samples} == failed_expected, report.failed_samples
    assert report.lost == len(failed_expected)


@pytest.mark.parametrize("router_mode", ["process", "embedded"])
def test_worker_killed_and_worker_hung_mid_run_lose_and_repeat_no_query(router_mode, tmp_path):
    # 1 query/s keeps LoadGen issuing for ~SAMPLES s, long enough for both faults and the recovery between them
    # (a Ray restart rebuilds the engine) even on a loaded 2-core machine.
    system = soak_system(tmp_path, SAMPLES, qps=1.0, router_mode=router_mode)
    run = HarnessRun(system, tmp_path / "out", CACHE).start()
    run.wait_for_loadgen()
    for fault in ("kill_worker", "stop_worker"):
        if run.wait_for_inflight(2):
            run.inject(fault)
    report = run.finish()
    assert_every_sample_answered_once(report)
    assert report.faults == ["kill_worker", "stop_worker"], "the run ended before every fault"
    assert report.migrations >= 2  # at least one request moved per fault
    log = run.router_log()  # the router that routed LoadGen's queries is the one that saw this
    assert "down: stream failed" in log  # the killed worker: its streams broke at once
    assert "down: no heartbeat" in log or "down: engine stalled" in log  # the hung one: the health check
    if router_mode == "embedded":  # LoadGen's queries went from its own process straight to the workers
        assert "migrating (" in run.run_file(EMBEDDED_LOG) and "migrating (" not in run.run_file("router.log")


@pytest.mark.slow
def test_router_killed_mid_run_is_restarted_and_unanswered_queries_are_sent_again(tmp_path):
    run = HarnessRun(soak_system(tmp_path, SAMPLES, qps=1.5), tmp_path / "out", CACHE).start()
    run.wait_for_loadgen()
    assert run.wait_for_inflight(2)
    run.inject("kill_router")
    report = run.finish()
    assert_every_sample_answered_once(report)
    assert report.router_restarts == 1
    assert report.resent >= 2  # the queries in flight when it died were sent again, each answered once
    assert run.router_log().count("router listening on") == 2


BAD = {1: "undecodable", 3: "empty_image", 5: "bomb", 7: "long_prompt", 9: "bad_utf8", 11: "cmyk", 13: "16bit"}
MUST_FAIL = {1, 3, 5, 7}  # bad_utf8 is served with U+FFFD; cmyk and 16-bit are valid images


@pytest.mark.slow
def test_bad_samples_get_error_responses_naming_them_and_the_run_and_audit_go_on(tmp_path):
    catalogue = write_synthetic_catalogue(tmp_path / "catalogue", SAMPLES, seed=0, bad_samples=BAD)
    system = soak_system(tmp_path, SAMPLES, qps=2.0, dataset=str(catalogue))
    run = HarnessRun(system, tmp_path / "out", CACHE).start()
    report = run.finish()
    assert_every_sample_answered_once(report, failed_expected=MUST_FAIL)
    errors = {f["sample_index"]: f["error"] for f in report.failed_samples}
    assert "sample 1:" in errors[1] and "sample 3:" in errors[3] and "sample 5:" in errors[5]
    assert "decompression bomb" in errors[5]
    assert "max_model_len" in errors[7]
    assert "sample 9: product_title is not valid UTF-8" in run.stderr  # logged, then served with U+FFFD
    assert re.search(r"WARN\s+failed-samples-accuracy\s+Server\s+4 sample\(s\) answered with an error", run.stdout)
    audit = (run.output / "submission" / "closed" / "Q3VLHarness" / "results" / "cpu-tiny" / "qwen3-vl-235b-a22b"
             / "Server" / "failed_samples_accuracy.json")
    assert {r["sample_index"] for r in json.loads(audit.read_text())} == MUST_FAIL
