"""Per-request trace of simulated engines: when a request reached the engine and when it finished (wall clock),
and how far the engine's steps ran late meanwhile; the sweep reads it to split a latency into engine and overhead.

One tab-separated file per engine: request id, wall seconds in, wall seconds out, step overrun seconds.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TracedRequest:
    request_id: str
    t_in: float
    t_out: float
    overrun_s: float  # wall seconds the engine's steps ran past their simulated length while the request was in

    @property
    def residence_s(self) -> float:
        return self.t_out - self.t_in


class RequestTrace:
    """Writer: `enter` when the engine receives a request, `leave` when it finishes (thread-safe enough: one
    dict write per call, one line per finished request, line-buffered)."""

    def __init__(self, directory: str | Path, engine: str) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._file = (Path(directory) / f"{os.getpid()}-{engine}.tsv").open("a", buffering=1)
        self._open: dict[str, tuple[float, float]] = {}

    def enter(self, request_id: str, overrun_s: float) -> None:
        self._open[request_id] = (time.time(), overrun_s)

    def leave(self, request_id: str, overrun_s: float) -> None:
        entered = self._open.pop(request_id, None)
        if entered is not None:
            self._file.write(f"{request_id}\t{entered[0]:.6f}\t{time.time():.6f}\t{overrun_s - entered[1]:.6f}\n")


def read_traces(directory: str | Path) -> list[TracedRequest]:
    """Every finished request of every engine that wrote under `directory`."""
    rows = []
    for path in sorted(Path(directory).glob("*.tsv")):
        for line in path.read_text().splitlines():
            rid, t_in, t_out, overrun = line.split("\t")
            rows.append(TracedRequest(rid, float(t_in), float(t_out), float(overrun)))
    return rows
