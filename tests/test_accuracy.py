"""Accuracy scoring as the reference computes it, accuracy.txt, and a round trip through a LoadGen-written log."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys

import pytest

from audit import accuracy as acc
from contract.dataset import GroundTruth, load_catalogue
from harness.synthetic_catalogue import write_synthetic_catalogue

ACC_PATTERN = r'\{.*"f1":\s*([\d\.]+).*\}'  # the submission checker's F1_HIERARCHICAL pattern


def _gt(category: str, brand: str = "acme", secondhand: bool = False) -> GroundTruth:
    return GroundTruth(category=category, brand=brand, is_secondhand=secondhand, categories=[category, "Z > Y"])


def _entry(idx: int, text: str, seq: int = 0) -> acc.LogEntry:
    return acc.LogEntry(seq_id=seq, qsl_idx=idx, data=text.encode())


def _response(category: str, brand: str = "acme", secondhand: bool = False) -> str:
    return json.dumps({"category": category, "brand": brand, "is_secondhand": secondhand})


@pytest.mark.parametrize(
    ("predicted", "truth", "components"),
    [
        ("A > B > C", "A > B > C", (3, 3, 3)),
        ("A > B > C", "A > B > D", (2, 3, 3)),  # common prefix
        ("A > X > C", "A > B > C", (1, 3, 3)),  # stops at the first mismatch
        ("A > B > C > D", "A > B", (2, 4, 2)),  # deeper prediction
        ("A", "A > B > C", (1, 1, 3)),  # shallower prediction
        ("", "A > B", (0, 1, 2)),  # empty prediction is one empty level
        ("A  >  B", "A > B", (2, 2, 2)),  # levels are stripped
        ("A>B", "A > B", (0, 1, 2)),  # only " > " separates
    ],
)
def test_hierarchical_components(predicted, truth, components):
    assert acc.hierarchical_components(predicted, truth) == components


def test_hierarchical_f1_is_micro_aggregated():
    f1, hp, hr = acc.hierarchical_f1([("A > B > C", "A > B > C"), ("X", "A > B")])
    assert (hp, hr) == (3 / 4, 3 / 5)
    assert f1 == pytest.approx(2 * 0.75 * 0.6 / 1.35)
    assert acc.hierarchical_f1([("A > B > C > D", "A > B")])[0] == pytest.approx(2 * 0.5 / 1.5)
    assert acc.hierarchical_f1([("X", "Y")]) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    "text",
    [
        '```json\n{"category": "A", "brand": "b", "is_secondhand": false}\n```',
        '{"category": "A", "brand": "b", "is_secondhand": false, "price": 3}',
        '{"category": "A", "brands": "b", "is_secondhand": false}',
        '{"category": 5, "brand": "b", "is_secondhand": false}',
        '{"category": "A", "brand": "b", "is_secondhand": "maybe"}',
        '{"category": "A", "brand": "b"}',
        "Sure! Here is the JSON: {}",
        "",
    ],
)
def test_responses_outside_the_schema_are_unparsable(text):
    assert acc.parse_response(text.encode()) is None


def test_valid_response_parses():
    parsed = acc.parse_response(b' {"category": "A > B", "brand": "b", "is_secondhand": true}\n')
    assert (parsed.category, parsed.brand, parsed.is_secondhand) == ("A > B", "b", True)
    assert acc.parse_response(b"\xff\xfe") is None  # not UTF-8


def test_unparsable_response_scores_zero_at_ground_truth_depth():
    truth = [_gt("A > B > C"), _gt("D > E")]
    result = acc.evaluate([_entry(0, _response("A > B > C")), _entry(1, "not json")], truth)
    assert result.num_unparsable == 1 and result.num_responses == 2
    # intersections 3 + 0, predicted depths 3 + 2 (padded to the truth's depth), true depths 3 + 2
    assert (result.hierarchical_precision, result.hierarchical_recall) == (3 / 5, 3 / 5)
    assert result.category_f1 == pytest.approx(0.6)
    assert result.brand_score == 0.5  # the pad never matches a brand


def test_repeated_qsl_idx_entries_all_count():
    truth = [_gt("A > B")]
    result = acc.evaluate([_entry(0, _response("A > B"), 0), _entry(0, _response("A > X"), 1)], truth)
    assert result.num_responses == 2
    assert (result.hierarchical_precision, result.hierarchical_recall) == (3 / 4, 3 / 4)


def test_brand_matches_when_fuzzy_ratio_exceeds_90_case_insensitively():
    pairs = [("Giorgio Armani", "giorgio armani"), (" giorgio armanii", "giorgio armani"), ("Adodas", "adidas")]
    assert acc.brand_score(pairs) == pytest.approx(2 / 3)


def test_secondhand_f1_is_the_positive_class_f1():
    assert acc.secondhand_f1([(True, True), (True, False), (False, True), (False, False)]) == pytest.approx(0.5)
    assert acc.secondhand_f1([(False, False)]) == 0.0


def test_random_choices_are_seeded():
    truth = [_gt("A > B", secondhand=bool(i % 2)) for i in range(40)]
    entries = [_entry(i, "garbage") for i in range(40)]
    first, again = acc.evaluate(entries, truth), acc.evaluate(entries, truth)
    assert first == again
    assert acc.evaluate(entries, truth, seed=1) != first


def test_qsl_idx_outside_the_dataset_is_an_error():
    with pytest.raises(ValueError, match="qsl_idx 5"):
        acc.evaluate([_entry(5, "{}")], [_gt("A")])


def _result(f1: float) -> acc.AccuracyResult:
    return acc.AccuracyResult(f1, f1, f1, 0.0, 0.0, 1, 0, 0.0, 0.0, 0.0)


def test_accuracy_txt_has_the_reference_bytes_and_hash(tmp_path):
    path = acc.write_accuracy_txt(_result(0.7851), tmp_path / "accuracy.txt")
    text = path.read_text()
    expected_hash = hashlib.sha256(b'{"f1": 0.7851}').hexdigest()
    assert text == f'Results\n\n{{"f1": 0.7851}}\n\nhash={expected_hash}'
    assert re.search(ACC_PATTERN, text).group(1) == "0.7851"
    assert re.search(r"^hash=[0-9a-f]{64}$", text, re.MULTILINE)


@pytest.mark.parametrize("f1", [6.9e-06, 1e-20, 0.0, 1.0, 0.30000000000000004])
def test_accuracy_txt_writes_the_f1_so_the_checker_pattern_reads_its_value(tmp_path, f1):
    text = acc.write_accuracy_txt(_result(f1), tmp_path / "accuracy.txt").read_text()
    assert float(re.search(ACC_PATTERN, text).group(1)) == f1
    assert json.loads(re.search(r"\{.*\}", text).group(0)) == {"f1": f1}


def test_targets_per_scenario():
    assert _result(0.782397).passes("offline") and _result(0.782397).passes("Server")
    assert not _result(0.7823).passes("offline")
    assert _result(0.77993).passes("interactive") and not _result(0.7799).passes("interactive")
    with pytest.raises(ValueError, match="singlestream"):
        _result(0.9).passes("singlestream")


LOADGEN_SUT = r"""
import array, json, sys
import mlperf_loadgen as lg

