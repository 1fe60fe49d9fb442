"""A picture of one performance run, read from LoadGen's trace log (mlperf_log_trace.json): Server and
Interactive plot per-sample latency over the run, with the latency target; Offline, where LoadGen issues every
sample at t=0, plots completions over time (the throughput). Both beside the latency histogram."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from contract.stats import percentile  # noqa: E402

# LoadGen writes one "Sample" begin event per completed sample; its args carry the latency. The trace file
# is not strict JSON (some LogDetail args are double-quoted twice), so events are matched one by one.
_SAMPLE_EVENT = re.compile(
    r'"name":"Sample","cat":"default","ph":"b",.*?"ts":(?P<ts>[\d.]+),'
    r'"args":\{[^}]*?"sample_idx":(?P<idx>\d+),[^}]*?"complete_ns":(?P<latency>\d+)'
)


@dataclass(frozen=True)
class SampleLatency:
    issued_s: float  # seconds since the test started
    latency_s: float
    sample_index: int

    @property
    def completed_s(self) -> float:
        return self.issued_s + self.latency_s


def completions_over_time(samples: list[SampleLatency]) -> tuple[list[float], list[int]]:
    """(completion times in ascending order, samples completed by each): the Offline throughput curve."""
    times = sorted(s.completed_s for s in samples)
    return times, list(range(1, len(times) + 1))


def read_sample_latencies(trace_path: Path) -> list[SampleLatency]:
    samples = [
        SampleLatency(float(m["ts"]) / 1e6, int(m["latency"]) / 1e9, int(m["idx"]))
        for m in _SAMPLE_EVENT.finditer(trace_path.read_text(encoding="utf-8", errors="replace"))
    ]
    if not samples:
        raise ValueError(f"{trace_path}: no per-sample events in the LoadGen trace log")
    return sorted(samples, key=lambda s: s.issued_s)


def plot_performance_run(trace_path: Path, out_png: Path, title: str, *, offline: bool,
                         target_latency_s: float | None = None) -> Path:
    """Writes a PNG: the run over time (left: completions for Offline, else latency against issue time) and the
    latency histogram (right)."""
    samples = read_sample_latencies(trace_path)
    latencies = sorted(s.latency_s for s in samples)
    p50, p99 = percentile(latencies, 0.5, 0.0), percentile(latencies, 0.99, 0.0)
    fig, (timeline, histogram) = plt.subplots(1, 2, figsize=(12, 4.5))
    lines = [(histogram, histogram.axvline)]
    if offline:
        times, counts = completions_over_time(samples)
        timeline.step(times, counts, where="post")
        timeline.set_xlabel("completed at (s)")
        timeline.set_ylabel("samples completed")
        timeline.set_title(f"{len(times) / max(times[-1], 1e-9):.2f} samples/s", fontsize="medium")
    else:
        timeline.scatter([s.issued_s for s in samples], [s.latency_s for s in samples], s=6, alpha=0.6)
        timeline.set_xlabel("issued at (s)")
        timeline.set_ylabel("latency (s)")
        lines.append((timeline, timeline.axhline))
    histogram.hist(latencies, bins=min(60, max(10, len(latencies) // 5)))
    histogram.set_xlabel("latency (s)")
    histogram.set_ylabel("samples")
    for axis, draw in lines:
        draw(p50, color="tab:green", linestyle="--", label=f"p50 {p50:.2f} s")
        draw(p99, color="tab:orange", linestyle="--", label=f"p99 {p99:.2f} s")
        if target_latency_s is not None:
            draw(target_latency_s, color="tab:red", label=f"target {target_latency_s:g} s")
        axis.legend(loc="upper right", fontsize="small")
    fig.suptitle(f"{title}: {len(samples)} samples")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
