"""What the slowest queries of a performance run were: LoadGen's trace log (each sample's issue time and latency,
harness/plot.py reads it) joined with each sample's prompt (its image rows and its length in tokens).

The report answers "is the tail the requests' own size, or queueing behind others?": for the slowest 1% of queries
(the ones above LoadGen's p99), their own image and prompt sizes against the run's, and how many had a large image
(at or above the run's 99th percentile of image rows, and at least LARGE_OVER_MEDIAN times its median) in flight
when they were issued. With the engines' step traces (engine.step_trace_dir), `timeline_anatomy` adds where those
queries spent their time: outside the engine (LoadGen, the SUT, the router and the wire), then preparation, queue,
tower, prefill, stalled and decode as workers/core/step_trace.request_timeline splits a request.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from contract.stats import percentile
from contract.tokenizer import IMAGE_PAD_ID
from harness.plot import SampleLatency
from workers.core.step_trace import TIMELINE, read_requests, request_start, request_timeline

SLOWEST_LISTED = 10
OVER_BOUND_LISTED = 200  # every query over the latency bound, in issue order, up to this many
LARGE_OVER_MEDIAN = 4  # so that a run of like images has no "large" ones


@dataclass(frozen=True)
class SampleShape:
    """One sample's prompt as the engine sees it."""

    prompt_tokens: int  # with every image's <|image_pad|> rows
    image_tokens: int  # <|image_pad|> rows (the vision tower's output tokens)

    @classmethod
    def of(cls, token_ids: Sequence[int]) -> SampleShape:
        return cls(len(token_ids), sum(1 for t in token_ids if t == IMAGE_PAD_ID))


def sample_shapes(config, scenario: str, cache_dir: Path) -> dict[int, SampleShape]:
    """Every sample of the scenario's dataset, as the harness's prompt builder makes it (a sample whose prompt
    cannot be built is left out)."""
    from harness.assets import resolve_dataset
    from contract.dataset import load_catalogue
    from contract.prompt import PromptBuilder
    from harness.system_config import DATASET_FOR_SCENARIO, image_pixel_limits
    from contract.tokenizer import load_tokenizer

    config = config.for_scenario(scenario)
    dataset, kind = config.dataset(scenario), DATASET_FOR_SCENARIO[scenario]
    catalogue = load_catalogue(resolve_dataset(dataset, kind, cache_dir), kind)
    builder = PromptBuilder(load_tokenizer(), dataset.prompt_variant, *image_pixel_limits(config))
    shapes = {}
    for index, prompt in enumerate(builder.build_batch(list(catalogue))):
        if not isinstance(prompt, ValueError):
            shapes[index] = SampleShape.of(prompt.token_ids)
    return shapes


def tail_anatomy(samples: Sequence[SampleLatency], shapes: Mapping[int, SampleShape], fraction: float = 0.01,
                 bound_s: float | None = None) -> dict:
    """The slowest `fraction` of the run's queries (at least one), their sizes against the run's, and the large
    images in flight when each was issued; with the scenario's latency bound, every query over it (`over_bound`,
    in issue order: those early stopping counts, which may be more than the slowest 1%)."""
    if not samples:
        raise ValueError("no samples: the trace log holds no completed queries")
    tail = [samples[i] for i in slowest_positions(samples, fraction)]
    image_rows = [shapes[s.sample_index].image_tokens for s in samples if s.sample_index in shapes]
    big = max(percentile(image_rows, 0.99, empty=math.inf), LARGE_OVER_MEDIAN * (_median(image_rows) or 0))
    big_queries = [s for s in samples if s.sample_index in shapes and shapes[s.sample_index].image_tokens >= big]

    def in_flight_big(query: SampleLatency) -> int:
        """Other queries with a large image issued before this one and not yet answered when it was issued."""
        return sum(1 for b in big_queries
                   if b is not query and b.issued_s <= query.issued_s < b.completed_s)

    def describe(query: SampleLatency) -> dict:
        shape = shapes.get(query.sample_index)
        return {
            "sample_index": query.sample_index,
            "latency_s": round(query.latency_s, 3),
            "issued_s": round(query.issued_s, 3),
            "image_tokens": shape.image_tokens if shape else None,
            "prompt_tokens": shape.prompt_tokens if shape else None,
            "large_images_in_flight": in_flight_big(query),
        }

    known = [s for s in tail if s.sample_index in shapes]
    return {
        "queries": len(samples),
        "tail_queries": len(tail),
        "tail_from_latency_s": round(tail[0].latency_s, 3),
        "large_image_tokens": big,
        "image_tokens_median": {"all": _median(image_rows),
                                "tail": _median([shapes[s.sample_index].image_tokens for s in known])},
        "prompt_tokens_median": {"all": _median([shapes[s.sample_index].prompt_tokens for s in samples
                                                 if s.sample_index in shapes]),
                                 "tail": _median([shapes[s.sample_index].prompt_tokens for s in known])},
        "tail_with_own_large_image": sum(1 for s in known if shapes[s.sample_index].image_tokens >= big),
        "tail_with_large_image_in_flight": sum(1 for s in tail if in_flight_big(s)),
        "slowest": [describe(s) for s in reversed(tail[-SLOWEST_LISTED:])],
        **({"over_bound": [describe(samples[i]) for i in over_bound_positions(samples, bound_s)]}
           if bound_s is not None else {}),
    }