responses = json.load(open(sys.argv[1]))
keep = []

def issue(samples):
    for s in samples:
        buf = array.array("B", responses[s.index].encode("utf-8"))
        keep.append(buf)
        address, length = buf.buffer_info()
        lg.QuerySamplesComplete([lg.QuerySampleResponse(s.id, address, length, 7)])

sut = lg.ConstructSUT(issue, lambda: None)
qsl = lg.ConstructQSL(len(responses), len(responses), lambda idx: None, lambda idx: None)
settings = lg.TestSettings()
settings.scenario = lg.TestScenario.Offline
settings.mode = lg.TestMode.AccuracyOnly
settings.offline_expected_qps = 1000
output = lg.LogOutputSettings()
output.outdir = sys.argv[2]
log = lg.LogSettings()
log.log_output = output
log.enable_trace = False
lg.StartTestWithLogSettings(sut, qsl, settings, log)
lg.DestroyQSL(qsl)
lg.DestroySUT(sut)
"""


def test_round_trip_through_a_log_that_loadgen_wrote(tmp_path):
    catalogue = load_catalogue(write_synthetic_catalogue(tmp_path / "cat", 16, seed=5))
    truth = catalogue.ground_truth()
    responses, expected = [], [0, 0, 0]  # expected sums: intersection, predicted depth, true depth
    for i, gt in enumerate(truth):
        depth = len(gt.category.split(" > "))
        kind = i % 4
        if kind == 0:  # exact
            responses.append(_response(gt.category, gt.brand, gt.is_secondhand))
            parts = (depth, depth, depth)
        elif kind == 1:  # top level only, brand in capitals
            responses.append(_response(gt.category.split(" > ")[0], gt.brand.upper(), not gt.is_secondhand))
            parts = (1, 1, depth)
        elif kind == 2:  # one level too deep, wrong brand
            responses.append(_response(gt.category + " > Extra", "unknown brand", gt.is_secondhand))
            parts = (depth, depth + 1, depth)
        else:  # fenced: unparsable
            responses.append("```json\n" + _response(gt.category) + "\n```")
            parts = (0, depth, depth)
        expected = [e + p for e, p in zip(expected, parts)]
    (tmp_path / "responses.json").write_text(json.dumps(responses))
    (tmp_path / "sut.py").write_text(LOADGEN_SUT)
    (tmp_path / "logs").mkdir()
    subprocess.run([sys.executable, str(tmp_path / "sut.py"), str(tmp_path / "responses.json"),
                    str(tmp_path / "logs")], check=True, cwd=tmp_path, timeout=120, capture_output=True)

    log_path = tmp_path / "logs" / "mlperf_log_accuracy.json"
    entries = acc.read_accuracy_log(log_path)
    assert sorted(e.qsl_idx for e in entries) == list(range(16))
    raw = json.loads(log_path.read_text())
    assert all(r["data"] == r["data"].upper() for r in raw)
    assert {e.qsl_idx: e.data.decode() for e in entries} == dict(enumerate(responses))

    result = acc.evaluate_accuracy_log(log_path, catalogue)
    hp, hr = expected[0] / expected[1], expected[0] / expected[2]
    assert (result.hierarchical_precision, result.hierarchical_recall) == pytest.approx((hp, hr))
    assert result.category_f1 == pytest.approx(2 * hp * hr / (hp + hr))
    assert result.num_unparsable == 4 and result.num_responses == 16
    assert result.brand_score == pytest.approx(8 / 16)  # exact and upper-cased brands match

    out = tmp_path / "accuracy.txt"
    code = acc.main(["--log", str(log_path), "--dataset", str(tmp_path / "cat"), "--out", str(out),
                     "--scenario", "offline"])
    assert code == 1  # far below the 0.7824 target
    assert json.loads(re.search(r"\{.*\}", out.read_text()).group(0)) == {"f1": result.category_f1}
