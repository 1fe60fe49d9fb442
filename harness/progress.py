"""Live progress of one LoadGen test (tqdm: completed of the samples LoadGen will issue, ETA, QPS, p50/p99
latency) and the summary table printed at the end from LoadGen's own logs."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from tqdm import tqdm

from contract.stats import percentile

_POSTFIX_INTERVAL_S = 1.0


class Progress:
    """Thread-safe counters the SUT feeds; renders a tqdm bar on stderr (disabled when not wanted). `total`: the
    samples LoadGen will issue (harness.user_conf.expected_sample_count), which gives the bar its ETA."""

    def __init__(self, description: str, total: int | None = None, enabled: bool = True) -> None:
        self._lock = threading.Lock()
        self._issued = 0
        self._completed = 0
        self._failed = 0
        self._latencies: list[float] = []
        self._start = time.monotonic()
        self._last_postfix = 0.0
        self._bar = tqdm(total=total, desc=description, unit="q", disable=not enabled, dynamic_ncols=True)

    def issued(self, count: int) -> None:
        with self._lock:
            self._issued += count

    def completed(self, latency_s: float, ok: bool) -> None:
        with self._lock:
            self._completed += 1
            self._failed += 0 if ok else 1
            self._latencies.append(latency_s)
            now = time.monotonic()
            refresh = now - self._last_postfix >= _POSTFIX_INTERVAL_S
            if refresh:
                self._last_postfix = now
                self._bar.set_postfix_str(self._postfix(now), refresh=False)
            self._bar.update(1)

    def _postfix(self, now: float) -> str:
        qps = self._completed / max(now - self._start, 1e-9)
        text = (
            f"issued={self._issued} qps={qps:.2f} "
            f"p50={percentile(self._latencies, 0.5, 0.0):.2f}s p99={percentile(self._latencies, 0.99, 0.0):.2f}s"
        )
        return text + (f" failed={self._failed}" if self._failed else "")

    @property
    def counts(self) -> tuple[int, int, int]:
        """(issued, completed, failed)."""
        with self._lock:
            return self._issued, self._completed, self._failed

    def close(self) -> None:
        with self._lock:
            self._bar.set_postfix_str(self._postfix(time.monotonic()), refresh=False)
            self._bar.close()


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned text table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
