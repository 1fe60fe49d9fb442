"""The step model beside every measured H200 run it can express (`scripts/plan_layout.py --validate`): the
runs, their bench files and calibrations are data (benchmarks/planner-validation-runs.json); this module replays
each on the virtual clock as its bench ran it and returns one JSON-ready object of measured and predicted figures.
It lives in the harness because the realistic catalogue's prompts come from the harness's prompt path."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from contract.stats import early_stopping_met, percentile, permuted_draws, poisson_arrivals
from contract.tokenizer import IMAGE_PAD_ID
from contract.types import SamplingParams
from lab.bench.catalogue_workload import OUTPUT_CAP, CatalogueRequest, fixed_catalogue, realistic_catalogue
from lab.plan.virtual import VirtualCluster, Workload, remaining_bound
from workers.config import EngineConfig
from workers.request_options import RequestOptions
from workers.sim.config import SimulationConfig
from workers.sim.engine import image_sizes, simulated
from workers.sim.step_model import Calibration, Precision, StepCorrection, StepModel

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
RUNS_FILE = BENCH / "planner-validation-runs.json"
POISSON_SEED = 1000  # bench_multi_gpu's qps_search: level i draws its arrivals with seed 1000 + i


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSettings(_Data):
    """The engine every replay runs: the model and its configured limits."""

    model: str
    output_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int


class OfflineRun(_Data):
    """A one-GPU catalogue run, calibrated on its own bench; `visual_fit`: the bench whose vision times the
    calibration fits (None: its own, False: micro-benchmarks only)."""

    run: str
    bench: str
    visual_fit: str | bool | None = None


class Dp2Run(_Data):
    """Two data-parallel instances (a bench_multi_gpu JSON's dp2), calibrated on another bench."""

    run: str
    bench: str
    calibration: str


class PoissonLevels(_Data):
    """bench_multi_gpu's --qps-requests and --qps-level-s of a run (they give its request counts per level)."""

    requests: int
    level_s: float


class Session1(_Data):
    code: str
    offline: list[OfflineRun]
    dp2: Dp2Run


class Session2(_Data):
    """Preprocessing before the engine's steps: one-GPU bench, the multi-GPU bench of the same code."""

    code: str
    run: str
    bench: str
    multi_gpu: str
    preprocess_threads: int  # bench_engine/bench_multi_gpu prepared a catalogue run on min(16, cores) threads
    poisson: PoissonLevels


class Session4(_Data):
    """Preparation overlapped with the steps (EngineConfig.preprocess_threads), the default calibration."""

    code: str
    run: str
    bench: str
    prepare_threads: int


class Run15(_Data):
    """run15 (2xH200, realistic catalogue): session 4 code but 16 preparation threads (run21 has 4)."""

    code: str
    run: str
    bench: str
    poisson: PoissonLevels


class ProductPath(_Data):
    """LoadGen Server points measured through the product path (scripts/find_peak.py JSONs: LoadGen -> router ->
    Ray worker -> engine on one H200), replayed on the virtual clock with their workload: issue 19's check that the
    planner's one-H200 prediction of the highest valid Server QPS comes within 15% of the measured one."""

    runs: list[str]
    catalogue_seed: int = 0  # the synthetic catalogue the product path made (harness.synthetic_catalogue's seed)
    note: str = ""
    # the same workload on FP8-dynamic weights with the FP8 KV cache (h200x1-synthetic-fp8-dynamic)
    fp8_runs: list[str] = []
    fp8_note: str = ""

    def runs_of(self, weights: str, kv_dtype: str) -> tuple[list[str], str]:
        """The runs measured at this precision, and their note."""
        if (weights, kv_dtype) == ("bf16", "bf16"):
            return self.runs, self.note
        if (weights, kv_dtype) == ("fp8", "fp8"):
            return self.fp8_runs, self.fp8_note
        raise ValueError(f"no product-path runs were measured with weights {weights} and KV cache {kv_dtype} "
                         "(measured: bf16/bf16, fp8/fp8)")


class ValidationRuns(_Data):
    """benchmarks/planner-validation-runs.json."""

    about: str
    engine: EngineSettings
    session1: Session1
    session2: Session2
    session4: Session4
    run15: Run15
    product_path: ProductPath


RUNS = ValidationRuns.model_validate_json(RUNS_FILE.read_text())
RUN21 = BENCH / RUNS.session4.bench
RUN15 = BENCH / RUNS.run15.bench
VALIDATION_SIM = SimulationConfig(model=RUNS.engine.model, output_tokens=RUNS.engine.output_tokens)
VALIDATION_ENGINE = EngineConfig(checkpoint=Path("simulated"), max_num_seqs=RUNS.engine.max_num_seqs,
                                 max_num_batched_tokens=RUNS.engine.max_num_batched_tokens)
REPLAY_SIM = VALIDATION_SIM.model_copy(update={"output_tokens": OUTPUT_CAP})  # each request's max_tokens ends it


def _h200(bench: Path, visual_fit: Path | None | bool = None) -> StepModel:
    """The 1xH200 30B-A3B step model calibrated on one bench_engine.py JSON."""
    calibration = Calibration.from_bench(bench, visual_fit)
    base = StepModel.build("h200", "qwen3-vl-30b-a3b")
    return StepModel(calibration, base.hardware, base.model, calibration_hardware=base.calibration_hardware)


@functools.cache
def _bench(path: Path) -> dict:
    """A bench JSON, read and parsed once per validation (several rows draw on the same run)."""
    return json.loads(path.read_text())


def _offline_row(run: str, model: StepModel, counts: dict[str, int], samples: int, preprocess_s: float,
                 measured_engine_s: float, measured: float) -> dict:
    """All `samples` at t=0 on `counts` engines; samples/s = samples / (engine makespan + preprocessing)."""
    cluster = VirtualCluster(VALIDATION_ENGINE, VALIDATION_SIM, {role: model for role in counts}, counts)
    result = cluster.run([0.0] * samples, Workload())
    predicted = samples / (result.makespan_s + preprocess_s)
    return {"run": run, "calibration": model.calibration.source, "samples": samples,
            "engine_s": {"measured": measured_engine_s, "predicted": round(result.makespan_s, 2)},
            "samples_per_s": {"measured": measured, "predicted": round(predicted, 2),
                              "error_pct": round(100 * (predicted / measured - 1), 1)}}


def _poisson_rows(model: StepModel, dp2: dict, preprocess_s: float) -> list[dict]:
    """bench_multi_gpu's dp2 Poisson levels replayed: each instance its own stream at half the rate (the same seed,
    the same cap on arrival time), latency = arrival to last token + one request's preprocessing."""
    session = RUNS.session2
    share = len(dp2["instances"])
    rows = []
    for i, level in enumerate(dp2["poisson"]["levels"]):
        qps = level["qps"] / share
        per_instance = math.ceil(session.poisson.requests / share)
        cap_s = min(session.poisson.level_s, per_instance / qps)
        arrivals = [t for t in poisson_arrivals(qps, per_instance, POISSON_SEED + i) if t <= cap_s]
        result = VirtualCluster(VALIDATION_ENGINE, VALIDATION_SIM, {"aggregated": model}, {"aggregated": 1}).run(arrivals, Workload())
        latencies = sorted(x + preprocess_s for x in result.latencies_s * share)
        p99 = percentile(latencies, 0.99)
        rows.append({"run": f"{session.run} dp2 Poisson {level['qps']} QPS ({session.code})", "calibration": model.calibration.source,
                     "requests": {"measured": level["requests"], "predicted": len(latencies)},
                     "p50_s": {"measured": level["p50_s"], "predicted": round(latencies[len(latencies) // 2], 3)},
                     "p99_s": {"measured": level["p99_s"], "predicted": round(p99, 3),
                               "error_pct": round(100 * (p99 / level["p99_s"] - 1), 1)}})
    return rows


def _session1_rows() -> list[dict]:
    """Session-1 runs, each calibrated on session-1 JSON."""
    session = RUNS.session1
    rows = []
    for run in session.offline:
        file = BENCH / run.bench
        fit = BENCH / run.visual_fit if isinstance(run.visual_fit, str) else run.visual_fit
        measured = _bench(file)["ours"]["catalogue"]
        rows.append(_offline_row(f"{run.run} 1xH200 ({session.code})", _h200(file, fit), {"aggregated": 1},
                                 measured["samples"], measured["preprocess_s"], measured["engine_s"],
                                 measured["samples_per_s"]))
    dp2 = _bench(BENCH / session.dp2.bench)["dp2"]
    rows.append(_dp2_row(f"{session.dp2.run} dp2 2xH200 ({session.code})", _h200(BENCH / session.dp2.calibration),
                         dp2))
    return rows


def _session2_rows() -> list[dict]:
    """Session-2 runs (preprocessing before the engine's steps), calibrated on run9, the one-GPU bench of that code."""
    session = RUNS.session2
    model = _h200(BENCH / session.bench)
    one = _bench(BENCH / session.bench)["ours"]["catalogue"]
    rows = [_offline_row(f"{session.run} 1xH200 ({session.code})", model, {"aggregated": 1}, one["samples"],
                         one["preprocess_s"], one["engine_s"], one["samples_per_s"])]
    multi = _bench(BENCH / session.multi_gpu)
    rows.append(_dp2_row(f"{session.run} dp2 2xH200 ({session.code})", model, multi["dp2"]))
    pd = multi["pd"]
    rows.append(_offline_row(f"{session.run} pd 1 prefill + 1 decode 2xH200 ({session.code})", model,
                             {"prefill": 1, "decode": 1}, pd["samples"], pd["preprocess_s"], pd["decode_wall_s"],
                             pd["samples_per_s"]))
    return rows + _poisson_rows(model, multi["dp2"], _run9_prepare_s())


def _run9_prepare_s() -> float:
    """One request's preprocessing in session 2: run9's catalogue preprocess_s x its threads / samples."""
    session = RUNS.session2
    one = _bench(BENCH / session.bench)["ours"]["catalogue"]
    return one["preprocess_s"] * session.preprocess_threads / one["samples"]


def replay_requests(model: StepModel, requests: list[CatalogueRequest], joins: list[float],
                    encoded: Iterable[int] = (), engine_config: EngineConfig = VALIDATION_ENGINE,
                    deadlines: list[float] | None = None) -> list[float]:
    """One engine on the virtual clock, request i joining at joins[i] with its own prompt and output length
    (VirtualCluster serves one request shape); each request's finishing time. `encoded`: image sizes (patches) the
    measured engine had encoded before (their cuDNN plans built). `deadlines`: each request's latency deadline on
    the same clock, which the scheduler weighs as the real one does (None: no bounds, as before the engine had
    them)."""
    engine = simulated(engine_config, REPLAY_SIM, model, realtime=False)
    executor = engine.executor
    executor.encoded_sizes.update(encoded)
    order = sorted(range(len(requests)), key=joins.__getitem__)
    finish, clock, nxt = [math.nan] * len(requests), 0.0, 0
    engine.scheduler.clock = lambda: clock  # deadlines and slack on the virtual clock
    while nxt < len(order) or engine.has_unfinished():
        if not engine.has_unfinished():
            clock = max(clock, joins[order[nxt]])
        while nxt < len(order) and joins[order[nxt]] <= clock:
            i = order[nxt]
            bound = remaining_bound(deadlines[i], clock) if deadlines is not None else 0.0
            engine.add_request(str(i), requests[i].prompt, SamplingParams(max_tokens=requests[i].output_tokens),
                               RequestOptions(latency_bound_s=bound))
            nxt += 1
        outputs = engine.step()
        if executor.last_step_s == 0.0 and not outputs and not engine.scheduler.passes_in_flight:
            raise RuntimeError(f"replay of {len(requests)} requests stalled: the KV pool cannot hold the next one")
        clock += executor.last_step_s
        for out in outputs:
            if out.finished:
                finish[int(out.request_id)] = clock
    return finish


def _overlapped_wall_s(model: StepModel, requests: list[CatalogueRequest], preprocess_done_s: float,
                       encoded: Iterable[int] = ()) -> float:
    """An offline catalogue run as bench_engine times it since session 3: requests join as their preparation ends
    (evenly over the run's measured preparation span), from the first preparation to the last token."""
    n = len(requests)
    return max(replay_requests(model, requests, [preprocess_done_s * (i + 1) / n for i in range(n)], encoded))


def image_sizes_of(requests: list[CatalogueRequest]) -> set[int]:
    """Every image size (patches) of `requests`: what an engine that served them has cuDNN plans for."""
    return set().union(*(image_sizes(r.prompt.token_ids) for r in requests))


def _run21_sizes_before_catalogues() -> set[int]:
    """Image sizes run21's engine encoded before its catalogues: bench_engine's vision micro-benchmark."""
    return {_bench(RUN21)["ours"]["vision_patches_per_image"]}


def _rate_row(run: str, model: StepModel, samples: int, measured: float, predicted_wall_s: float,
              **times: tuple[float, float]) -> dict:
    """A row of samples/s (samples / predicted_wall_s) beside the times it comes from, name=(measured, predicted)."""
    predicted = samples / predicted_wall_s
    return {"run": run, "calibration": model.calibration.source, "samples": samples,
            **{name: {"measured": m, "predicted": round(p, 2)} for name, (m, p) in times.items()},
            "samples_per_s": {"measured": measured, "predicted": round(predicted, 2),
                              "error_pct": round(100 * (predicted / measured - 1), 1)}}


def _session4_fixed_rows(model: StepModel) -> list[dict]:
    """run21's fixed catalogue (one H200, 4 preparation threads): overlapped with the steps, and prepared first."""
    data = _bench(RUN21)
    w, ours = data["workload"], data["ours"]
    requests = fixed_catalogue(w["samples"], w["image_size"], w["text_tokens"], w["output_tokens"])
    cat, first = ours["catalogue"], ours["catalogue_prepared_first"]
    before = _run21_sizes_before_catalogues()
    wall = _overlapped_wall_s(model, requests, cat["preprocess_done_s"], before)
    # the catalogue prepared first, the engine run after it
    engine_s = max(replay_requests(model, requests, [0.0] * len(requests), before | image_sizes_of(requests)))
    name, code = RUNS.session4.run, RUNS.session4.code
    return [_rate_row(f"{name} 1xH200 fixed catalogue ({code})", model, cat["samples"], cat["samples_per_s"],
                      wall, wall_s=(cat["wall_s"], wall)),
            _rate_row(f"{name} 1xH200 fixed catalogue, prepared first ({code})", model, first["samples"],
                      first["samples_per_s"], first["preprocess_done_s"] + engine_s,
                      engine_wall_s=(first["engine_wall_s"], engine_s))]


def prepare_s_per_visual_token() -> float:
    """Preparation of one request alone: run21's prepared-first catalogue time x its threads, per visual token."""
    ours = _bench(RUN21)["ours"]["catalogue_prepared_first"]
    return ours["preprocess_done_s"] * RUNS.session4.prepare_threads / (ours["samples"] * ours["visual_tokens"]["mean"])


def _session4_realistic_rows(model: StepModel, requests: list[CatalogueRequest]) -> list[dict]:
    """The realistic catalogue (lab.bench.catalogue_workload.realistic_catalogue, per-request images and output
    lengths): run21 on one H200 (its 256 requests), run15 on two (the first 128: DP2 halves, TP2, DP2 Poisson)."""
    run21 = _bench(RUN21)
    cat, w = run21["ours"]["catalogue_realistic"], run21["workload"]
    ours = requests[:cat["samples"]]
    fixed = fixed_catalogue(w["samples"], w["image_size"], w["text_tokens"], w["output_tokens"])  # served before it
    before = _run21_sizes_before_catalogues() | image_sizes_of(fixed)
    wall = _overlapped_wall_s(model, ours, cat["preprocess_done_s"], before)
    rows = [_rate_row(f"{RUNS.session4.run} 1xH200 realistic catalogue ({RUNS.session4.code})", model,
                      cat["samples"], cat["samples_per_s"], wall, wall_s=(cat["wall_s"], wall))]
    run15 = _bench(RUN15)
    ours = requests[:run15["workload"]["samples"]]
    dp2 = run15["dp2"]
    shards = [ours[k::len(dp2["instances"])] for k in range(len(dp2["instances"]))]
    walls = [_overlapped_wall_s(model, shard, inst["preprocess_done_s"]) for shard, inst in zip(shards, dp2["instances"])]
    name, code = RUNS.run15.run, RUNS.run15.code
    rows.append(_rate_row(f"{name} dp2 2xH200 realistic ({code})", model, len(ours), dp2["samples_per_s"],
                          max(walls), wall_s=(max(i["wall_s"] for i in dp2["instances"]), max(walls))))
    tp2, measured = dataclasses.replace(model, tp=2), run15["tp2"]["catalogue"]
    wall = _overlapped_wall_s(tp2, ours, measured["preprocess_done_s"])
    rows.append(_rate_row(f"{name} tp2 2xH200 realistic, TP at the assumed {tp2.tp_efficiency} efficiency "
                          f"({code})", tp2, len(ours), measured["samples_per_s"], wall,
                          wall_s=(measured["wall_s"], wall)))
    return rows + _realistic_poisson_rows(model, shards, dp2)


def _realistic_poisson_rows(model: StepModel, shards: list[list[CatalogueRequest]], dp2: dict) -> list[dict]:
    """run15's dp2 Poisson levels replayed as bench_multi_gpu ran them: each instance its own stream at the level's
    fraction of its own offline rate (seed 1000 + level, arrivals capped as the bench caps them), the n-th arrival
    is its shard's request n; a request joins the engine after its preparation, latency is from its arrival."""
    per_token = prepare_s_per_visual_token()
    run15 = RUNS.run15
    rows = []
    for i, level in enumerate(dp2["poisson"]["levels"]):
        latencies = []
        for shard, inst in zip(shards, dp2["instances"]):
            qps = level["fraction"] * inst["samples_per_s"]
            count = math.ceil(run15.poisson.requests / len(shards))
            arrivals = [t for t in poisson_arrivals(qps, count, POISSON_SEED + i)
                        if t <= min(run15.poisson.level_s, count / qps)]
            requests = [shard[n % len(shard)] for n in range(len(arrivals))]
            joins = [t + per_token * r.prompt.token_ids.count(IMAGE_PAD_ID) for t, r in zip(arrivals, requests)]
            # the same engine served its shard offline before the Poisson levels: every image size encoded
            finish = replay_requests(model, requests, joins, image_sizes_of(shard))
            latencies += [f - t for f, t in zip(finish, arrivals)]
        rows.append(_latency_row(f"{run15.run} dp2 Poisson {level['qps']} QPS realistic ({run15.code})", model,
                                 level, latencies))
    return rows


def _latency_row(run: str, model: StepModel, level: dict, latencies: list[float]) -> dict:
    """p50 (median) and p99 as bench_multi_gpu computes them."""
    ordered = sorted(latencies)
    p99 = percentile(ordered, 0.99)
    return {"run": run, "calibration": model.calibration.source,
            "requests": {"measured": level["requests"], "predicted": len(ordered)},
            "p50_s": {"measured": level["p50_s"], "predicted": round(statistics.median(ordered), 3)},
            "p99_s": {"measured": level["p99_s"], "predicted": round(p99, 3),
                      "error_pct": round(100 * (p99 / level["p99_s"] - 1), 1)}}


def validate() -> dict:
    """The model beside every measured H200 run it can express, one JSON object: session-1 and session-2 runs
    (each calibrated on the one-GPU bench of its code) and session-4 runs (calibrated on run21, the default)."""
    model = _h200(RUN21)
    rows = _session1_rows() + _session2_rows() + _session4_fixed_rows(model)
    rows += _session4_realistic_rows(model, realistic_catalogue(_bench(RUN21)["ours"]
                                                                ["catalogue_realistic"]["samples"]))
    return {"device": "H200, Qwen3-VL-30B-A3B bf16; fixed catalogue (1,734 prompt / 45 output tokens) and realistic "
                      "catalogue (per-request images: prompt mean 2,252 / p99 9,502 tokens, output mean 43)",
            "notes": {"offline (session 1-2)": "samples/s = samples / (simulated engine makespan + the run's measured "
                                               "preprocessing)",
                      "offline (session 4)": "requests join evenly over the run's measured preprocess_done_s; "
                                             "samples/s = samples / simulated wall (first preparation to last token)",
                      "poisson (session 2)": f"latency + {_run9_prepare_s():.3f} s of preprocessing per request "
                                             f"(run9's catalogue preprocess_s x {RUNS.session2.preprocess_threads} threads / samples)",
                      "poisson (session 4)": f"a request joins {prepare_s_per_visual_token() * 1e6:.1f} us per "
                                             f"visual token after its arrival (run21's prepared-first catalogue: "
                                             f"preprocess_done_s x {RUNS.session4.prepare_threads} threads / visual tokens)",
                      "pd": "measured engine_s is decode_wall_s (preprocessing included); run15's pd (realistic) is "
                            "not replayed: the prefill/decode cluster serves one request shape",
                      "tp2": "the step model divides times by tp x tp_efficiency (0.85, assumed, not measured)"},
            "rows": rows}


def _dp2_row(run: str, model: StepModel, dp2: dict) -> dict:
    """Two data-parallel instances, each with its half of the samples at t=0 (the slower one sets the time)."""
    instances = dp2["instances"]
    row = _offline_row(run, model, {"aggregated": 1}, instances[0]["samples"],
                       max(i["preprocess_s"] for i in instances), max(i["engine_s"] for i in instances),
                       dp2["samples_per_s"])
    samples = sum(i["samples"] for i in instances)
    row["samples"] = samples
    predicted = round(row["samples_per_s"]["predicted"] * samples / instances[0]["samples"], 2)
    row["samples_per_s"].update(predicted=predicted,
                                error_pct=round(100 * (predicted / dp2["samples_per_s"] - 1), 1))
    return row


# ---- the product path's LoadGen points (issue 19, item 4) ----------------------------------------------------


def server_latencies(model: StepModel, requests: list[CatalogueRequest], engine_config: EngineConfig, qps: float,
                     queries: int, pool: int, seed: int = POISSON_SEED, bound_s: float = 0.0) -> list[float]:
    """Latencies of a LoadGen-like Server run on the virtual clock: `queries` Poisson arrivals at `qps`, each a
    sample of the first `pool` requests (the performance sample set) in LoadGen's order for q3vl, shuffled whole
    passes over the pool (contract.stats.permuted_draws), joining the engine after its preparation (run21's seconds
    per visual token, as the session-4 Poisson rows charge it). bound_s: the scenario's latency bound from each
    query's issue, which the engine's scheduler weighs (0: none). (Until 2026-12-07 each sample was drawn
    independently, so a 2,000-query Interactive replay held 6-9 queries of the two 4,000 px samples where LoadGen
    issues exactly 8.)"""
    arrivals = poisson_arrivals(qps, queries, seed)
    chosen = [requests[i] for i in permuted_draws(pool, queries, seed)]
    per_visual = prepare_s_per_visual_token()
    joins = [t + per_visual * r.prompt.token_ids.count(IMAGE_PAD_ID) for t, r in zip(arrivals, chosen)]
    deadlines = [t + bound_s for t in arrivals] if bound_s else None
    finish = replay_requests(model, chosen, joins, image_sizes_of(chosen[:1]), engine_config, deadlines)
    return [f - t for f, t in zip(finish, arrivals)]


def _verdict(latencies: list[float], bound_s: float) -> str:
    """LoadGen's Server verdict on these latencies: p99 within the bound and early stopping met (enough queries for
    those over it: none at all over below 459 queries, one below 662, ...)."""
    ok = percentile(latencies, 0.99) <= bound_s and early_stopping_met(latencies, bound_s)
    return "VALID" if ok else "INVALID"


def _p(values: list[float], q: float) -> float:
    return round(percentile(values, q), 2)


def product_path_model(correction: Path | None = None, weights: Precision = "bf16", kv_dtype: str = "bf16"
                       ) -> StepModel:
    """The step model the product path's replay uses (run21's calibration, moved to `weights` and `kv_dtype` as the
    H200 measured them: Calibration.at_precision), with a fitted StepCorrection (lab/plan/step_fit.py's JSON)
    where given."""
    model = _h200(RUN21)
    model = dataclasses.replace(model, calibration=model.calibration.at_precision(weights, kv_dtype), weights=weights,
                                kv_dtype=kv_dtype)
    return dataclasses.replace(model, correction=StepCorrection.load(correction)) if correction else model


def _replay_engine(scenario: dict) -> EngineConfig:
    """The simulated engine with a measured run's scenario engine settings (find_peak's workload JSON)."""
    engine = scenario["engine"]
    return EngineConfig(checkpoint=Path("simulated"), max_num_seqs=engine["max_num_seqs"],
                        max_num_batched_tokens=engine["max_num_batched_tokens"],
                        max_num_prefill_tokens=engine.get("max_num_prefill_tokens"))


def _highest_valid_qps(model: StepModel, requests: list[CatalogueRequest], engine_config: EngineConfig,
                       queries: int, pool: int, bound_s: float, lo: float, hi: float, steps: int) -> float:
    """Bisection between lo and hi for the highest QPS whose replay LoadGen would call VALID."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        latencies = server_latencies(model, requests, engine_config, mid, queries, pool, bound_s=bound_s)
        valid = _verdict(latencies, bound_s) == "VALID"
        lo, hi = (mid, hi) if valid else (lo, mid)
    return lo


def product_path_rows(model: StepModel | None = None, requests: list[CatalogueRequest] | None = None,
                      bisect_steps: int = 6, runs: Iterable[str] | None = None) -> dict:
    """Each measured Server point of RUNS.product_path at the model's precision beside its replay (p50, p99,
    verdict), and the highest Server QPS the replay calls valid (LoadGen's verdict on the point's query count: p99
    within the bound and early stopping met; bisection) beside the measured bracket (highest VALID, lowest INVALID).
    `requests`: the catalogue (default: the product path's, rebuilt: ~1.5 min)."""
    model = model or product_path_model()
    measured_runs, note = RUNS.product_path.runs_of(model.weights, model.kv_dtype)
    points = [(name, point, data["workload"]["scenarios"]["server"], data["workload"]["max_tokens"])
              for name in (runs or measured_runs) for data in [_bench(BENCH / name)]
              for point in data["points"] if point["scenario"] == "server"]
    if not points:
        raise ValueError("product_path: no Server points in the listed runs")
    _, _, server, max_tokens = points[0]
    engine_config = _replay_engine(server)
    if requests is None:
        requests = realistic_catalogue(server["samples"], RUNS.product_path.catalogue_seed)
    requests = [CatalogueRequest(r.prompt, max_tokens) for r in requests]
    bound_s = server["target_latency_ms"] / 1e3
    rows = []
    for name, point, scenario, _ in points:
        pool = min(point["performance_sample_count"], len(requests))
        latencies = server_latencies(model, requests, _replay_engine(scenario), point["target_qps"], point["queries"],
                                     pool, bound_s=bound_s)
        rows.append({
            "run": f"{name} Server {point['target_qps']} QPS, {point['queries']} queries",
            "p50_s": {"measured": round(point["p50_s"], 2), "predicted": _p(latencies, 0.5)},
            "p99_s": {"measured": round(point["p99_s"], 2), "predicted": _p(latencies, 0.99)},
            "verdict": {"measured": point["verdict"], "predicted": _verdict(latencies, bound_s)},
        })
    queries, pool = points[0][1]["queries"], min(points[0][1]["performance_sample_count"], len(requests))
    lo = _highest_valid_qps(model, requests, engine_config, queries, pool, bound_s, 0.5,
                            max(p[1]["target_qps"] for p in points) * 1.5, bisect_steps)
    valid_qps = [p[1]["target_qps"] for p in points if p[1]["verdict"] == "VALID"]
    invalid_qps = [p[1]["target_qps"] for p in points if p[1]["verdict"] != "VALID"]
    precision = "bf16" if model.weights == "bf16" else f"{model.weights} weights, {model.kv_dtype} KV cache"
    return {"device": f"H200, Qwen3-VL-30B-A3B {precision} (random weights), realistic synthetic catalogue; LoadGen "
                      "Server through router and Ray worker",
            "model": model.describe(),
            "note": note,
            "rows": rows,
            "server_max_valid_qps": {"measured_highest_valid": max(valid_qps, default=None),
                                     "measured_lowest_invalid": min(invalid_qps, default=None),
                                     "predicted": round(lo, 2), "bisection_steps": bisect_steps}}


INTERACTIVE_BOUND_S = 1.5  # the benchmark's Interactive latency bound (Server's comes with each measured run)
INTERACTIVE_SAMPLES = 500  # the product path's Interactive catalogue (h200x1-synthetic*: catalogue-8k, synthetic:500)


def speedup_rows(model: StepModel, speedups: Iterable[tuple[float, float]],
                 server_requests: list[CatalogueRequest] | None = None,
                 interactive_requests: list[CatalogueRequest] | None = None, *, server_queries: int = 1500,
                 interactive_queries: int = 2000, bisect_steps: int = 5) -> dict:
    """What issue 19's targets ask of the engine, on the product path's replay: for each (text, vision) pair, the
    model with its text and vision parts' costs multiplied by them, its Offline rate (every sample at once, the
    Offline engine settings), Server at 0.85x that rate and Interactive at 0.4x (LoadGen's verdicts on
    `server_queries` / `interactive_queries` Poisson queries), the highest valid Server QPS (bisection) and
    Interactive at 1 QPS. Workload and engine settings: the first measured product-path run at the model's
    precision with an Offline point (else the first); catalogues rebuilt when not given (minutes)."""
    measured_runs, _ = RUNS.product_path.runs_of(model.weights, model.kv_dtype)
    workloads = [_bench(BENCH / name)["workload"] for name in measured_runs]
    workload = next((w for w in workloads if "offline" in w["scenarios"]), workloads[0])
    scenarios, max_tokens = workload["scenarios"], workload["max_tokens"]
    # Server and Interactive run the same engine settings on the product path (h200x1-synthetic*)
    latency = _replay_engine(scenarios["server"])
    offline = _replay_engine(scenarios.get("offline", scenarios["server"]))
    bound_s = scenarios["server"]["target_latency_ms"] / 1e3
    seed = RUNS.product_path.catalogue_seed
    if server_requests is None:
        server_requests = realistic_catalogue(scenarios["server"]["samples"], seed)
    if interactive_requests is None:
        interactive_requests = realistic_catalogue(INTERACTIVE_SAMPLES, seed)
    server_requests = [CatalogueRequest(r.prompt, max_tokens) for r in server_requests]
    interactive_requests = [CatalogueRequest(r.prompt, max_tokens) for r in interactive_requests]

    def point(scaled: StepModel, requests: list[CatalogueRequest], config: EngineConfig, qps: float, queries: int,
              bound: float) -> dict:
        latencies = server_latencies(scaled, requests, config, qps, queries, len(requests), bound_s=bound)
        over = sum(1 for x in latencies if x > bound)
        return {"qps": round(qps, 2), "p50_s": _p(latencies, 0.5), "p99_s": _p(latencies, 0.99), "over": over,
                "queries": queries, "verdict": _verdict(latencies, bound)}

    rows = []
    for text, vision in speedups:
        c = model.correction
        scaled = dataclasses.replace(model, correction=dataclasses.replace(
            c, text_scale=c.text_scale * text, vision_scale=c.vision_scale * vision, source=f"{c.source} x ({text}, "
            f"{vision})"))
        n = len(server_requests)
        rate = n / max(server_latencies(scaled, server_requests, offline, 1e6, n, n))
        lo = _highest_valid_qps(scaled, server_requests, latency, server_queries, n, bound_s, 0.0, 1.5 * rate,
                                bisect_steps)
        rows.append({
            "text_x": text, "vision_x": vision, "offline_samples_per_s": round(rate, 2),
            "server_at_0.85x": point(scaled, server_requests, latency, 0.85 * rate, server_queries, bound_s),
            "server_max_valid_qps": round(lo, 2),
            "interactive_at_0.4x": point(scaled, interactive_requests, latency, 0.4 * rate, interactive_queries,
                                         INTERACTIVE_BOUND_S),
            "interactive_at_1_qps": point(scaled, interactive_requests, latency, 1.0, interactive_queries,
                                          INTERACTIVE_BOUND_S),
        })
    return {"about": "issue 19's targets on the product path's replay, the text and vision parts' costs scaled",
            "model": model.describe(), "correction": dataclasses.asdict(model.correction), "rows": rows}
