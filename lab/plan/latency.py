"""Whether a run kept up with its arrivals, from (issue s, latency s, ...) rows, and the latency bounds it is
judged against: shared by the LoadGen sweep (lab/plan/sim_sweep.py) and the planner's virtual-clock runs
(lab/plan/planner.py)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

# p99 latency bounds of the Qwen3-VL benchmark, ms: Server 12 s, Interactive 1.5 s (the reference's v6.1
# specification, https://github.com/mlcommons/inference/blob/master/multimodal/qwen3-vl/README.md)
BOUND_MS = {"server": 12000, "interactive": 1500}
KEPT_UP_MIN = 0.93  # kept_up below it: the cluster falls behind its arrivals


def kept_up(rows: Sequence[tuple[float, ...]], skip: float = 0.4) -> float:
    """After the first `skip` of the run (the cluster filling up): queries completed in [start + L, last issue]
    over queries issued in [start, last issue - L], L the median latency of that part. ~1 while the cluster
    keeps up, ~capacity/offered once it falls behind; NaN when that part is shorter than L."""
    if len(rows) < 8:
        return float("nan")
    start = rows[0][0] + skip * (rows[-1][0] - rows[0][0])
    last = rows[-1][0]
    lag = statistics.median(r[1] for r in rows if r[0] >= start)
    issued = sum(start <= r[0] <= last - lag for r in rows)
    if not issued:
        return float("nan")
    return sum(start + lag <= r[0] + r[1] <= last for r in rows) / issued
