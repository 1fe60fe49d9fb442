"""Whether a run kept up with its arrivals, from (issue s, latency s, ...) rows: shared by the LoadGen sweep
(scripts/sim_sweep.py) and the planner's virtual-clock runs (scripts/plan_layout.py)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


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
