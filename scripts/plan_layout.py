"""Searches layouts (TP width, aggregated vs prefill/decode split, routing policy) for a hardware profile and a
scenario with the step model (virtual clock, no sleeping) and writes the system YAML it recommends, the
predicted figures in its comments. `--validate` prints the model against the measured 1x and 2xH200 bench runs.

    python scripts/plan_layout.py --hardware vera-rubin --gpus 72 --scenario server --out plan.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.catalogue_workload import OUTPUT_CAP, CatalogueRequest, fixed_catalogue, realistic_catalogue  # noqa: E402
from scripts.sim_sweep import BOUND_MS, KEPT_UP_MIN, simulated_system  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.sim.config import SimulationConfig  # noqa: E402
from workers.sim.engine import SimulatedEngine, build_step_model  # noqa: E402
from workers.sim.latency import kept_up  # noqa: E402
from workers.sim.step_model import Calibration, StepModel  # noqa: E402
from workers.sim.virtual import VirtualCluster, Workload  # noqa: E402
from workers.stats import percentile, poisson_arrivals  # noqa: E402
from workers.tokenizer import IMAGE_PAD_ID  # noqa: E402
from workers.types import SamplingParams  # noqa: E402

SPLITS = {"aggregated": None, "pd-1:3": (1, 3), "pd-1:1": (1, 1)}


@dataclass
class Plan:
    tp: int
    layout: str
    policy: str
    instances: int
    groups: int
    qps: float             # whole system: highest QPS meeting the bound (offline: samples/s)
    p99_s: float
    group_qps: float

    def row(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def _cluster(engine: EngineConfig, sim: SimulationConfig, model: StepModel, layout: str, policy: str,
             group: int) -> VirtualCluster:
    split = SPLITS[layout]
    counts = {"aggregated": group} if split is None else {"prefill": split[0], "decode": split[1]}
    return VirtualCluster(engine, sim, {role: model for role in counts}, counts, policy)


HORIZON_S = {"server": 60.0, "interactive": 12.0}  # arrivals span five to eight times the bound: a steady state
MAX_REQUESTS = 6000


def _meets(engine, sim, model, layout, policy, group, scenario, workload, requests, qps) -> tuple[bool, float]:
    """Poisson arrivals at `qps` over the scenario's horizon: (p99 within the bound, completions kept pace with
    arrivals after warm-up (sim_sweep's kept_up) and the backlog drained within the bound; p99)."""
    count = min(max(requests, int(qps * HORIZON_S[scenario])), MAX_REQUESTS)
    arrivals = poisson_arrivals(qps, count)
    result = _cluster(engine, sim, model, layout, policy, group).run(arrivals, workload)
    p99 = result.percentile(0.99)
    bound_s = BOUND_MS[scenario] / 1e3
    drained = result.makespan_s <= arrivals[-1] - arrivals[0] + bound_s
    steady = kept_up(sorted(zip(result.issued_s, result.latencies_s))) >= KEPT_UP_MIN
    return p99 <= bound_s and drained and steady, p99


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


def search(args) -> list[Plan]:
    sim = SimulationConfig(model=args.model, weights=args.weights, kv_dtype=args.kv_dtype,
                           output_tokens=args.output_tokens)
    engine = EngineConfig(checkpoint=Path("simulated"), max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=32768)
    workload = Workload(prompt_tokens=args.prompt_tokens, image_tokens=args.image_tokens)
    plans = []
    for tp in (int(t) for t in args.tp.split(",")):
        if args.gpus % tp:
            continue
        model = build_step_model(args.hardware, sim, tp)
        if model.kv_capacity_tokens() < 4 * (args.prompt_tokens + 150):
            continue  # the weights do not fit with room for a few sequences
        instances = args.gpus // tp
        for layout in args.layouts.split(","):
            split = SPLITS[layout]
            group = min(4, instances) if split is None else sum(split)
            if instances < group:
                continue
            for policy in args.policies.split(","):
                qps, p99 = group_capacity(engine, sim, model, layout, policy, group, args.scenario, workload,
                                          args.requests)
                groups = instances // group
                plans.append(Plan(tp, layout, policy, groups * group, groups, qps * groups, p99, qps))
                print(json.dumps(plans[-1].row()), file=sys.stderr, flush=True)
    return sorted(plans, key=lambda p: -p.qps)


def write_plan(best: Plan, plans: list[Plan], args) -> None:
    split = SPLITS[best.layout]
    layout = "aggregated" if split is None else "disaggregated"
    config = simulated_system(f"plan-{args.hardware}-{args.scenario}", args.hardware, workers=best.instances,
                              layout=layout, policy=best.policy, tp=best.tp,
                              prefill_fraction=0 if split is None else split[0] / sum(split),
                              qps={args.scenario: round(best.qps * 0.95, 1)}, duration_ms=600000, samples=48289,
                              simulation={"model": args.model, "weights": args.weights, "kv_dtype": args.kv_dtype},
                              engine={"max_num_seqs": args.max_num_seqs,
                                      "max_num_batched_tokens": args.max_num_batched_tokens})
    if args.checkpoint:
        config["model"]["checkpoint"] = args.checkpoint
        config["engine"]["device"] = "cuda"
        config.pop("simulation")
    header = [f"# plan_layout.py: {args.hardware} x {args.gpus} GPUs, scenario {args.scenario}, model {args.model} "
              f"({args.weights} weights, {args.kv_dtype} KV), workload {args.prompt_tokens} prompt tokens "
              f"({args.image_tokens} visual) + {args.output_tokens} output tokens.",
              f"# Predicted (step model, virtual clock): {best.qps:.1f} {'samples/s' if args.scenario == 'offline' else 'QPS'}"
              f" with p99 {best.p99_s:.2f} s; target_qps set to 95% of it.",
              "# Layouts ranked (qps, tp, layout, policy):"]
    header += [f"#   {p.qps:9.1f}  tp{p.tp}  {p.layout:10s} {p.policy}" for p in plans[:10]]
    Path(args.out).write_text("\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False))


SESSION1, SESSION2, SESSION4 = "session 1 code", "session 2 code", "session 4 code"
RUN15_CODE = "session 4 code, 16 preparation threads"  # run15 -> run21: only the preparation pool (16 -> 4) changed
VALIDATION_SIM = SimulationConfig(model="qwen3-vl-30b-a3b", output_tokens=45)
VALIDATION_ENGINE = EngineConfig(checkpoint=Path("simulated"), max_num_seqs=256, max_num_batched_tokens=8192)
PREPROCESS_THREADS = 16  # bench_engine/bench_multi_gpu prepared a session-2 catalogue run on min(16, cores) threads
PREPARE_THREADS = 4      # session 4: EngineConfig.preprocess_threads, which bench_engine uses since run21
BENCH_QPS_REQUESTS, BENCH_QPS_LEVEL_S = 120, 12.0  # run9's --qps-requests / --qps-level-s
RUN15_QPS_REQUESTS, RUN15_QPS_LEVEL_S = 150, 15.0  # run15's (they give its measured request counts per level)


def _h200(bench: Path, visual_fit: Path | None | bool = None) -> StepModel:
    """The 1xH200 30B-A3B step model calibrated on one bench_engine.py JSON."""
    calibration = Calibration.from_bench(bench, visual_fit)
    base = StepModel.build("h200", "qwen3-vl-30b-a3b")
    return StepModel(calibration, base.hardware, base.model, calibration_hardware=base.calibration_hardware)


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
    share = len(dp2["instances"])
    rows = []
    for i, level in enumerate(dp2["poisson"]["levels"]):
        qps = level["qps"] / share
        per_instance = math.ceil(BENCH_QPS_REQUESTS / share)
        cap_s = min(BENCH_QPS_LEVEL_S, per_instance / qps)
        arrivals = [t for t in poisson_arrivals(qps, per_instance, 1000 + i) if t <= cap_s]
        result = VirtualCluster(VALIDATION_ENGINE, VALIDATION_SIM, {"aggregated": model}, {"aggregated": 1}).run(arrivals, Workload())
        latencies = sorted(x + preprocess_s for x in result.latencies_s * share)
        p99 = percentile(latencies, 0.99)
        rows.append({"run": f"run9 dp2 Poisson {level['qps']} QPS ({SESSION2})", "calibration": model.calibration.source,
                     "requests": {"measured": level["requests"], "predicted": len(latencies)},
                     "p50_s": {"measured": level["p50_s"], "predicted": round(latencies[len(latencies) // 2], 3)},
                     "p99_s": {"measured": level["p99_s"], "predicted": round(p99, 3),
                               "error_pct": round(100 * (p99 / level["p99_s"] - 1), 1)}})
    return rows


@functools.cache
def _bench(path: Path) -> dict:
    """A bench JSON, read and parsed once per validation (several rows draw on the same run)."""
    return json.loads(path.read_text())


def _session1_rows() -> list[dict]:
    """Session-1 runs, each calibrated on session-1 JSON."""
    bench = REPO / "benchmarks"
    rows = []
    run2 = bench / "2026-11-30-run2-30b-a3b.json"
    for name, file, fit in [("run2", run2, None), ("run1", bench / "2026-11-30-run1-30b-a3b.json", run2),
                            ("run2-eager", bench / "2026-11-30-run2-30b-a3b-eager.json", run2),
                            ("run2 (micro-benchmarks only)", run2, False)]:
        measured = _bench(file)["ours"]["catalogue"]
        rows.append(_offline_row(f"{name} 1xH200 ({SESSION1})", _h200(file, fit), {"aggregated": 1},
                                 measured["samples"], measured["preprocess_s"], measured["engine_s"],
                                 measured["samples_per_s"]))
    run6 = _bench(bench / "2026-11-30-run6-multi-gpu-x2.json")["dp2"]
    rows.append(_dp2_row(f"run6 dp2 2xH200 ({SESSION1})", _h200(bench / "2026-11-30-run5-30b-a3b.json"), run6))
    return rows


def _session2_rows() -> list[dict]:
    """Session-2 runs (preprocessing before the engine's steps), calibrated on run9, the one-GPU bench of that code."""
    bench = REPO / "benchmarks"
    run9_file = bench / "2026-11-30-run9-30b-a3b.json"
    model = _h200(run9_file)
    run9 = _bench(run9_file)["ours"]["catalogue"]
    rows = [_offline_row(f"run9 1xH200 ({SESSION2})", model, {"aggregated": 1}, run9["samples"],
                         run9["preprocess_s"], run9["engine_s"], run9["samples_per_s"])]
    multi = _bench(bench / "2026-11-30-run9-multi-gpu-x2.json")
    rows.append(_dp2_row(f"run9 dp2 2xH200 ({SESSION2})", model, multi["dp2"]))
    pd = multi["pd"]
    rows.append(_offline_row(f"run9 pd 1 prefill + 1 decode 2xH200 ({SESSION2})", model, {"prefill": 1, "decode": 1},
                             pd["samples"], pd["preprocess_s"], pd["decode_wall_s"], pd["samples_per_s"]))
    return rows + _poisson_rows(model, multi["dp2"], _run9_prepare_s())


def _run9_prepare_s() -> float:
    """One request's preprocessing in session 2: run9's catalogue preprocess_s x its threads / samples."""
    run9 = _bench(REPO / "benchmarks" / "2026-11-30-run9-30b-a3b.json")["ours"]["catalogue"]
    return run9["preprocess_s"] * PREPROCESS_THREADS / run9["samples"]


RUN21 = REPO / "benchmarks" / "2026-11-30-run21-30b-a3b.json"
RUN15 = REPO / "benchmarks" / "2026-11-30-run15-multi-gpu-x2-realistic-pd.json"
REPLAY_SIM = VALIDATION_SIM.model_copy(update={"output_tokens": OUTPUT_CAP})  # each request's max_tokens ends it


def _replay(model: StepModel, requests: list[CatalogueRequest], joins: list[float],
            encoded: Iterable[int] = ()) -> list[float]:
    """One engine on the virtual clock, request i joining at joins[i] with its own prompt and output length
    (VirtualCluster serves one request shape); each request's finishing time. `encoded`: image sizes (patches) the
    measured engine had encoded before (their cuDNN plans built)."""
    engine = SimulatedEngine(VALIDATION_ENGINE, REPLAY_SIM, model, realtime=False)
    engine.encoded_sizes.update(encoded)
    order = sorted(range(len(requests)), key=joins.__getitem__)
    finish, clock, nxt = [math.nan] * len(requests), 0.0, 0
    while nxt < len(order) or engine.has_unfinished():
        if not engine.has_unfinished():
            clock = max(clock, joins[order[nxt]])
        while nxt < len(order) and joins[order[nxt]] <= clock:
            i = order[nxt]
            engine.add_request(str(i), requests[i].prompt, SamplingParams(max_tokens=requests[i].output_tokens))
            nxt += 1
        outputs = engine.step()
        if engine.last_step_s == 0.0 and not outputs:
            raise RuntimeError(f"replay of {len(requests)} requests stalled: the KV pool cannot hold the next one")
        clock += engine.last_step_s
        for out in outputs:
            if out.finished:
                finish[int(out.request_id)] = clock
    return finish


def _overlapped_wall_s(model: StepModel, requests: list[CatalogueRequest], preprocess_done_s: float,
                       encoded: Iterable[int] = ()) -> float:
    """An offline catalogue run as bench_engine times it since session 3: requests join as their preparation ends
    (evenly over the run's measured preparation span), from the first preparation to the last token."""
    n = len(requests)
    return max(_replay(model, requests, [preprocess_done_s * (i + 1) / n for i in range(n)], encoded))


def _image_sizes(requests: list[CatalogueRequest]) -> set[int]:
    """Every image size (patches) of `requests`: what an engine that served them has cuDNN plans for."""
    return set().union(*(SimulatedEngine.image_sizes(r.prompt.token_ids) for r in requests))


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
    engine_s = max(_replay(model, requests, [0.0] * len(requests), before | _image_sizes(requests)))  # run after it
    return [_rate_row(f"run21 1xH200 fixed catalogue ({SESSION4})", model, cat["samples"], cat["samples_per_s"],
                      wall, wall_s=(cat["wall_s"], wall)),
            _rate_row(f"run21 1xH200 fixed catalogue, prepared first ({SESSION4})", model, first["samples"],
                      first["samples_per_s"], first["preprocess_done_s"] + engine_s,
                      engine_wall_s=(first["engine_wall_s"], engine_s))]


def _prepare_s_per_visual_token() -> float:
    """Preparation of one request alone: run21's prepared-first catalogue time x its threads, per visual token."""
    ours = _bench(RUN21)["ours"]["catalogue_prepared_first"]
    return ours["preprocess_done_s"] * PREPARE_THREADS / (ours["samples"] * ours["visual_tokens"]["mean"])


def _session4_realistic_rows(model: StepModel, requests: list[CatalogueRequest]) -> list[dict]:
    """The realistic catalogue (harness/catalogue_workload.realistic_catalogue, per-request images and output
    lengths): run21 on one H200 (its 256 requests), run15 on two (the first 128: DP2 halves, TP2, DP2 Poisson)."""
    run21 = _bench(RUN21)
    cat, w = run21["ours"]["catalogue_realistic"], run21["workload"]
    ours = requests[:cat["samples"]]
    fixed = fixed_catalogue(w["samples"], w["image_size"], w["text_tokens"], w["output_tokens"])  # served before it
    before = _run21_sizes_before_catalogues() | _image_sizes(fixed)
    wall = _overlapped_wall_s(model, ours, cat["preprocess_done_s"], before)
    rows = [_rate_row(f"run21 1xH200 realistic catalogue ({SESSION4})", model, cat["samples"], cat["samples_per_s"],
                      wall, wall_s=(cat["wall_s"], wall))]
    run15 = _bench(RUN15)
    ours = requests[:run15["workload"]["samples"]]
    dp2 = run15["dp2"]
    shards = [ours[k::len(dp2["instances"])] for k in range(len(dp2["instances"]))]
    walls = [_overlapped_wall_s(model, shard, inst["preprocess_done_s"]) for shard, inst in zip(shards, dp2["instances"])]
    rows.append(_rate_row(f"run15 dp2 2xH200 realistic ({RUN15_CODE})", model, len(ours), dp2["samples_per_s"],
                          max(walls), wall_s=(max(i["wall_s"] for i in dp2["instances"]), max(walls))))
    tp2, measured = dataclasses.replace(model, tp=2), run15["tp2"]["catalogue"]
    wall = _overlapped_wall_s(tp2, ours, measured["preprocess_done_s"])
    rows.append(_rate_row(f"run15 tp2 2xH200 realistic, TP at the assumed {tp2.tp_efficiency} efficiency "
                          f"({RUN15_CODE})", tp2, len(ours), measured["samples_per_s"], wall,
                          wall_s=(measured["wall_s"], wall)))
    return rows + _realistic_poisson_rows(model, shards, dp2)


def _realistic_poisson_rows(model: StepModel, shards: list[list[CatalogueRequest]], dp2: dict) -> list[dict]:
    """run15's dp2 Poisson levels replayed as bench_multi_gpu ran them: each instance its own stream at the level's
    fraction of its own offline rate (seed 1000 + level, arrivals capped as the bench caps them), the n-th arrival
    is its shard's request n; a request joins the engine after its preparation, latency is from its arrival."""
    per_token = _prepare_s_per_visual_token()
    rows = []
    for i, level in enumerate(dp2["poisson"]["levels"]):
        latencies = []
        for shard, inst in zip(shards, dp2["instances"]):
            qps = level["fraction"] * inst["samples_per_s"]
            count = math.ceil(RUN15_QPS_REQUESTS / len(shards))
            arrivals = [t for t in poisson_arrivals(qps, count, 1000 + i) if t <= min(RUN15_QPS_LEVEL_S, count / qps)]
            requests = [shard[n % len(shard)] for n in range(len(arrivals))]
            joins = [t + per_token * r.prompt.token_ids.count(IMAGE_PAD_ID) for t, r in zip(arrivals, requests)]
            # the same engine served its shard offline before the Poisson levels: every image size encoded
            latencies += [f - t for f, t in zip(_replay(model, requests, joins, _image_sizes(shard)), arrivals)]
        rows.append(_latency_row(f"run15 dp2 Poisson {level['qps']} QPS realistic ({RUN15_CODE})", model, level,
                                 latencies))
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
                                             f"(run9's catalogue preprocess_s x {PREPROCESS_THREADS} threads / samples)",
                      "poisson (session 4)": f"a request joins {_prepare_s_per_visual_token() * 1e6:.1f} us per "
                                             f"visual token after its arrival (run21's prepared-first catalogue: "
                                             f"preprocess_done_s x {PREPARE_THREADS} threads / visual tokens)",
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--scenario", default="server", choices=["offline", "server", "interactive"])
    parser.add_argument("--model", default="qwen3-vl-235b-a22b")
    parser.add_argument("--weights", default="bf16", choices=["bf16", "fp8", "fp4"])
    parser.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8"])
    parser.add_argument("--policies", default="round_robin,least_loaded")
    parser.add_argument("--tp", default="1,2,4,8", help="TP widths to try")
    parser.add_argument("--layouts", default=",".join(SPLITS), help="layouts to try")
    parser.add_argument("--prompt-tokens", type=int, default=1734)
    parser.add_argument("--image-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=45)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--requests", type=int, default=400, help="simulated requests per point")
    parser.add_argument("--checkpoint", default=None, help="write a real-hardware config for this checkpoint")
    parser.add_argument("--out", default="plan.yaml")
    parser.add_argument("--validate", action="store_true")
    args = parser.parse_args(argv)
    if args.validate:
        print(json.dumps(validate(), indent=1))
        return
    plans = search(args)
    if not plans:
        sys.exit(f"no layout of {args.model} fits {args.gpus} x {args.hardware}")
    write_plan(plans[0], plans, args)
    print(json.dumps({"out": args.out, "best": plans[0].row(), "ranked": [p.row() for p in plans]}, indent=1))


if __name__ == "__main__":
    main()
