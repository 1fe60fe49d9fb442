"""Finds the capacity knee of simulated systems through the real harness (LoadGen -> SUT -> router -> simulated
workers): per (layout, policy, scenario) rising QPS until a point fails, then bisection, one cluster per
(layout, policy); prints one JSON object with every point, its CPU use, the machine's load and the latency split
into engine time and router/harness overhead (simulated seconds). A point passes when LoadGen's summary says its
p99 met the bound and the cluster kept up: completions matched issues over the run (a short run hides a slowly
growing backlog from the p99 alone: at 1-2 simulated seconds a 20% overload adds well under the 12 s bound)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from contract.stats import percentile
from lab.bench.router_ceiling import router_ceiling
from lab.plan.cpu_monitor import CpuMonitor
from lab.plan.latency import BOUND_MS, KEPT_UP_MIN, kept_up
from lab.plan.simulated_system import parse_summary, simulated_system

REPO = Path(__file__).resolve().parents[2]

# ---- the knee search ------------------------------------------------------------------------------------------

def search_knee(passes: Callable[[float], bool], start: float, factor: float = 1.5, refine: int = 1,
                max_points: int = 7) -> tuple[float | None, list[float]]:
    """Highest QPS that passes: steps of `factor` up from `start` while points pass (down while they fail), then
    `refine` bisections between the highest pass and the lowest failure. Returns (that QPS or None, QPS tried)."""
    tried: list[float] = []
    lo: float | None = None
    hi: float | None = None

    def probe(qps: float) -> None:
        nonlocal lo, hi
        qps = float(round(qps))
        tried.append(qps)
        if passes(qps):
            lo = qps
        else:
            hi = qps

    probe(start)
    while len(tried) < max_points and (lo is None or hi is None):
        probe(lo * factor if hi is None else hi / factor)
    for _ in range(refine):
        if lo is None or hi is None or len(tried) >= max_points or hi - lo <= 1:
            break
        probe((lo + hi) / 2)
    return lo, tried


# ---- what a point measured ------------------------------------------------------------------------------------

_LATENCY_EVENT = re.compile(r'"name":"Latency".*?"ts":([0-9.]+).*?"issue_delay":(\d+),\s*"issue_to_done":(\d+)')


def loadgen_latencies(trace: Path) -> list[tuple[float, float, float]]:
    """(scheduled issue s, latency s, LoadGen's own issue delay s) of every sample in mlperf_log_trace.json."""
    with trace.open() as f:
        rows = [(float(m[1]) / 1e6, int(m[3]) / 1e9, int(m[2]) / 1e9)
                for line in f if '"Latency"' in line and (m := _LATENCY_EVENT.search(line))]
    return sorted(rows)


def latency_drift(rows: list[tuple[float, float, float]]) -> float:
    """Median latency of the run's third quarter of queries (by issue time) over that of its second quarter
    (reported, not a pass rule: the cluster drains faster once LoadGen stops issuing, so the last quarter
    says little, and a continuously batching engine slows every request a little rather than queueing some)."""
    n = len(rows)
    if n < 8:
        return float("nan")
    second = statistics.median(r[1] for r in rows[n // 4: n // 2])
    third = statistics.median(r[1] for r in rows[n // 2: 3 * n // 4])
    return third / second


def latency_split(rows: list[tuple[float, float, float]], traced, time_scale: float) -> dict:
    """LoadGen latency = time inside the simulated engines + router/harness/gRPC overhead, in simulated seconds.
    The engines' share includes `overrun` (steps running past their simulated length on a busy CPU)."""
    residence: dict[str, float] = {}
    overrun: dict[str, float] = {}
    for t in traced:
        rid = t.request_id.split("#")[0]  # a PD request: its prefill and decode attempts on two workers
        residence[rid] = residence.get(rid, 0.0) + t.residence_s
        overrun[rid] = overrun.get(rid, 0.0) + t.overrun_s
    if not rows or not residence:
        return {}
    latencies = [r[1] for r in rows]
    engine = list(residence.values())
    sim = lambda wall: round(wall / time_scale, 4)  # noqa: E731
    return {
        "requests_traced": len(engine),
        "loadgen_mean_s": sim(statistics.fmean(latencies)), "loadgen_p99_s": sim(percentile(latencies, 0.99)),
        "engine_mean_s": sim(statistics.fmean(engine)), "engine_p99_s": sim(percentile(engine, 0.99)),
        "overhead_mean_s": sim(statistics.fmean(latencies) - statistics.fmean(engine)),
        "overhead_p99_gap_s": sim(percentile(latencies, 0.99) - percentile(engine, 0.99)),
        "engine_overrun_mean_s": sim(statistics.fmean(overrun.values())),
        "engine_overrun_p99_s": sim(percentile(list(overrun.values()), 0.99)),
        "loadgen_issue_delay_p99_s": sim(percentile([r[2] for r in rows], 0.99)),
    }


# ---- one live cluster per (layout, policy), one LoadGen test per point ----------------------------------------

@dataclass
class SweepSettings:
    time_scale: float
    queries: int
    simulated_seconds: float
    out: Path
    cache_dir: Path
    point_timeout_s: float


class LiveSystem:
    """The harness's Cluster (router process + Ray actors of simulated workers) kept up across LoadGen tests."""

    def __init__(self, config: dict, settings: SweepSettings, monitor: CpuMonitor):
        from harness.cluster import Cluster
        from harness.system_config import load_system_config

        self.config = config
        self.settings = settings
        self.monitor = monitor
        self.dir = settings.out / config["system"]["name"]
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "system.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.trace_dir = Path(config["simulation"]["trace_dir"])
        self.cluster = Cluster(load_system_config(path), Path(config["model"]["checkpoint"]), self.dir / "cluster",
                               None)

    def __enter__(self) -> LiveSystem:
        started = time.monotonic()
        self.cluster.__enter__()
        self.startup_s = round(time.monotonic() - started, 1)
        return self

    def __exit__(self, *exc) -> None:
        self.cluster.__exit__(*exc)

    def probe(self, scenario: str, qps: float) -> dict:
        """One LoadGen test at `qps` simulated queries/s: LoadGen's verdict, drift, latency split, CPU, load."""
        from harness.scenarios import LoadGenMode, Scenario, log_dir_for
        from harness.system_config import load_system_config
        from harness.user_conf import write_user_conf
        from workers.sim.trace import read_traces

        s = self.settings
        name = f"{scenario}-{qps:g}"
        point_dir = self.dir / name
        shutil.rmtree(point_dir, ignore_errors=True)
        config = json.loads(json.dumps(self.config))
        section = config["scenarios"][scenario]
        queries = max(s.queries, round(qps * s.simulated_seconds))
        section.update(target_qps=qps / s.time_scale, min_query_count=queries, min_duration_ms=1000,
                       target_latency_ms=int(BOUND_MS[scenario] * s.time_scale))
        path = point_dir / "system.yaml"
        point_dir.mkdir(parents=True)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        write_user_conf(load_system_config(path), Scenario(scenario), point_dir / "user.conf")
        started_wall, started = time.time(), time.monotonic()
        child = subprocess.Popen(
            [sys.executable, "-m", "harness", "run-test", "--system", str(path), "--scenario", scenario,
             "--test", "performance", "--router", self.cluster.router_address, "--scenario-dir", str(point_dir),
             "--cache-dir", str(s.cache_dir), "--no-progress",
             *(["--embedded-router", embedded] if (embedded := self.cluster.embedded_router_address) else [])],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=(point_dir / "run-test.log").open("w"), start_new_session=True)
        try:
            rc = child.wait(timeout=s.point_timeout_s)
        except BaseException:  # timed out, or the sweep is being stopped: LoadGen's process goes too
            os.killpg(child.pid, signal.SIGKILL)
            rc = child.wait()
            if sys.exc_info()[0] is not subprocess.TimeoutExpired:
                raise
        point: dict = {"target_qps": qps, "wall_s": round(time.monotonic() - started, 1), "rc": rc,
                       "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()]}
        log_dir = log_dir_for(point_dir, LoadGenMode.PERFORMANCE)
        summary = log_dir / "mlperf_log_summary.txt"
        if rc != 0 or not summary.is_file():
            point.update(valid=False, passes=False, error=(point_dir / "run-test.log").read_text()[-1500:])
            return point
        point.update(parse_summary(summary))
        for key in ("completed_qps", "p99_ms", "mean_ms"):  # LoadGen ran in wall time: back to simulated
            point[key] = round(point[key] * (s.time_scale if key == "completed_qps" else 1 / s.time_scale), 3)
        rows = loadgen_latencies(log_dir / "mlperf_log_trace.json")
        traced = [t for t in read_traces(self.trace_dir) if t.t_in >= started_wall]
        window = (min(t.t_in for t in traced), max(t.t_out for t in traced)) if traced else (started_wall, time.time())
        point["queries"] = len(rows)
        point["simulated_duration_s"] = round((window[1] - window[0]) / s.time_scale, 2)
        point["latency_drift"] = round(latency_drift(rows), 3)
        point["kept_up"] = round(kept_up(rows), 3)
        point["passes"] = point["valid"] and point["kept_up"] >= KEPT_UP_MIN
        point["split"] = latency_split(rows, traced, s.time_scale)
        point["cpu_pct_of_one_core"] = self.monitor.usage(*window)
        router_pct = point["cpu_pct_of_one_core"].get("router")
        if router_pct and rows:
            wall_qps = len(rows) / (window[1] - window[0])
            point["router_cpu_ms_per_query"] = round(10 * router_pct / wall_qps, 3)
        return point


def sweep(args, settings: SweepSettings) -> list[dict]:
    simulation = {"model": args.model, "weights": args.weights, "kv_dtype": args.kv_dtype,
                  "time_scale": args.time_scale, "workers_per_process": args.workers_per_process,
                  "stream_interval": args.stream_interval}
    results = []
    with CpuMonitor() as monitor:
        for layout in args.layouts.split(","):
            for policy in args.policies.split(","):
                scenarios = [sc for sc in args.scenarios.split(",")
                             if sc == "server" or f"{layout}:{policy}" in args.interactive_for.split(",")]
                if not scenarios:
                    continue
                name = f"sim-{layout}-{policy}"
                trace_dir = settings.out / name / "engine-trace"
                config = simulated_system(name, args.hardware, workers=args.workers, layout=layout, policy=policy,
                                          simulation={**simulation, "trace_dir": str(trace_dir)})
                with LiveSystem(config, settings, monitor) as system:
                    for scenario in scenarios:
                        points: list[dict] = []

                        def passes(qps: float) -> bool:
                            points.append(system.probe(scenario, qps))
                            print(json.dumps({"layout": layout, "policy": policy, "scenario": scenario,
                                              **points[-1]}), file=sys.stderr, flush=True)
                            return points[-1]["passes"]

                        start = float(args.start_qps.split(",")[["server", "interactive"].index(scenario)])
                        knee, _ = search_knee(passes, start, args.factor, args.refine, args.max_points)
                        results.append({"layout": layout, "policy": policy, "scenario": scenario,
                                        "knee_qps": knee, "cluster_startup_s": system.startup_s, "points": points})
    return results


def virtual_points(args) -> list[dict]:
    """The same points on the virtual clock (no router, no LoadGen): one group of engines (aggregated: 4; PD:
    1 prefill + 3 decode) at the per-engine rate of `--workers` engines, for `--simulated-seconds` of arrivals."""
    from workers.config import EngineConfig
    from workers.sim.config import SimulationConfig
    from workers.sim.engine import build_step_model
    from lab.plan.virtual import VirtualCluster, Workload
    from contract.stats import poisson_arrivals

    sim = SimulationConfig(model=args.model, weights=args.weights, kv_dtype=args.kv_dtype)
    engine = EngineConfig(checkpoint=Path("simulated"), max_num_seqs=1024, max_num_batched_tokens=8192,
                          max_model_len=32768)
    model = build_step_model(args.hardware, sim, 1)
    workload = Workload(prompt_tokens=args.prompt_tokens, image_tokens=args.image_tokens)
    rows = []
    for layout in args.layouts.split(","):
        counts = {"aggregated": 4} if layout == "aggregated" else {"prefill": 1, "decode": 3}
        for policy in args.policies.split(","):
            for qps in (float(q) for q in args.start_qps.split(",")):
                group_qps = qps * sum(counts.values()) / args.workers
                arrivals = poisson_arrivals(group_qps, max(int(group_qps * args.simulated_seconds), 8))
                result = VirtualCluster(engine, sim, {role: model for role in counts}, counts,
                                        "round_robin" if policy == "round_robin" else "least_loaded"
                                        ).run(arrivals, workload)
                done = sorted(zip(result.issued_s, result.latencies_s, [0.0] * len(result.latencies_s)))
                rows.append({"layout": layout, "policy": policy, "qps": qps, "seconds": args.simulated_seconds,
                             "p50_s": round(statistics.median(result.latencies_s), 3),
                             "p99_s": round(result.percentile(0.99), 3), "kept_up": round(kept_up(done), 3)})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """scripts/sim_sweep.py's arguments."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--router-ceiling", metavar="SHARDS", default=None,
                        help="instead of a sweep: closed-loop req/s through 1..SHARDS router shards (e.g. 1,2)")
    parser.add_argument("--request-stream-interval", default="0",
                        help="with --router-ceiling: GenerateRequest.stream_interval values to compare (e.g. 0,16)")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--workers", type=int, default=72)
    parser.add_argument("--layouts", default="aggregated,disaggregated")
    parser.add_argument("--policies", default="round_robin,least_loaded,kv_aware")
    parser.add_argument("--scenarios", default="server,interactive")
    parser.add_argument("--interactive-for", default="aggregated:least_loaded",
                        help="LAYOUT:POLICY pairs that also get an Interactive search (comma-separated)")
    parser.add_argument("--start-qps", default="2000,1000", help="first Server,Interactive point (simulated QPS)")
    parser.add_argument("--factor", type=float, default=1.5, help="step up (down) while points pass (fail)")
    parser.add_argument("--refine", type=int, default=1, help="bisections after the first failure")
    parser.add_argument("--max-points", type=int, default=5, help="points per search at most")
    parser.add_argument("--queries", type=int, default=2000, help="LoadGen min_query_count per point, at least")
    parser.add_argument("--simulated-seconds", type=float, default=1.0,
                        help="and at least this many simulated seconds of queries (QPS x seconds)")
    parser.add_argument("--model", default="qwen3-vl-30b-a3b")
    parser.add_argument("--weights", default="bf16")
    parser.add_argument("--kv-dtype", default="bf16")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="simulated engines stream a request's tokens every N tokens (and its first and last)")
    parser.add_argument("--workers-per-process", type=int, default=24)
    parser.add_argument("--out", type=Path, default=Path("/tmp/q3vl-sim-sweep"))
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/q3vl-sim-sweep/cache"))
    parser.add_argument("--point-timeout-s", type=float, default=600)
    parser.add_argument("--virtual", action="store_true",
                        help="instead of the harness: the --start-qps points on the virtual clock (kv_aware runs as "
                             "least_loaded there), for --simulated-seconds")
    parser.add_argument("--prompt-tokens", type=int, default=700, help="--virtual workload (the synthetic:64 prompts)")
    parser.add_argument("--image-tokens", type=int, default=67)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """The command line of scripts/sim_sweep.py: a knee search through the harness (default), the router's
    ceiling (--router-ceiling) or the points on the virtual clock (--virtual); prints one JSON object."""
    args = parse_args(argv)
    if args.router_ceiling:
        import asyncio

        sim = {"model": args.model, "weights": args.weights}
        points = [asyncio.run(router_ceiling(int(n), args.workers // int(n), args.hardware, sim, args.concurrency,
                                             args.seconds, int(interval)))
                  for interval in args.request_stream_interval.split(",") for n in args.router_ceiling.split(",")]
        per_shard = max(p["requests_per_s_per_shard"] for p in points if p["shards"] == 1)  # one shard's ceiling here
        print(json.dumps({"hardware": args.hardware, "workers": args.workers, "points": points,
                          "nvl72_qps": 2323, "shards_needed_at_measured_rate": -(-2323 // int(per_shard))}, indent=1))
        return

    if args.virtual:
        print(json.dumps({"hardware": args.hardware, "workers": args.workers, "model": args.model,
                          "prompt_tokens": args.prompt_tokens, "image_tokens": args.image_tokens,
                          "points": virtual_points(args)}, indent=1))
        return
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop = Ctrl-C: the clusters are torn down
    settings = SweepSettings(args.time_scale, args.queries, args.simulated_seconds, args.out, args.cache_dir,
                             args.point_timeout_s)
    started = time.monotonic()
    results = sweep(args, settings)
    print(json.dumps({
        "hardware": args.hardware, "workers": args.workers, "model": args.model, "weights": args.weights,
        "kv_dtype": args.kv_dtype, "time_scale": args.time_scale, "stream_interval": args.stream_interval,
        "queries_per_point": f"max({args.queries}, QPS x {args.simulated_seconds} s)",
        "pass_rule": f"LoadGen 'Performance constraints satisfied: Yes' (p99 <= bound x time scale) "
                     f"and kept_up >= {KEPT_UP_MIN}",
        "sweep_wall_s": round(time.monotonic() - started), "results": results}, indent=1))

