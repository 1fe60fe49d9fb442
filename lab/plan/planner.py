"""The scale planner: searches layouts (TP width, aggregated vs prefill/decode split, routing policy; for Server
and Interactive also the engine's prompt tokens a step, PlanRequest.prefill_caps) for a hardware profile and a
scenario on the step model's virtual clock (no sleeping), and ranks them by the highest whole-system QPS (offline:
samples/s) that meets the scenario's latency bound. scripts/plan_layout.py writes the best one as a system YAML
(lab/plan/layout_plan.py)."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from contract.stats import early_stopping_min_queries, poisson_arrivals
from contract.types import PromptInput
from lab.plan.latency import BOUND_MS, KEPT_UP_MIN, kept_up
from lab.plan.virtual import VirtualCluster, Workload
from workers.config import EngineConfig
from workers.sim.config import SimulationConfig
from workers.sim.engine import build_step_model
from workers.sim.step_model import PRODUCT_PATH_FIT, StepCorrection, StepModel

SPLITS = {"aggregated": None, "pd-1:3": (1, 3), "pd-1:1": (1, 1)}  # layout -> (prefill, decode) engines of a group
HORIZON_S = {"server": 60.0, "interactive": 12.0}  # arrivals span five to eight times the bound: a steady state
RUN_S = 600.0  # the rules' minimum duration of a latency run: the queries LoadGen's early stopping judges
MAX_REQUESTS = 6000


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for: the hardware and how many GPUs, the scenario, the model and its precisions, the
    layouts to try and the workload: one request shape (prompt tokens, of them visual, and output tokens), or
    `prompts`, a catalogue's mix the arrivals take in turn. step_correction: the step model's fit on measured
    product-path steps (lab/plan/step_fit.py's JSON; None: the micro-benchmark calibration alone)."""

    hardware: str = "h200"
    gpus: int = 8
    scenario: str = "server"
    model: str = "qwen3-vl-235b-a22b"
    weights: str = "bf16"
    kv_dtype: str = "bf16"
    policies: tuple[str, ...] = ("round_robin", "least_loaded")
    tp: tuple[int, ...] = (1, 2, 4, 8)
    layouts: tuple[str, ...] = tuple(SPLITS)
    prompt_tokens: int = 1734
    image_tokens: int = 1024
    output_tokens: int = 45
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 8192
    requests: int = 400  # simulated requests per point
    prompts: tuple[PromptInput, ...] = ()
    step_correction: Path | None = PRODUCT_PATH_FIT
    prepare_s_per_visual_token: float = 0.0  # each request's host preparation before it joins an engine
    # engine.max_num_prefill_tokens to try for a latency scenario (None: a step's whole max_num_batched_tokens).
    # A cap keeps the steps beside the running decodes short: at 0.75x Offline it turned Server INVALID (p99 12.8 s)
    # into VALID (10.3 s) on one H100 (benchmarks/README.md, twenty-ninth pass). Offline tries None alone.
    prefill_caps: tuple[int | None, ...] = (None,)


