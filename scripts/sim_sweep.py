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
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from workers.sim.latency import kept_up  # noqa: E402
from workers.stats import percentile  # noqa: E402

BOUND_MS = {"server": 12000, "interactive": 1500}


def simulated_system(name: str, hardware: str, *, workers: int, layout: str, policy: str, tp: int = 1,
                     prefill_fraction: float = 0.25, qps: dict[str, float] | None = None, duration_ms: int = 60000,
                     samples: int = 64, simulation: dict | None = None, engine: dict | None = None,
                     min_queries: int = 1) -> dict:
    """A system config (harness/system_config.py schema) of `workers` simulated instances of `hardware`."""
    qps = qps or {}
    if layout == "aggregated":
        pools = [{"role": "aggregated", "count": workers, "gpus_per_worker": tp, "tp": tp, "ep": tp}]
    else:
        prefill = max(1, round(workers * prefill_fraction))
        pools = [{"role": "prefill", "count": prefill, "gpus_per_worker": tp, "tp": tp, "ep": tp},
                 {"role": "decode", "count": workers - prefill, "gpus_per_worker": tp, "tp": tp, "ep": tp}]
    router: dict = {"policy": {"name": policy},
                    "limits": {"max_inflight_per_worker": 4096, "max_inflight_total": 262144, "max_queue": 262144}}
    if layout != "aggregated":
        router["disaggregation"] = {"enabled": True}
    scenario = {"min_duration_ms": duration_ms, "min_query_count": min_queries, "performance_sample_count": samples}
    return {
        "system": {"name": name, "submitter": "Q3VLHarness", "division": "open", "system_desc": "systems/vr-nvl72.json"},
        "model": {"checkpoint": f"simulated:{hardware}", "dtype": "bfloat16"},
        "datasets": {"product-catalogue": {"path": f"synthetic:{samples}"}, "catalogue-8k": {"path": f"synthetic:{samples}"}},
        "engine": {"block_size": 16, "max_num_seqs": 1024, "max_num_batched_tokens": 8192, "max_model_len": 32768,
                   **(engine or {})},
        "workers": {"pools": pools},
        "router": router,
        "simulation": simulation or {},
        "scenarios": {
            "offline": {**scenario, "target_qps": qps.get("offline", 10.0)},
            "server": {**scenario, "target_qps": qps.get("server", 1.0), "target_latency_ms": BOUND_MS["server"]},
            "interactive": {**scenario, "target_qps": qps.get("interactive", 1.0),
                            "target_latency_ms": BOUND_MS["interactive"]},
        },
        "measurements": {"input_data_types": "bf16", "retraining": "No", "starting_weights_filename": "simulated",
                         "weight_data_types": "simulated", "weight_transformations": "none"},
        "requests": {"max_tokens": 150, "timeout_s": 600},
        "ray": {"num_cpus": 2, "num_gpus": 0, "object_store_memory_mb": 100},
    }


def parse_summary(path: Path) -> dict:
    """The figures of LoadGen's mlperf_log_summary.txt that the sweep needs."""
    text = path.read_text()

    def number(label: str) -> float | None:
        m = re.search(rf"^{re.escape(label)}\s*:\s*([0-9.eE+-]+)", text, re.M)
        return float(m.group(1)) if m else None

    valid = re.search(r"Performance constraints satisfied\s*:\s*(\w+)", text)
    return {
        "valid": bool(valid and valid.group(1) == "Yes"),
        "completed_qps": number("Completed samples per second") or number("Scheduled samples per second"),
        "p99_ms": (number("99.00 percentile latency (ns)") or 0) / 1e6,
        "mean_ms": (number("Mean latency (ns)") or 0) / 1e6,
    }


def run_point(config: dict, scenario: str, out: Path, timeout_s: float, ray_address: str | None = None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{config['system']['name']}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "--system", str(path), "--scenario", scenario, "--mode", "performance",
         "--output", str(out / "output"), "--cache-dir", str(out / "cache"), "--no-progress",
         *(["--ray-address", ray_address] if ray_address else [])],
        cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
    )
    summaries = sorted((out / "output").rglob("mlperf_log_summary.txt"), key=lambda p: p.stat().st_mtime)
    point = {"target_qps": config["scenarios"][scenario]["target_qps"], "wall_s": round(time.monotonic() - started, 1),
             "rc": proc.returncode}
    if summaries:
        point.update(parse_summary(summaries[-1]))
    else:
        point["error"] = proc.stderr[-2000:]
    return point


