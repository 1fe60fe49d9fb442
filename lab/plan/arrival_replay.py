"""A measured run's own arrivals replayed on the step model: each request of a step trace (EngineConfig.step_trace_dir)
joins the simulated engine when the measured one had prepared it, with the prompt of the same catalogue sample and
the deadline its latency bound gave, so a scheduler change is weighed on the very bursts that went over the bound,
not only on fresh Poisson seeds (planner_validation.server_latencies).

What it prints (scripts/plan_layout.py --replay-arrivals TRACE): the queries over the bound, measured and replayed,
how many of them are the largest image's (on one GPU a 4,000 px query cannot meet Interactive's 1.5 s whatever the
schedule), and each over-bound query's two latencies.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from contract.stats import percentile
from lab.bench.catalogue_workload import CatalogueRequest
from lab.plan.planner_validation import image_sizes_of, replay_requests
from workers.config import EngineConfig
from workers.core.step_trace import read_requests, request_start
from workers.sim.step_model import StepModel

_SAMPLE = re.compile(r"-s(\d+)")  # harness/sut.py's request ids: q<query>-s<sample>[-r<attempt>]


@dataclass(frozen=True)
class Arrival:
    """One measured request: its catalogue sample, when it was submitted and prepared (the trace's clock), its
    prompt, visual and generated tokens, and its measured latency in the engine (submission to last token)."""

    request: str
    sample: int
    submitted_s: float
    prepared_s: float
    prompt_tokens: int
    visual_tokens: int
    generated_tokens: int
    latency_s: float


def trace_arrivals(lines: list[dict]) -> list[Arrival]:
    """The finished LoadGen requests of a trace's request lines (warm-up and aborted ones left out), in submission
    order. Raises ValueError naming the first line without a sample in its id or without its times."""
    arrivals = []
    for line in lines:
        rid = line["request"]
        if rid.startswith("warmup") or line.get("finish_reason") == "abort":
            continue
        match = _SAMPLE.search(rid)
        start = request_start(line)
        if match is None or start is None or line.get("finished_s") is None or line.get("prepared_s") is None:
            raise ValueError(f"request {rid!r}: no catalogue sample in its id, or no submission, preparation or "
                             "finish time in its line")
        arrivals.append(Arrival(rid, int(match.group(1)), start, line["prepared_s"], line["prompt_tokens"],
                                line.get("visual_tokens", 0), line["generated_tokens"], line["finished_s"] - start))
    if not arrivals:
        raise ValueError("no finished LoadGen requests in the trace")
    return sorted(arrivals, key=lambda a: a.submitted_s)


def replay_arrivals(model: StepModel, arrivals: list[Arrival], catalogue: list[CatalogueRequest],
                    engine_config: EngineConfig, bound_s: float) -> dict:
    """The arrivals replayed on `model` with `engine_config`, each with its sample's prompt from `catalogue` (the
    run's own) and the tokens it generated, against what was measured. Raises ValueError where a sample is not in
    the catalogue or its prompt's length differs from the measured one's."""
    chosen = []
    for a in arrivals:
        if a.sample >= len(catalogue):
            raise ValueError(f"request {a.request!r}: sample {a.sample} is not in the {len(catalogue)}-sample "
                             "catalogue")
        request = catalogue[a.sample]
        if len(request.prompt.token_ids) != a.prompt_tokens:
            raise ValueError(f"request {a.request!r}: sample {a.sample}'s prompt has {len(request.prompt.token_ids)} "
                             f"tokens here, {a.prompt_tokens} in the trace (another catalogue or prompt variant?)")
        chosen.append(CatalogueRequest(request.prompt, a.generated_tokens))
    t0 = arrivals[0].submitted_s
    submitted = [a.submitted_s - t0 for a in arrivals]
    finish = replay_requests(model, chosen, [a.prepared_s - t0 for a in arrivals], image_sizes_of(chosen[:1]),
                             engine_config, [s + bound_s for s in submitted])
    replayed = [f - s for f, s in zip(finish, submitted)]
    largest = max(a.visual_tokens for a in arrivals)
    measured = [a.latency_s for a in arrivals]

    def summary(latencies: list[float]) -> dict:
        over = [i for i, x in enumerate(latencies) if x > bound_s]
        return {"over": len(over), "over_largest_image": sum(arrivals[i].visual_tokens == largest for i in over),
                "p50_s": round(percentile(latencies, 0.5), 3), "p99_s": round(percentile(latencies, 0.99), 3)}

    return {"requests": len(arrivals), "bound_s": bound_s, "largest_image_visual_tokens": largest,
            "measured": summary(measured), "replayed": summary(replayed),
            "over_bound": [{"request": arrivals[i].request, "submitted_s": round(submitted[i], 3),
                            "visual_tokens": arrivals[i].visual_tokens, "measured_s": round(measured[i], 3),
                            "replayed_s": round(replayed[i], 3)}
                           for i in range(len(arrivals)) if max(measured[i], replayed[i]) > bound_s]}


def read_arrivals(path: str | Path) -> list[Arrival]:
    """trace_arrivals of a step trace file or directory."""
    return trace_arrivals(read_requests(path))
