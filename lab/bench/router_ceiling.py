"""The router's ceiling with simulated workers: closed-loop requests/s through router shards, each fronting
its own simulated workers (scripts/sim_sweep.py --router-ceiling). `python -m lab.bench.router_ceiling --serve-workers
ROUTER ...` is the helper process that serves a shard's workers."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import uuid
from pathlib import Path

from lab.bench.load_test import Procs, closed_loop, drain


async def serve_simulated_workers(router: str, count: int, hardware: str, simulation: dict) -> None:
    """`count` simulated WorkerServers in this process, registered with `router`; prints "ready" when serving."""
    from harness.ray_workers import build_simulated_engine
    from workers.config import EngineConfig
    from workers.serve.server import build_worker
    from workers.serve.worker_build import WorkerSettings
    from workers.sim.config import SimulationConfig

    engine = EngineConfig(checkpoint=Path(f"simulated:{hardware}"), max_num_seqs=1024)
    sim = SimulationConfig.model_validate(simulation)
    servers = []
    for i in range(count):
        served = build_simulated_engine(engine, sim, hardware, 1)
        servers.append(build_worker(served, WorkerSettings(f"sim{i}", router_address=router)))
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
    from router.shards import ShardedRouterClient
    from contract.wire import pb
    from lab.plan.virtual import Workload

    procs = Procs()
    try:
        addresses = []
        for _ in range(shards):
            (line,) = procs.start(["-m", "router", "--listen", "127.0.0.1:0", "--policy", "least_loaded"])
            addresses.append(line.split()[-1])
            procs.start(["-m", "lab.bench.router_ceiling", "--serve-workers", addresses[-1], "--workers", str(workers_per_shard),
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


def main(argv: list[str] | None = None) -> None:
    """The helper process: `--workers` simulated workers of `--hardware` registered with `--serve-workers`."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve-workers", metavar="ROUTER", required=True)
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--hardware", required=True)
    parser.add_argument("--simulation", default="{}", help="SimulationConfig fields, JSON")
    args = parser.parse_args(argv)
    asyncio.run(serve_simulated_workers(args.serve_workers, args.workers, args.hardware, json.loads(args.simulation)))


if __name__ == "__main__":
    main()