async def serve_simulated_workers(router: str, count: int, hardware: str, simulation: dict) -> None:
    """`count` simulated WorkerServers in this process, registered with `router`; prints "ready" when serving."""
    import asyncio
    import signal

    from harness.ray_workers import build_simulated_engine
    from workers.config import EngineConfig
    from workers.server import WorkerServer
    from workers.sim.config import SimulationConfig

    engine = EngineConfig(checkpoint=Path(f"simulated:{hardware}"), max_num_seqs=1024)
    sim = SimulationConfig.model_validate(simulation)
    servers = []
    for i in range(count):
        served = build_simulated_engine(engine, sim, hardware, 1)
        servers.append(WorkerServer(served.async_engine, f"sim{i}", "aggregated", router,
                                    generation_defaults=served.generation_defaults))
        await servers[-1].start()
    print("ready", flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        await server.stop()


async def router_ceiling(shards: int, workers_per_shard: int, hardware: str, simulation: dict, concurrency: int,
                         seconds: float, stream_interval: int = 0) -> dict:
    """Closed-loop requests/s through `shards` router processes, each fronting its own simulated workers; the
    requests ask for chunks of `stream_interval` tokens (0: every engine step's tokens)."""
    import uuid

    from contract.wire import pb
    from router.shards import ShardedRouterClient
    from scripts.bench_router import Procs, closed_loop, drain
    from workers.sim.virtual import Workload

    procs = Procs()
    try:
        addresses = []
        for _ in range(shards):
            (line,) = procs.start(["-m", "router", "--listen", "127.0.0.1:0", "--policy", "least_loaded"])
            addresses.append(line.split()[-1])
            procs.start([__file__, "--serve-workers", addresses[-1], "--workers", str(workers_per_shard),
                         "--hardware", hardware, "--simulation", json.dumps(simulation)])
        prompt = Workload().prompt().token_ids
        async with ShardedRouterClient(addresses) as client:
            await client.wait_for_workers(workers_per_shard, timeout=120)
            request = lambda: pb.GenerateRequest(request_id=uuid.uuid4().hex, prompt_token_ids=prompt,
                                                 sampling=pb.SamplingParams(use_model_defaults=True, max_tokens=150),
                                                 stream_interval=stream_interval)
            await closed_loop(lambda: drain(client.generate(request())), concurrency, 2.0)  # warm-up
            result = await closed_loop(lambda: drain(client.generate(request())), concurrency, seconds)
    finally:
        procs.stop()
    return {"shards": shards, "workers_per_shard": workers_per_shard, "concurrency": concurrency,
            "request_stream_interval": stream_interval, **result,
            "requests_per_s_per_shard": round(result["requests_per_s"] / shards, 1)}


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

KEPT_UP_MIN = 0.93  # completions over issues one median latency earlier: below it, the cluster falls behind
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


class CpuMonitor:
    """Samples, once a second, the CPU time of this process's descendants by kind (router, LoadGen/SUT, Ray
    workers, Ray itself) and of the whole machine; `usage(t0, t1)` gives % of one core over a wall window."""

    KINDS = (("router", "-m router"), ("loadgen_sut", "run-test"), ("sim_workers", "ModelWorker"),
             ("ray_other", "ray"))

    def __init__(self, period_s: float = 1.0):
        self._samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> CpuMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            self._samples.append((time.time(), self._snapshot()))

    def _snapshot(self) -> dict[str, float]:
        procs: dict[int, tuple[int, float, str]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
                cmd = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            procs[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / self._tick, cmd)
        mine = {os.getpid()}
        for _ in range(6):  # descendants, a few generations deep (Ray: raylet -> worker processes)
            mine |= {pid for pid, (ppid, _, _) in procs.items() if ppid in mine}
        totals = {kind: 0.0 for kind, _ in self.KINDS} | {"sweep": 0.0}
        for pid in mine & procs.keys():
            _, cpu, cmd = procs[pid]
            kind = next((k for k, needle in self.KINDS if needle in cmd), "sweep")
            totals[kind] += cpu
        cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        totals["machine_busy"] = (sum(map(int, cpu)) - int(cpu[3]) - int(cpu[4])) / self._tick
        return totals

    def usage(self, t0: float, t1: float) -> dict[str, float]:
        inside = [s for s in self._samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return {}
        (a_t, a), (b_t, b) = inside[0], inside[-1]
        return {kind: round(100 * (b[kind] - a[kind]) / (b_t - a_t), 1) for kind in b}


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
             "--cache-dir", str(s.cache_dir), "--no-progress"],
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
    from workers.sim.virtual import VirtualCluster, Workload
    from workers.stats import poisson_arrivals

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--router-ceiling", metavar="SHARDS", default=None,
                        help="instead of a sweep: closed-loop req/s through 1..SHARDS router shards (e.g. 1,2)")
    parser.add_argument("--request-stream-interval", default="0",
                        help="with --router-ceiling: GenerateRequest.stream_interval values to compare (e.g. 0,16)")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--serve-workers", metavar="ROUTER", help=argparse.SUPPRESS)
    parser.add_argument("--simulation", default="{}", help=argparse.SUPPRESS)
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
    args = parser.parse_args(argv)
    if args.serve_workers:
        import asyncio

        asyncio.run(serve_simulated_workers(args.serve_workers, args.workers, args.hardware, json.loads(args.simulation)))
        return
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


if __name__ == "__main__":
    main()
