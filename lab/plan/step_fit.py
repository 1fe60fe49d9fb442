"""Fits the step model on an engine's own steps (issue 19, item 4): a step trace of the product path
(EngineConfig.step_trace_dir, workers/core/step_trace.py) gives each step's work and measured wall time; the fit
finds the StepCorrection (text_scale, vision_scale, step_overhead_ms) that minimises the squared error of
  measured_ms ~ text_scale * text_ms + vision_scale * vision_ms + step_overhead_ms
over the steps, text_ms and vision_ms being the uncorrected model's parts (StepModel.step_parts_ms). The fit runs on
windows of consecutive steps (sums of both sides), because a step's measured time holds some of its predecessor's
GPU work: images encoded ahead are launched after sampling and finish inside the next step's sync, and a step of
tower blocks alone returns before its kernels end (0.5 ms measured where the model charges ~50). A coefficient
that comes out negative is held at its floor (0 for the overhead, and the term dropped for a scale) and the rest
refitted. Plain least squares on three unknowns: normal equations, solved here without numpy.

The report also sets the fitted model against the steps by kind (step_kind: decode steps by their sequences, prompt
chunks, tower work by its largest frame), summed over each kind's steps: where one kind sits off the fit, the engine
does something the model does not price (benchmarks/README.md, thirty-seventh pass: decode steps of 3, 5, 6 and 7
sequences 12-28% over it, replaying padded CUDA graphs). Single steps carry the neighbour's time noted above, so a
kind of few steps, or of steps beside tower work, reads less than a kind of many."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from contract.stats import percentile
from workers.core.step_work import StepWork
from workers.sim.step_model import StepCorrection, StepModel

TERMS = ("text_scale", "vision_scale", "step_overhead_ms")


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a x = b by Gaussian elimination with partial pivoting; None when a is singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def _least_squares(rows: list[tuple[float, ...]], ys: list[float], free: Sequence[int]) -> dict[int, float]:
    a = [[sum(r[i] * r[j] for r in rows) for j in free] for i in free]
    b = [sum(r[i] * y for r, y in zip(rows, ys)) for i in free]
    x = _solve(a, b)
    if x is None:
        raise ValueError("step fit: the steps do not determine the terms "
                         f"{[TERMS[i] for i in free]} (e.g. no step encoded an image)")
    return dict(zip(free, x))


WINDOW = 8  # consecutive steps per fitted sum


def fit_steps(model: StepModel, steps: Sequence[tuple[StepWork, float]], source: str = "trace",
              window: int = WINDOW) -> dict:
    """The StepCorrection fitted on (work, measured ms) steps, in trace order, for `model` (its own correction
    ignored), on sums over `window` consecutive steps; with how well the model predicts those windows before and
    after (median and p90 relative error) and the total predicted against measured busy time."""
    if window < 1:
        raise ValueError(f"step fit: window {window} < 1")
    base = dataclasses.replace(model, correction=StepCorrection())
    steps = [(w, ms) for w, ms in steps if w.num_seqs or w.vision_patches]
    if len(steps) < 3 * window:
        raise ValueError(f"step fit: {len(steps)} non-empty steps, need at least {3 * window} ({window} a window)")
    windows = [steps[i:i + window] for i in range(0, len(steps) - window + 1, window)]
    rows, ys = [], []
    for group in windows:
        parts = [base.step_parts_ms(w) for w, _ in group]
        rows.append((sum(t for t, _ in parts), sum(v for _, v in parts), float(len(group))))
        ys.append(sum(ms for _, ms in group))
    free = [i for i in range(3) if any(r[i] for r in rows)]
    while True:
        x = _least_squares(rows, ys, free)
        negative = [i for i in free if x[i] < 0]
        if not negative:
            break
        free.remove(min(negative, key=lambda i: x[i]))
        if not free:
            raise ValueError("step fit: no non-negative fit")
    coef = [x.get(i, 0.0) for i in range(3)]
    correction = StepCorrection(*coef, source=source)
    fitted = dataclasses.replace(model, correction=correction)
    return {
        "source": source,
        "steps": len(steps),
        "window_steps": window,
        "correction": {name: round(value, 4) for name, value in zip(TERMS, coef)},
        "measured_busy_s": round(sum(ys) / 1e3, 3),
        "before": _errors(base, windows),
        "after": _errors(fitted, windows),
        "after_by_kind": by_kind(fitted, steps),
    }


# (largest frame's patches below this, kind) for steps with tower work
TOWER_KINDS = ((4096, "tower, frames under 4,096 patches"), (16384, "tower, 4,096-16,383 patches"),
               (40000, "tower, 16,384-39,999 patches"), (None, "tower, 40,000 patches and over"))


def step_kind(work: StepWork) -> str:
    """The kind of step `work` is, for by_kind: tower work by its largest frame, else prompt chunks, else decodes by
    their sequences (each count to 8 apart: the engine's smallest CUDA graphs)."""
    if work.vision_patches:
        largest = max(work.vision_patches)
        return next(name for bound, name in TOWER_KINDS if bound is None or largest < bound)
    if work.prefill_tokens:
        return "prompt chunks"
    n = work.num_seqs
    if n <= 8:
        return f"decode, {n} sequence{'s' if n > 1 else ''}"
    return "decode, 9-16" if n <= 16 else "decode, 17-64" if n <= 64 else "decode, 65 and over"


def by_kind(model: StepModel, steps: Sequence[tuple[StepWork, float]]) -> dict[str, dict]:
    """Per step_kind, in order of first appearance: its steps, their measured and modelled seconds and the ratio."""
    sums: dict[str, list[float]] = {}
    for work, ms in steps:
        total = sums.setdefault(step_kind(work), [0, 0.0, 0.0])
        total[0] += 1
        total[1] += ms
        total[2] += model.step_ms(work)
    return {kind: {"steps": int(n), "measured_s": round(measured / 1e3, 3), "model_s": round(modelled / 1e3, 3),
                   "measured_over_model": round(measured / modelled, 3) if modelled > 0 else None}
            for kind, (n, measured, modelled) in sums.items()}


def _errors(model: StepModel, windows: Sequence[Sequence[tuple[StepWork, float]]]) -> dict:
    predicted = [sum(model.step_ms(w) for w, _ in group) for group in windows]
    measured = [sum(ms for _, ms in group) for group in windows]
    rel = [abs(p - ms) / ms for p, ms in zip(predicted, measured) if ms > 0]
    return {"predicted_busy_s": round(sum(predicted) / 1e3, 3),
            "window_rel_error_p50": round(percentile(rel, 0.5), 3),
            "window_rel_error_p90": round(percentile(rel, 0.9), 3)}
