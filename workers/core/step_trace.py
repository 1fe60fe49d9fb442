"""A step trace: one JSON line per engine step with what the step computed (StepWork) and how long it took on the
wall clock, from scheduling to the scheduler's update (the sampled tokens are on the host by then, so the step's GPU
work is inside; images encoded ahead, launched after sampling, run into the next step's time). Written by the
real engine when EngineConfig.step_trace_dir is set, one file per engine process, so a product-path run
(LoadGen -> router -> Ray worker -> engine) yields the steps that workers/sim/step_fit.py fits the step model on."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import time
from pathlib import Path
from typing import IO

from workers.core.step_work import StepWork


class StepTrace:
    """Appends steps to DIR/steps-<pid>.jsonl, flushed every `flush_every` steps and on close."""

    def __init__(self, directory: str | Path, flush_every: int = 8):
        self.path = Path(directory) / f"steps-{os.getpid()}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")
        self._flush_every = flush_every
        self._unflushed = 0
        self._t0 = time.monotonic()
        self._sizes: set[int] = set()  # image sizes (patches) encoded so far: a new one builds a cuDNN plan

    def record(self, started: float, ended: float, work: StepWork, waiting: int, running: int) -> None:
        """A step that ran from `started` to `ended` (time.monotonic seconds), with the queue lengths after it;
        work.vision_plans is set here from the sizes this trace has seen."""
        if self._file is None:
            return
        work.vision_plans = len(set(work.vision_patches) - self._sizes)
        self._sizes.update(work.vision_patches)
        line = {"t_s": round(started - self._t0, 6), "ms": round((ended - started) * 1e3, 3),
                "waiting": waiting, "running": running, **dataclasses.asdict(work)}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._unflushed += 1
        if self._unflushed >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._unflushed = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_steps(path: str | Path) -> list[tuple[StepWork, float]]:
    """(work, measured ms) of every step in a trace file (.jsonl, or .jsonl.gz as benchmarks/ keeps them) or in every
    steps-*.jsonl of a directory; a malformed line raises naming its file and line."""
    path = Path(path)
    files = sorted(path.glob("steps-*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no steps-*.jsonl in {path}")
    fields = {f.name for f in dataclasses.fields(StepWork)}
    steps = []
    for file in files:
        data = gzip.decompress(file.read_bytes()) if file.suffix == ".gz" else file.read_bytes()
        for n, text in enumerate(data.decode("utf-8").splitlines(), 1):
            if not text.strip():
                continue
            try:
                line = json.loads(text)
                steps.append((StepWork(**{k: v for k, v in line.items() if k in fields}), float(line["ms"])))
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"{file}:{n}: not a step-trace line ({err})") from err
    return steps
