"""A step trace: one JSON line per engine step with what the step computed (StepWork) and how long it took on the
wall clock, from scheduling to the scheduler's update (the sampled tokens are on the host by then, so the step's GPU
work is inside; images encoded ahead, launched after sampling, run into the next step's time). Written by the
real engine when EngineConfig.step_trace_dir is set, one file per engine process, so a product-path run
(LoadGen -> router -> Ray worker -> engine) yields the steps that lab/plan/step_fit.py fits the step model on."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
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
    scheduled, got its first token and finished, in seconds on the trace's clock; `tower_s`, [start, end] of each of
    its images' tower passes; `prefill_s`, [start, end, tokens] of each step that ran a chunk of its prompt;
    `t0_unix_s`, the trace clock's zero in Unix time, to place the request beside other processes' logs; and, for a
    request with an image larger than a step's encoder budget, `tower_decision`, the scheduler's first decision on
    its pass: Sequence.tower_decision), so that a request's latency can be placed: preparation, waiting, tower
    passes, prefill, decodes (request_timeline), and a large image's estimate checked against what it took.

    A pass run with its step's chunks (encode_now) spans that step; one encoded ahead, after the step's sampling,
    runs into the next step, so it spans from this step's end to the next one's."""

    def __init__(self, directory: str | Path, flush_every: int = 8):
        self.path = Path(directory) / f"steps-{os.getpid()}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")
        self._flush_every = flush_every
        self._unflushed = 0
        self._t0 = time.monotonic()
        self._t0_unix = round(time.time() - (time.monotonic() - self._t0), 6)
        self._sizes: set[int] = set()  # image sizes (patches) encoded so far: a new one builds a cuDNN plan
        self._requests: dict[str, dict] = {}  # admitted and not yet finished: their times so far
        self._passes: dict[tuple[str, int], list] = {}  # (request, image) -> its tower pass's [start, end]
        self._ahead: list[list] = []  # passes encoded after the last step's sampling: they end with the next step

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
            "first_scheduled_s": None, "first_token_s": None, "tower_s": [], "prefill_s": [],
            "t0_unix_s": self._t0_unix,
        }

    def progress(self, out: SchedulerOutput, changed: Iterable[Sequence], started: float, ended: float) -> None:
        """After a step that ran from `started` to `ended`: tower passes, prompt chunks, first tokens, finished
        requests."""
        for span in self._ahead:  # encoded after the previous step's sampling: they ran into this step
            span[1] = self._t(ended)
        self._ahead = []
        for encode in out.encode_now:
            self._tower(encode, self._t(started), self._t(ended))
        for encode in out.encode_ahead:
            span = self._tower(encode, self._t(ended), None)
            if span is not None:
                self._ahead.append(span)
        for chunk in out.chunks:
            times = self._requests.get(chunk.seq.request_id)
            if times is None:
                continue
            if times["first_scheduled_s"] is None:
                times["first_scheduled_s"] = self._t(started)
            if chunk.start < chunk.seq.num_prompt_tokens:
                times["prefill_s"].append([self._t(started), self._t(ended), chunk.num_tokens])
        for seq in changed:
            times = self._requests.get(seq.request_id)
            if times is None:
                continue
            if times["first_token_s"] is None and seq.num_generated_tokens > 0:
                times["first_token_s"] = self._t(ended)
            if seq.is_finished:
                del self._requests[seq.request_id]
                self._forget_passes(seq.request_id)
                self._write({"request": seq.request_id, **times, "finished_s": self._t(ended),
                             "generated_tokens": seq.num_generated_tokens,
                             "finish_reason": seq.finish_reason.value if seq.finish_reason else None,
                             **({"tower_decision": seq.tower_decision} if seq.tower_decision else {})})

    def _tower(self, encode, start: float, end: float | None) -> list | None:
        """The [start, end] span of the request's pass over this image: opened by its first blocks, extended by each
        later step that runs more of them."""
        times = self._requests.get(encode.seq.request_id)
        if times is None:
            return None
        span = self._passes.get(encode.key)
        if span is None or encode.first_block == 0:  # a new pass (or one started again after a failed step)
            span = [start, end]
            self._passes[encode.key] = span
            times["tower_s"].append(span)
        else:
            span[1] = end
        return span

    def _forget_passes(self, request_id: str) -> None:
        self._passes = {key: span for key, span in self._passes.items() if key[0] != request_id}

    def aborted(self, seq: Sequence, now: float) -> None:
        """A request aborted outside a step (its caller left): its line, finish_reason "abort"."""
        times = self._requests.pop(seq.request_id, None)
        self._forget_passes(seq.request_id)
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


def request_start(line: dict) -> float | None:
    """When a request line's time starts: its submission for preparation, or, for a request driven without a
    serving engine (no submitted_s), its preparation."""
    return line.get("submitted_s") if line.get("submitted_s") is not None else line.get("prepare_started_s")


def request_phases(lines: list[dict]) -> dict:
    """Where finished requests' time went: for each phase (PHASES), its p50 / p90 / p99 over the requests that have
    both ends (a request driven without a serving engine has no submitted_s), and the same for the slowest 1% by
    total time from submission (or preparation) to finish. Aborted requests are counted, not timed."""
    from contract.stats import percentile

    if not lines:
        raise ValueError("no request lines in the trace (traces written before request lines existed have none)")
    done = [line for line in lines if line.get("finish_reason") != "abort" and line.get("finished_s") is not None]
    total = sorted(done, key=lambda line: line["finished_s"] - request_start(line))
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


TIMELINE = ("preprocess_s", "queue_s", "tower_s", "prefill_s", "stalled_s", "decode_s")


def _covered(spans: list[tuple[float, float]]) -> float:
    """Seconds inside the union of [start, end] spans."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def request_timeline(line: dict) -> dict[str, float] | None:
    """A finished request's time from submission (or preparation) to its last token, split into TIMELINE's phases
    that add up to it: preprocess (waiting for a preparation thread, decoding and patching its images), queue (until
    the engine first ran its tower pass or a chunk of its prompt), tower (its passes, outside the steps that ran its
    prompt chunks), prefill (the steps that ran its prompt chunks, their own tower work included), stalled (the rest
    until its first token: steps that ran other requests' work while its prompt waited) and decode. None for a line
    without the times (aborted, or written before tower and prefill spans existed)."""
    start = request_start(line)
    needed = (start, line.get("prepared_s"), line.get("first_token_s"), line.get("finished_s"))
    if any(t is None for t in needed) or "prefill_s" not in line or line.get("finish_reason") == "abort":
        return None
    prepared, first_token, finished = needed[1:]
    towers = [(a, b if b is not None else first_token) for a, b in line["tower_s"]]
    chunks = [(a, b) for a, b, _ in line["prefill_s"]]
    engine_start = min([a for a, _ in towers + chunks] or [first_token])
    prefill = _covered(chunks)
    tower = _covered(towers + chunks) - prefill
    phases = {"preprocess_s": prepared - start, "queue_s": max(engine_start - prepared, 0.0), "tower_s": tower,
              "prefill_s": prefill, "stalled_s": max(first_token - max(engine_start, prepared) - tower - prefill, 0.0),
              "decode_s": finished - first_token}
    return {name: round(seconds, 6) for name, seconds in phases.items()}


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
