"""lab.peak.tail_anatomy: the slowest queries of a run, their own sizes and the large images in flight when each was
issued."""

from __future__ import annotations

import pytest

from contract.tokenizer import IMAGE_PAD_ID
from harness.plot import SampleLatency
from lab.peak.tail_anatomy import SampleShape, tail_anatomy


def test_a_sample_shape_counts_the_prompt_and_its_image_rows():
    assert SampleShape.of([1, 2, IMAGE_PAD_ID, IMAGE_PAD_ID, IMAGE_PAD_ID, 3]) == SampleShape(6, 3)


def test_the_tail_is_the_slowest_percent_with_the_large_images_in_flight_when_each_was_issued():
    # 200 queries a second apart; query 100 has a huge image and takes 5 s, the two issued after it wait behind it
    shapes = {i: SampleShape(1000, 500) for i in range(200)}
    shapes[100] = SampleShape(16500, 16000)
    latency = {i: 0.5 for i in range(200)}
    latency.update({100: 5.0, 101: 4.5, 102: 3.8})
    samples = [SampleLatency(float(i), latency[i], i) for i in range(200)]
    report = tail_anatomy(samples, shapes)
    assert report["queries"] == 200 and report["tail_queries"] == 2  # 1% of 200
    assert [(q["sample_index"], q["large_images_in_flight"]) for q in report["slowest"]] == [(100, 0), (101, 1)]
    assert report["large_image_tokens"] == 2000  # 4 x the median: the run's 99th percentile is an ordinary image
    assert report["tail_with_own_large_image"] == 1 and report["tail_with_large_image_in_flight"] == 1
    assert report["image_tokens_median"] == {"all": 500, "tail": 8250}
    assert report["tail_from_latency_s"] == 4.5


def test_an_empty_trace_is_an_error():
    with pytest.raises(ValueError, match="no samples"):
        tail_anatomy([], {})


def request_line(request: str, t0: float, submitted: float, latency: float, **extra) -> dict:
    """A finished request's trace line: submitted at t0 + submitted (Unix), 0.1 s preparing, its first token half
    way, finished `latency` later."""
    s = submitted
    return {"request": request, "t0_unix_s": t0, "submitted_s": s, "prepare_started_s": s, "prepared_s": s + 0.1,
            "admitted_s": s + 0.1, "first_scheduled_s": s + 0.1, "first_token_s": s + latency / 2,
            "finished_s": s + latency, "finish_reason": "stop", "tower_s": [], "prefill_s": [[s + 0.1, s + 0.2, 8]],
            **extra}