_QUERY_ID = re.compile(r"^(q\d+)-s(\d+)")  # the SUT's request ids: q<query>-s<sample>[-r<resend>][#<attempt>]


def engine_requests(trace_dir: Path, window_unix_s: tuple[float, float]) -> dict[int, list[dict]]:
    """The engines' finished request lines of the queries submitted within the window (Unix seconds), by sample
    index, in submission order; a query sent more than once (a resend, a migration) keeps its last line."""
    last: dict[str, tuple[float, int, dict]] = {}  # query -> (submitted, sample index, line)
    for line in read_requests(trace_dir):
        match = _QUERY_ID.match(str(line["request"]))
        start = request_start(line)
        if match is None or "t0_unix_s" not in line or start is None:
            continue
        submitted = line["t0_unix_s"] + start
        if not window_unix_s[0] <= submitted <= window_unix_s[1]:
            continue
        previous = last.get(match.group(1))
        if previous is None or _finished_unix(line) >= _finished_unix(previous[2]):
            last[match.group(1)] = (previous[0] if previous else submitted, int(match.group(2)), line)
    by_index: dict[int, list[dict]] = {}
    for _, index, line in sorted(last.values(), key=lambda entry: entry[0]):
        by_index.setdefault(index, []).append(line)
    return by_index


def slowest_positions(samples: Sequence[SampleLatency], fraction: float) -> list[int]:
    """Positions of the slowest `fraction` of the samples (at least one), fastest of them first."""
    ordered = sorted(range(len(samples)), key=lambda i: samples[i].latency_s)
    return ordered[-max(1, math.ceil(fraction * len(ordered))):]


def outside_engine_s(latency_s: float, phases: Mapping[str, float]) -> float:
    """What a query's latency measured outside the engine holds beyond the engine's timeline of it (the client, the
    router, the wire)."""
    return round(max(latency_s - sum(phases.values()), 0.0), 6)


def _finished_unix(line: dict) -> float:
    return line["t0_unix_s"] + (line.get("finished_s") or 0.0)  # lines of different engines: each its own clock


def timeline_anatomy(samples: Sequence[SampleLatency], requests: Mapping[int, list[dict]],
                     fraction: float = 0.01, bound_s: float | None = None) -> dict:
    """Where the slowest `fraction` of queries spent their time, and with the scenario's latency bound every query
    over it (`over_bound`, in issue order). LoadGen's samples and the engines' request lines are joined by sample
    index, in issue order (the clocks of different processes are not compared); the time LoadGen measured beyond
    the engine's is `outside_engine_s`; a query whose line holds the scheduler's decision on a large image's pass
    carries it (`tower_decision`: its estimated own work and slack, and whether it was past saving)."""
    queue: dict[int, list[dict]] = {index: list(lines) for index, lines in requests.items()}
    timelines: dict[int, dict] = {}
    for position, sample in sorted(enumerate(samples), key=lambda item: item[1].issued_s):
        lines = queue.get(sample.sample_index)
        if not lines:
            continue
        line = lines.pop(0)
        phases = request_timeline(line)
        if phases is not None:
            timelines[position] = {"outside_engine_s": outside_engine_s(sample.latency_s, phases), **phases,
                                   **({"tower_decision": line["tower_decision"]} if "tower_decision" in line else {})}
    tail = [i for i in slowest_positions(samples, fraction) if i in timelines]
    names = ("outside_engine_s", *TIMELINE)
    return {
        "matched_queries": len(timelines),
        "tail_queries_matched": len(tail),
        "tail_median_s": {name: round(statistics.median(timelines[i][name] for i in tail), 4) for name in names}
        if tail else None,
        "all_median_s": {name: round(statistics.median(t[name] for t in timelines.values()), 4) for name in names}
        if timelines else None,
        "slowest": [_timed(samples[i], timelines[i]) for i in reversed(tail[-SLOWEST_LISTED:])],
        **({"over_bound": [_timed(samples[i], timelines[i]) for i in over_bound_positions(samples, bound_s)
                           if i in timelines]} if bound_s is not None else {}),
    }


def _timed(sample: SampleLatency, timeline: dict) -> dict:
    return {"sample_index": sample.sample_index, "latency_s": round(sample.latency_s, 3),
            "issued_s": round(sample.issued_s, 3), **timeline}


def over_bound_positions(samples: Sequence[SampleLatency], bound_s: float) -> list[int]:
    """Positions of the queries over `bound_s`, in issue order, at most OVER_BOUND_LISTED."""
    over = sorted((i for i, s in enumerate(samples) if s.latency_s > bound_s), key=lambda i: samples[i].issued_s)
    return over[:OVER_BOUND_LISTED]


def _median(values: Sequence[int]) -> float | None:
    return statistics.median(values) if values else None
