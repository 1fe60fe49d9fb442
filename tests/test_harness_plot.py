"""The performance plot from a real LoadGen trace: Offline shows completions over time (its samples are all
issued at t=0), Server latency against issue time."""

from __future__ import annotations

import pytest

from harness.plot import SampleLatency, completions_over_time, plot_performance_run, read_sample_latencies
from tests.helpers.loadgen_fixtures import LoadGenRunSpec, run_loadgen


def test_offline_completions_over_time_count_each_sample_at_its_completion():
    samples = [SampleLatency(0.0, latency, i) for i, latency in enumerate([3.0, 1.0, 2.0])]
    assert completions_over_time(samples) == ([1.0, 2.0, 3.0], [1, 2, 3])


@pytest.mark.parametrize("scenario", ["Offline", "Server"])
def test_a_real_loadgen_trace_is_plotted(scenario, tmp_path):
    logs = run_loadgen(LoadGenRunSpec(scenario, "PerformanceOnly", trace=True), tmp_path / "logs")
    samples = read_sample_latencies(logs / "mlperf_log_trace.json")
    assert len(samples) >= 20
    if scenario == "Offline":  # why Offline plots completions: every sample was issued at once
        assert {s.issued_s for s in samples} == {samples[0].issued_s}
        times, counts = completions_over_time(samples)
        assert counts[-1] == len(samples) and times == sorted(times) and times[0] > samples[0].issued_s
    else:
        assert len({s.issued_s for s in samples}) > 1
    png = plot_performance_run(logs / "mlperf_log_trace.json", tmp_path / "latency.png", f"tiny {scenario}",
                               offline=scenario == "Offline", target_latency_s=None if scenario == "Offline" else 1.5)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