def write_trace(path, lines) -> None:
    import json

    path.mkdir(exist_ok=True)
    (path / f"steps-{len(list(path.iterdir()))}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_the_engines_lines_of_a_window_by_sample_in_submission_order_a_resent_query_by_its_last_line(tmp_path):
    from lab.peak.tail_anatomy import engine_requests

    write_trace(tmp_path, [
        request_line("q1-s7", 1000.0, 5.0, 1.0),
        request_line("q2-s7", 1000.0, 3.0, 1.0),  # the same sample, issued earlier
        request_line("q3-s4", 1000.0, 50.0, 1.0),  # after the window
        request_line("warmup-0", 1000.0, 4.0, 1.0),  # not a LoadGen query
        request_line("q4-s2#1", 1000.0, 6.0, 0.5, finish_reason="error"),  # a first attempt that failed ...
    ])
    write_trace(tmp_path, [request_line("q4-s2#2", 1002.0, 5.0, 0.5)])  # ... migrated to another engine
    by_index = engine_requests(tmp_path, (1001.0, 1010.0))
    assert {i: [line["request"] for line in lines] for i, lines in by_index.items()} == {
        7: ["q2-s7", "q1-s7"], 2: ["q4-s2#2"]}


def hundred_queries(latency: dict[int, float], engine_latency: dict[int, float] | None = None):
    """100 queries a second apart, query i of sample i % 10, each 1 s as LoadGen saw it (0.9 s in its engine line)
    unless `latency` (`engine_latency`) says otherwise: LoadGen's samples and the engines' lines by sample index."""
    samples = [SampleLatency(float(i), latency.get(i, 1.0), i % 10) for i in range(100)]
    lines: dict[int, list[dict]] = {}
    for i in range(100):
        lines.setdefault(i % 10, []).append(
            request_line(f"q{i}-s{i % 10}", 0.0, float(i), (engine_latency or {}).get(i, 0.9)))
    return samples, lines


def test_the_tails_time_is_split_into_the_engines_phases_and_the_rest():
    from lab.peak.tail_anatomy import timeline_anatomy

    # 100 queries of sample i % 10; query 99 waited 2 s outside the engine, query 98 stalled inside it
    samples, lines = hundred_queries({99: 3.0, 98: 2.5}, engine_latency={98: 2.4})
    report = timeline_anatomy(samples, lines, fraction=0.02)
    assert report["matched_queries"] == 100 and report["tail_queries_matched"] == 2
    slowest = {q["sample_index"]: q for q in report["slowest"]}
    assert [q["sample_index"] for q in report["slowest"]] == [9, 8]
    assert slowest[9]["outside_engine_s"] == pytest.approx(2.1) and slowest[8]["outside_engine_s"] == pytest.approx(0.1)
    assert slowest[8]["stalled_s"] == pytest.approx(1.2 - 0.2) and slowest[8]["decode_s"] == pytest.approx(1.2)
    assert report["all_median_s"]["outside_engine_s"] == pytest.approx(0.1)


def test_every_query_over_the_bound_is_listed_in_issue_order_beyond_the_slowest_percent():
    # 200 queries; five over a 1.5 s bound, where the slowest 1% holds two of them
    shapes = {i: SampleShape(1000, 500) for i in range(200)}
    latency = {i: 0.5 for i in range(200)}
    latency.update({150: 1.6, 20: 3.0, 90: 1.51, 7: 2.0, 199: 1.7, 60: 1.5})  # 60: at the bound, not over it
    samples = [SampleLatency(float(i), latency[i], i) for i in range(200)]
    report = tail_anatomy(samples, shapes, bound_s=1.5)
    assert report["tail_queries"] == 2
    assert [q["sample_index"] for q in report["over_bound"]] == [7, 20, 90, 150, 199]
    assert report["over_bound"][0] == {"sample_index": 7, "latency_s": 2.0, "issued_s": 7.0, "image_tokens": 500,
                                       "prompt_tokens": 1000, "large_images_in_flight": 0}
    assert "over_bound" not in tail_anatomy(samples, shapes)  # no bound (Offline): no such list


def test_the_timeline_of_every_query_over_the_bound_is_listed_in_issue_order():
    from lab.peak.tail_anatomy import timeline_anatomy

    samples, lines = hundred_queries({40: 2.0, 3: 1.8})
    report = timeline_anatomy(samples, lines, bound_s=1.5)
    assert [(q["sample_index"], q["issued_s"]) for q in report["over_bound"]] == [(3, 3.0), (0, 40.0)]
    assert report["over_bound"][1]["outside_engine_s"] == pytest.approx(1.1)
    assert "over_bound" not in timeline_anatomy(samples, lines)


def test_a_query_over_the_bound_carries_the_schedulers_decision_on_its_large_image():
    from lab.peak.tail_anatomy import timeline_anatomy

    samples, lines = hundred_queries({40: 2.0, 3: 1.8})
    decision = {"estimated_s": 1.4, "slack_s": 1.2, "past_saving": True, "others": 2}
    lines[0][4]["tower_decision"] = decision  # query 40: sample 0's fifth line
    report = timeline_anatomy(samples, lines, bound_s=1.5)
    over = {q["sample_index"]: q for q in report["over_bound"]}
    assert over[0]["tower_decision"] == decision and "tower_decision" not in over[3]
    assert set(report["all_median_s"]) == set(report["tail_median_s"])  # medians over the phases alone
