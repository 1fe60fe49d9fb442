"""Sweeps simulated systems through the real harness (LoadGen -> SUT -> router -> simulated workers) at rising
QPS and prints one JSON object: per (layout, policy, scenario) the points run and the highest QPS whose p99
latency stayed under the scenario's bound (LoadGen's own summary log decides "VALID")."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
BOUND_MS = {"server": 12000, "interactive": 1500}


def simulated_system(name: str, hardware: str, *, workers: int, layout: str, policy: str, tp: int = 1,
                     prefill_fraction: float = 0.25, qps: dict[str, float] | None = None, duration_ms: int = 60000,
                     samples: int = 64, simulation: dict | None = None, engine: dict | None = None) -> dict:
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
    scenario = {"min_duration_ms": duration_ms, "min_query_count": 1, "performance_sample_count": samples}
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
                         seconds: float) -> dict:
    """Closed-loop requests/s through `shards` router processes, each fronting its own simulated workers."""
    import uuid

    from router.shards import ShardedRouterClient
    from router.wire import pb
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
                                                 sampling=pb.SamplingParams(use_model_defaults=True, max_tokens=150))
            await closed_loop(lambda: drain(client.generate(request())), concurrency, 2.0)  # warm-up
            result = await closed_loop(lambda: drain(client.generate(request())), concurrency, seconds)
    finally:
        procs.stop()
    return {"shards": shards, "workers_per_shard": workers_per_shard, "concurrency": concurrency, **result,
            "requests_per_s_per_shard": round(result["requests_per_s"] / shards, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--router-ceiling", metavar="SHARDS", default=None,
                        help="instead of a sweep: closed-loop req/s through 1..SHARDS router shards (e.g. 1,2)")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--serve-workers", metavar="ROUTER", help=argparse.SUPPRESS)
    parser.add_argument("--simulation", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--workers", type=int, default=72)
    parser.add_argument("--layouts", default="aggregated,disaggregated")
    parser.add_argument("--policies", default="round_robin,least_loaded")
    parser.add_argument("--scenarios", default="server,interactive")
    parser.add_argument("--qps", default="20,40,80", help="target QPS points (simulated seconds)")
    parser.add_argument("--duration-ms", type=int, default=60000)
    parser.add_argument("--model", default="qwen3-vl-30b-a3b")
    parser.add_argument("--weights", default="bf16")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--workers-per-process", type=int, default=24)
    parser.add_argument("--out", type=Path, default=Path("/tmp/q3vl-sim-sweep"))
    parser.add_argument("--point-timeout-s", type=float, default=600)
    args = parser.parse_args(argv)
    if args.serve_workers:
        import asyncio

        asyncio.run(serve_simulated_workers(args.serve_workers, args.workers, args.hardware, json.loads(args.simulation)))
        return
    if args.router_ceiling:
        import asyncio

        sim = {"model": args.model, "weights": args.weights}
        points = [asyncio.run(router_ceiling(int(n), args.workers // int(n), args.hardware, sim, args.concurrency,
                                             args.seconds)) for n in args.router_ceiling.split(",")]
        per_shard = points[0]["requests_per_s_per_shard"]  # one shard alone: its ceiling on this machine
        print(json.dumps({"hardware": args.hardware, "workers": args.workers, "points": points,
                          "nvl72_qps": 2323, "shards_needed_at_measured_rate": -(-2323 // int(per_shard))}, indent=1))
        return

    simulation = {"model": args.model, "weights": args.weights, "time_scale": args.time_scale,
                  "workers_per_process": args.workers_per_process}
    results = []
    for layout in args.layouts.split(","):
        for policy in args.policies.split(","):
            for scenario in args.scenarios.split(","):
                points = []
                for qps in (float(q) for q in args.qps.split(",")):
                    # LoadGen runs in wall time: a time scale s slows the cluster s-fold, so QPS and bound shrink.
                    name = f"sim-{layout}-{policy}-{scenario}-{qps:g}"
                    config = simulated_system(name, args.hardware, workers=args.workers, layout=layout, policy=policy,
                                              qps={scenario: qps / args.time_scale}, duration_ms=args.duration_ms,
                                              simulation=simulation)
                    config["scenarios"][scenario]["target_latency_ms"] = int(BOUND_MS[scenario] * args.time_scale)
                    point = run_point(config, scenario, args.out / name, args.point_timeout_s)
                    point["target_qps"] = qps
                    points.append(point)
                    print(json.dumps({"layout": layout, "policy": policy, "scenario": scenario, **point}),
                          file=sys.stderr, flush=True)
                    if not point.get("valid"):
                        break  # higher QPS will not pass either
                best = max((p["target_qps"] for p in points if p.get("valid")), default=None)
                results.append({"layout": layout, "policy": policy, "scenario": scenario,
                                "best_valid_qps": best, "points": points})
    print(json.dumps({"hardware": args.hardware, "workers": args.workers, "simulation": simulation,
                      "duration_ms": args.duration_ms, "results": results}, indent=1))


if __name__ == "__main__":
    main()
