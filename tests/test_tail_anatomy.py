"""harness.tail_anatomy: the slowest queries of a run, their own sizes and the large images in flight when each was
issued."""

from __future__ import annotations

import pytest

from harness.plot import SampleLatency
from harness.tail_anatomy import SampleShape, tail_anatomy
from contract.tokenizer import IMAGE_PAD_ID


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
