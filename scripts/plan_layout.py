"""Searches layouts (TP width, aggregated vs prefill/decode split, routing policy) for a hardware profile and a
scenario with the step model (virtual clock, no sleeping) and writes the system YAML it recommends, the
predicted figures in its comments. `--validate` prints the model against the measured 1xH200 bench runs.

    python scripts/plan_layout.py --hardware vera-rubin --gpus 72 --scenario server --out plan.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.sim_sweep import BOUND_MS, simulated_system  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.sim.config import SimulationConfig  # noqa: E402
from workers.sim.engine import build_step_model  # noqa: E402
from workers.sim.step_model import Calibration, StepModel  # noqa: E402
from workers.sim.virtual import VirtualCluster, Workload, poisson_arrivals  # noqa: E402

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


HORIZON_S = {"server": 24.0, "interactive": 6.0}  # arrivals span twice the bound or more: a steady state
MAX_REQUESTS = 4000


def _meets(engine, sim, model, layout, policy, group, scenario, workload, requests, qps) -> tuple[bool, float]:
    """Poisson arrivals at `qps` over the scenario's horizon: (p99 within the bound and the group kept up, p99)."""
    count = min(max(requests, int(qps * HORIZON_S[scenario])), MAX_REQUESTS)
    arrivals = poisson_arrivals(qps, count)
    result = _cluster(engine, sim, model, layout, policy, group).run(arrivals, workload)
    p99 = result.percentile(0.99)
    kept_up = result.makespan_s <= arrivals[-1] - arrivals[0] + BOUND_MS[scenario] / 1e3
    return p99 <= BOUND_MS[scenario] / 1e3 and kept_up, p99


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


def validate() -> dict:
    """The 1xH200 catalogue runs predicted by the step model beside their measurements."""
    sim = SimulationConfig(model="qwen3-vl-30b-a3b", output_tokens=45)
    engine = EngineConfig(checkpoint=Path("simulated"), max_num_seqs=256, max_num_batched_tokens=8192)
    rows = []
    bench = REPO / "benchmarks"
    cases = [("run2", "2026-11-30-run2-30b-a3b.json", None), ("run1", "2026-11-30-run1-30b-a3b.json", "run2"),
             ("run2-eager", "2026-11-30-run2-30b-a3b-eager.json", "run2"),
             ("run2 (micro-benchmarks only)", "2026-11-30-run2-30b-a3b.json", False)]
    for name, file, fit in cases:
        measured = json.loads((bench / file).read_text())["ours"]["catalogue"]
        visual_fit = {None: None, False: False, "run2": bench / "2026-11-30-run2-30b-a3b.json"}[fit]
        calibration = Calibration.from_bench(bench / file, visual_fit)
        base = StepModel.build("h200", "qwen3-vl-30b-a3b")
        model = StepModel(calibration, base.hardware, base.model, calibration_hardware=base.calibration_hardware)
        cluster = VirtualCluster(engine, sim, {"aggregated": model}, {"aggregated": 1})
        result = cluster.run([0.0] * measured["samples"], Workload())
        predicted = measured["samples"] / (result.makespan_s + measured["preprocess_s"])
        rows.append({"run": name, "calibration": calibration.source, "samples": measured["samples"],
                     "engine_s": {"measured": measured["engine_s"], "predicted": round(result.makespan_s, 2)},
                     "samples_per_s": {"measured": measured["samples_per_s"], "predicted": round(predicted, 2),
                                       "error_pct": round(100 * (predicted / measured["samples_per_s"] - 1), 1)}})
    rows.append(_validate_dp2(engine, sim, bench))
    return {"device": "H200, Qwen3-VL-30B-A3B bf16, catalogue workload (1,734 prompt / 45 output tokens)", "rows": rows}


def _validate_dp2(engine, sim, bench: Path) -> dict:
    """Two data-parallel instances on 2xH200 (run6), predicted from the single-GPU run of the same code (run5)."""
    measured = json.loads((bench / "2026-11-30-run6-multi-gpu-x2.json").read_text())["dp2"]
    samples = sum(i["samples"] for i in measured["instances"])
    preprocess_s = max(i["preprocess_s"] for i in measured["instances"])
    calibration = Calibration.from_bench(bench / "2026-11-30-run5-30b-a3b.json", None)
    base = StepModel.build("h200", "qwen3-vl-30b-a3b")
    model = StepModel(calibration, base.hardware, base.model, calibration_hardware=base.calibration_hardware)
    result = VirtualCluster(engine, sim, {"aggregated": model}, {"aggregated": 2}).run([0.0] * samples, Workload())
    predicted = samples / (result.makespan_s + preprocess_s)
    return {"run": "run6 dp2 (2xH200, two instances)", "calibration": calibration.source, "samples": samples,
            "engine_s": {"measured": max(i["engine_s"] for i in measured["instances"]),
                         "predicted": round(result.makespan_s, 2)},
            "samples_per_s": {"measured": measured["samples_per_s"], "predicted": round(predicted, 2),
                              "error_pct": round(100 * (predicted / measured["samples_per_s"] - 1), 1)}}


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
