"""scripts/probe_query.py (lab/peak/query_probe.py): one query with one image of a given size through the real
product path (router -> Ray worker -> engine) on cpu-tiny, with the client's times and the engine's own timeline of
the same request."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from lab.peak.query_probe import catalogue_jpeg

REPO = Path(__file__).resolve().parent.parent


def test_the_probe_image_is_a_jpeg_of_the_asked_size_with_a_photographs_weight():
    data = catalogue_jpeg(640, 480)
    image = Image.open(io.BytesIO(data))
    assert (image.format, image.size) == ("JPEG", (640, 480))
    assert len(data) > 20_000  # noise and shapes: not a flat image that compresses to nothing


def test_a_bad_image_size_is_refused_before_anything_starts():
    result = subprocess.run([sys.executable, "scripts/probe_query.py", "--image", "4000"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--image '4000': expected WIDTHxHEIGHT" in result.stderr


def test_one_query_through_the_product_path_with_its_engine_timeline(tmp_path):
    result = subprocess.run(
        [sys.executable, "scripts/probe_query.py", "--system", "cpu-tiny", "--image", "640x480", "--repeat", "2",
         "--output", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--json", str(tmp_path / "p.json")],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "p.json").read_text()) == report  # --json: the same object, in a file
    assert (report["system"], report["image"]) == ("cpu-tiny", "640x480")
    assert report["image_tokens"] == (640 // 32) * (480 // 32)  # smart_resize keeps 640x480: 20 x 15 merged patches
    assert len(report["queries"]) == 2
    for query in report["queries"]:
        assert query["tokens"] > 0 and query["finish_reason"] in ("LENGTH", "STOP")
        engine = query["engine"]
        assert set(engine) == {"preprocess_s", "queue_s", "tower_s", "prefill_s", "stalled_s", "decode_s"}
        # the only request's image runs in its prompt's step: its tower time is inside prefill_s, none alone
        assert engine["prefill_s"] > 0 and engine["tower_s"] == 0 and all(v >= 0 for v in engine.values())
        # the engine's time is inside the client's; the rest is the router and the wire
        assert sum(engine.values()) + query["outside_engine_s"] == pytest.approx(query["end_to_end_s"], abs=2e-3)
        assert 0 < query["first_token_s"] < query["end_to_end_s"]


def test_a_json_path_that_cannot_be_written_loses_no_report(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = subprocess.run(
        [sys.executable, "scripts/probe_query.py", "--system", "cpu-tiny", "--image", "320x320", "--repeat", "1",
         "--output", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--json", str(blocker / "p.json")],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 1 and f"--json {blocker / 'p.json'}" in result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])  # the report, on stdout all the same
    assert report["image"] == "320x320" and len(report["queries"]) == 1
