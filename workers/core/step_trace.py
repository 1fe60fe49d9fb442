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
from collections.abc import Iterable, Iterator
from typing import IO

from workers.core.scheduler import SchedulerOutput
from workers.core.sequence import Sequence
from workers.core.step_work import StepPhases, StepWork, median_phases_ms


class StepTrace:
    """Appends steps to DIR/steps-<pid>.jsonl, flushed every `flush_every` steps and on close; and, as each request
    finishes, one line for it ({"request": id, ...}: when it was submitted for preparation, prepared, admitted, first
    scheduled, got its first token and finished, in seconds on the trace's clock), so that a request's latency can be
    placed: preparation, waiting, tower passes, prefill, decodes."""

    def __init__(self, directory: str | Path, flush_every: int = 8):
        self.path = Path(directory) / f"steps-{os.getpid()}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")
        self._flush_every = flush_every
        self._unflushed = 0
        self._t0 = time.monotonic()
        self._sizes: set[int] = set()  # image sizes (patches) encoded so far: a new one builds a cuDNN plan
        self._requests: dict[str, dict] = {}  # admitted and not yet finished: their times so far

    def record(self, started: float, ended: float, work: StepWork, waiting: int, running: int,
               phases: StepPhases | None = None) -> None:
        """A step that ran from `started` to `ended` (time.monotonic seconds), with the queue lengths after it and
        where its time went (phases: "phases_ms", whose update also holds building the outputs, after `ended`);
        work.vision_plans is set here from the sizes this trace has seen."""
        if self._file is None:
            return
        work.vision_plans = len(set(work.vision_patches) - self._sizes)
        self._sizes.update(work.vision_patches)
        line = {"t_s": round(started - self._t0, 6), "ms": round((ended - started) * 1e3, 3),
                "waiting": waiting, "running": running, **dataclasses.asdict(work)}
        if phases is not None:
            line["phases_ms"] = phases.ms()
        self._write(line)
        self._unflushed += 1
        if self._unflushed >= self._flush_every:
            self.flush()

    def _t(self, t: float | None) -> float | None:
        return None if t is None else round(t - self._t0, 6)

    def admitted(self, seq: Sequence, submitted: float | None, prepare_started: float, prepare_ended: float,
                 now: float) -> None:
        """A request entered the scheduler at `now`, after its preparation (workers/engine_api.PreparedRequest's
        times: submitted None when not known)."""
        self._requests[seq.request_id] = {
            "submitted_s": self._t(submitted), "prepare_started_s": self._t(prepare_started),
            "prepared_s": self._t(prepare_ended), "admitted_s": self._t(now),
            "prompt_tokens": seq.num_prompt_tokens, "visual_tokens": sum(image.num_tokens for image in seq.images),
            "first_scheduled_s": None, "first_token_s": None,
        }

    def progress(self, out: SchedulerOutput, changed: Iterable[Sequence], started: float, ended: float) -> None:
        """After a step that ran from `started` to `ended`: first chunks, first tokens, finished requests."""
        for chunk in out.chunks:
            times = self._requests.get(chunk.seq.request_id)
            if times is not None and times["first_scheduled_s"] is None:
                times["first_scheduled_s"] = self._t(started)
        for seq in changed:
            times = self._requests.get(seq.request_id)
            if times is None:
                continue
            if times["first_token_s"] is None and seq.num_generated_tokens > 0:
                times["first_token_s"] = self._t(ended)
            if seq.is_finished:
                del self._requests[seq.request_id]
                self._write({"request": seq.request_id, **times, "finished_s": self._t(ended),
                             "generated_tokens": seq.num_generated_tokens,
                             "finish_reason": seq.finish_reason.value if seq.finish_reason else None})

    def aborted(self, seq: Sequence, now: float) -> None:
        """A request aborted outside a step (its caller left): its line, finish_reason "abort"."""
        times = self._requests.pop(seq.request_id, None)
        if times is not None:
            self._write({"request": seq.request_id, **times, "finished_s": self._t(now),
                         "generated_tokens": seq.num_generated_tokens, "finish_reason": "abort"})

    def _write(self, line: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
            self._unflushed = 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _lines(path: str | Path) -> Iterator[tuple[Path, int, dict]]:
    """(file, line number, parsed line) of a trace file (.jsonl, or .jsonl.gz as benchmarks/ keeps them) or of every
    steps-*.jsonl of a directory; a line that is not JSON raises naming its file and line."""
    path = Path(path)
    files = sorted(path.glob("steps-*.jsonl")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no steps-*.jsonl in {path}")
    for file in files:
        data = gzip.decompress(file.read_bytes()) if file.suffix == ".gz" else file.read_bytes()
        for n, text in enumerate(data.decode("utf-8").splitlines(), 1):
            if text.strip():
                try:
                    yield file, n, json.loads(text)
                except ValueError as err:
                    raise ValueError(f"{file}:{n}: not a step-trace line ({err})") from err


def read_steps(path: str | Path) -> list[tuple[StepWork, float]]:
    """(work, measured ms) of every step in a trace (_lines); a malformed step line raises naming its file and line."""
    fields = {f.name for f in dataclasses.fields(StepWork)}
    steps = []
    for file, n, line in _lines(path):
        if "request" in line:  # a finished request's line (read_requests)
            continue
        try:
            steps.append((StepWork(**{k: v for k, v in line.items() if k in fields}), float(line["ms"])))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{file}:{n}: not a step-trace line ({err!r})") from err
    return steps


def read_requests(path: str | Path) -> list[dict]:
    """The finished (and aborted) requests' lines of a trace, in the order they finished."""
    return [line for _, _, line in _lines(path) if "request" in line]


PHASES = (  # (name, from, to): a finished request's time split at its trace points
    ("prepare_wait_s", "submitted_s", "prepare_started_s"),
    ("prepare_s", "prepare_started_s", "prepared_s"),
    ("to_engine_s", "prepared_s", "admitted_s"),
    ("queued_s", "admitted_s", "first_scheduled_s"),
    ("to_first_token_s", "first_scheduled_s", "first_token_s"),
    ("decode_s", "first_token_s", "finished_s"),
)


def request_phases(lines: list[dict]) -> dict:
    """Where finished requests' time went: for each phase (PHASES), its p50 / p90 / p99 over the requests that have
    both ends (a request driven without a serving engine has no submitted_s), and the same for the slowest 1% by
    total time from submission (or preparation) to finish. Aborted requests are counted, not timed."""
    from workers.stats import percentile

    if not lines:
        raise ValueError("no request lines in the trace (traces written before request lines existed have none)")
    done = [line for line in lines if line.get("finish_reason") != "abort" and line.get("finished_s") is not None]
    start = lambda line: line["submitted_s"] if line.get("submitted_s") is not None else line["prepare_started_s"]  # noqa: E731
    total = sorted(done, key=lambda line: line["finished_s"] - start(line))
    tail = total[int(0.99 * len(total)):] if total else []

    def summary(group: list[dict]) -> dict:
        out = {}
        for name, a, b in PHASES:
            values = [line[b] - line[a] for line in group if line.get(a) is not None and line.get(b) is not None]
            if values:
                out[name] = {q: round(percentile(values, v), 4) for q, v in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}
        return out

    return {"requests": len(done), "aborted": len(lines) - len(done), "phases": summary(done),
            "slowest_1pct": {"requests": len(tail), "phases": summary(tail),
                             "visual_tokens_median": percentile([line["visual_tokens"] for line in tail], 0.5, None)}}


def read_step_lines(path: str | Path) -> list[dict]:
    """The steps' lines of a trace, as written (read_steps keeps only their work and time)."""
    return [line for _, _, line in _lines(path) if "request" not in line]


def step_kind(line: dict) -> str:
    """"decode" (single-row chunks alone), "prompt" (prompt rows, with or without decodes and tower work) or
    "tower" (tower blocks alone)."""
    if line.get("prefill_tokens", 0) > 0:
        return "prompt"
    if line.get("num_seqs", 0) > 0:
        return "decode" if not line.get("vision_patches") else "prompt"
    return "tower"


def step_phases(lines: list[dict]) -> dict:
    """Where the steps' wall time went, by kind of step (step_kind): the steps, their seconds, the host's share of
    them (the time the device may have idled), and each phase's median in ms (the lines' phases_ms, which traces
    written before the phases existed lack)."""
    timed = [line for line in lines if "phases_ms" in line]
    if not timed:
        raise ValueError("no step line carries phases_ms (traces written before the step phases existed have none)")
    out = {}
    for kind in ("decode", "prompt", "tower"):
        group = [line for line in timed if step_kind(line) == kind]
        if not group:
            continue
        seconds = sum(line["ms"] for line in group) / 1e3
        host = sum(line["phases_ms"]["host"] for line in group) / 1e3
        out[kind] = {
            "steps": len(group), "seconds": round(seconds, 3), "host_share": round(host / seconds, 3) if seconds else None,
            "phases_ms_median": median_phases_ms([line["phases_ms"] for line in group]),
        }
    return {"steps": len(timed), "untimed_steps": len(lines) - len(timed), "by_kind": out}