@dataclass
class Plan:
    """One layout's predicted capacity."""

    tp: int
    layout: str
    policy: str
    instances: int
    groups: int
    qps: float             # whole system: highest QPS meeting the bound (offline: samples/s)
    p99_s: float
    group_qps: float
    max_num_prefill_tokens: int | None = None  # the engine's prompt tokens a step (None: max_num_batched_tokens)

    def row(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def _cluster(engine: EngineConfig, sim: SimulationConfig, model: StepModel, layout: str, policy: str,
             group: int) -> VirtualCluster:
    split = SPLITS[layout]
    counts = {"aggregated": group} if split is None else {"prefill": split[0], "decode": split[1]}
    return VirtualCluster(engine, sim, {role: model for role in counts}, counts, policy)


def _meets(engine, sim, model, layout, policy, group, scenario, workload, requests, qps) -> tuple[bool, float]:
    """Poisson arrivals at `qps` over the scenario's horizon: (p99 within the bound, completions kept pace with
    arrivals after warm-up (sim_sweep's kept_up), the backlog drained within the bound, and LoadGen's early stopping
    met by a run of RUN_S at this rate with the simulated share of queries over the bound; p99). The last matters
    for a heavy-tailed mix: a few requests over the bound (a catalogue's largest images) pass a p99 over the
    horizon yet fail early stopping at a low rate's query count."""
    count = min(max(requests, int(qps * HORIZON_S[scenario]), len(workload.prompts)), MAX_REQUESTS)  # a mix: all of it
    arrivals = poisson_arrivals(qps, count)
    bound_s = BOUND_MS[scenario] / 1e3
    result = _cluster(engine, sim, model, layout, policy, group).run(arrivals, workload, latency_bound_s=bound_s)
    p99 = result.percentile(0.99)
    drained = result.makespan_s <= arrivals[-1] - arrivals[0] + bound_s
    steady = kept_up(sorted(zip(result.issued_s, result.latencies_s))) >= KEPT_UP_MIN
    return p99 <= bound_s and drained and steady and _early_stopping(result.latencies_s, bound_s, qps), p99


def _early_stopping(latencies: list[float], bound_s: float, qps: float) -> bool:
    """LoadGen's early stopping on a run of RUN_S at `qps` whose queries exceed the bound as often as these did."""
    if not latencies:
        return False
    queries = max(1, round(qps * RUN_S))
    over = round(queries * sum(1 for latency in latencies if latency > bound_s) / len(latencies))
    return queries >= early_stopping_min_queries(over)


def group_capacity(engine, sim, model, layout, policy, group, scenario, workload, requests) -> tuple[float, float]:
    """(highest QPS of one group meeting the scenario, its p99 s); offline: (samples/s, makespan)."""
    saturated = _cluster(engine, sim, model, layout, policy, group).run([0.0] * requests, workload)
    if scenario == "offline":
        return saturated.throughput, saturated.makespan_s
    lo, hi, best_p99 = 0.0, saturated.throughput, float("inf")
    args = (engine, sim, model, layout, policy, group, scenario, workload, requests)
    for _ in range(3):  # a burst at t=0 may understate capacity: raise the ceiling until the bound breaks
        ok, p99 = _meets(*args, hi)
        if not ok:
            break
        lo, best_p99, hi = hi, p99, hi * 1.5
    for _ in range(5):
        mid = (lo + hi) / 2
        ok, p99 = _meets(*args, mid)
        if ok:
            lo, best_p99 = mid, p99
        else:
            hi = mid
    return lo, best_p99


def check_prefill_caps(caps: tuple[int | None, ...], max_num_batched_tokens: int) -> None:
    """ValueError unless each cap is None or between 1 and a step's max_num_batched_tokens."""
    if any(cap is not None and not 0 < cap <= max_num_batched_tokens for cap in caps):
        raise ValueError(f"prefill caps {caps}: each between 1 and max_num_batched_tokens ({max_num_batched_tokens}), "
                         "or None")


def search(request: PlanRequest) -> list[Plan]:
    """Every layout of `request` that fits, best first; each one's row goes to stderr as it is found."""
    sim = SimulationConfig(model=request.model, weights=request.weights, kv_dtype=request.kv_dtype,
                           output_tokens=request.output_tokens)
    caps = (None,) if request.scenario == "offline" else tuple(dict.fromkeys(request.prefill_caps))
    check_prefill_caps(caps, request.max_num_batched_tokens)
    engines = {cap: EngineConfig(checkpoint=Path("simulated"), max_num_seqs=request.max_num_seqs,
                                 max_num_batched_tokens=request.max_num_batched_tokens, max_num_prefill_tokens=cap,
                                 max_model_len=32768) for cap in caps}
    workload = Workload(prompt_tokens=request.prompt_tokens, image_tokens=request.image_tokens,
                        max_tokens=request.output_tokens, prompts=request.prompts,
                        prepare_s_per_visual_token=request.prepare_s_per_visual_token)
    correction = StepCorrection.load(request.step_correction) if request.step_correction else StepCorrection()
    plans = []
    for tp in request.tp:
        if request.gpus % tp:
            continue
        model = build_step_model(request.hardware, sim, tp, vision_split=engines[caps[0]].vision_tensor_parallel)
        model = dataclasses.replace(model, correction=correction)
        if model.kv_capacity_tokens() < 4 * (request.prompt_tokens + 150):
            continue  # the weights do not fit with room for a few sequences
        instances = request.gpus // tp
        for layout in request.layouts:
            split = SPLITS[layout]
            group = min(4, instances) if split is None else sum(split)
            if instances < group:
                continue
            for policy in request.policies:
                for cap, capped in engines.items():
                    qps, p99 = group_capacity(capped, sim, model, layout, policy, group, request.scenario, workload,
                                              request.requests)
                    groups = instances // group
                    plans.append(Plan(tp, layout, policy, groups * group, groups, qps * groups, p99, qps, cap))
                    print(json.dumps(plans[-1].row()), file=sys.stderr, flush=True)
    return sorted(plans, key=lambda p: -p.qps)
