"""An Offline-style burst through one router: `--requests` concurrent requests, each with an image of `--image-mb`
MB, to one simulated Qwen3-VL-30B-A3B worker (lab.bench.router_ceiling's helper); prints one JSON object: how each
request ended, how long it all took, the slowest control call to the router (ListWorkers) and to the worker
(GetLoad) timed from a process of their own while the burst runs (a held-up event loop shows there), and the
worker's down marks in the router's log.

`python scripts/bench_router_burst.py [--requests 1500] [--image-mb 2]` (about 80 s on 2 cores). On 2 cores before
c91b19f this burst marked the live worker down and ended 167-521 of 1,500 requests in ERROR (benchmarks/README.md,
"Fourteenth pass").
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

import grpc.aio

from contract.transport import open_channel
from contract.wire import pb, pb_grpc
from lab.bench.load_test import Procs
from lab.plan.virtual import Workload
from router.client import RouterClient

PROBE_INTERVAL_S = 0.2


async def probe(stubs: dict, seconds: float) -> dict:
    """The slowest ListWorkers (router) and GetLoad (worker) calls over `seconds`, one every PROBE_INTERVAL_S."""
    calls = {"router": lambda: stubs["router"].ListWorkers(pb.Empty(), timeout=60),
             "worker": lambda: stubs["worker"].GetLoad(pb.Empty(), timeout=60)}
    slowest = {name: 0.0 for name in calls}
    failed = {name: 0 for name in calls}
    end = time.monotonic() + seconds

    async def loop(name: str) -> None:
        while time.monotonic() < end:
            started = time.monotonic()
            try:
                await calls[name]()
            except grpc.aio.AioRpcError:
                failed[name] += 1
            slowest[name] = max(slowest[name], time.monotonic() - started)
            await asyncio.sleep(PROBE_INTERVAL_S)

    await asyncio.gather(*(loop(name) for name in calls))
    return {**{f"{name}_slowest_call_s": round(value, 3) for name, value in slowest.items()},
            **{f"{name}_failed_calls": count for name, count in failed.items()}}


async def burst(requests: int, image_mb: float) -> dict:
    procs = Procs()
    router_log = Path(tempfile.mkdtemp(prefix="router-burst-")) / "router.log"
    try:
        (line,) = procs.start(["-m", "router", "--listen", "127.0.0.1:0", "--policy", "least_loaded",
                               "--log-level", "INFO"], log=router_log)
        address = line.split()[-1]
        procs.start(["-m", "lab.bench.router_ceiling", "--serve-workers", address, "--workers", "1", "--hardware",
                     "h200", "--simulation", json.dumps({"model": "qwen3-vl-30b-a3b"})])
        prompt = Workload().prompt().token_ids
        image = os.urandom(int(image_mb * 1e6))
        outcomes: collections.Counter[str] = collections.Counter()
        errors: dict[str, str] = {}  # the first RPC error of each code, as gRPC's core describes it
        async with RouterClient(address) as client:
            await client.wait_for_workers(1, timeout=120)
            worker = (await client.list_workers()).workers[0].address

            async def one(i: int) -> None:
                request = pb.GenerateRequest(request_id=f"r{i}", prompt_token_ids=prompt, images=[image],
                                             sampling=pb.SamplingParams(use_model_defaults=True, max_tokens=45),
                                             stream_interval=16)
                final = "no final chunk"
                try:
                    async for chunk in client.generate(request):  # read to the call's end, as the SUT does
                        if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                            final = pb.FinishReason.Name(chunk.finish_reason)
                    outcomes[final] += 1
                except grpc.aio.AioRpcError as exc:
                    outcomes[exc.code().name] += 1
                    errors.setdefault(exc.code().name, exc.debug_error_string())

            prober = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "lab.bench.router_burst", "--probe", address, worker,
                stdout=asyncio.subprocess.PIPE, cwd=REPO)
            started = time.monotonic()
            await asyncio.gather(*(one(i) for i in range(requests)))
            seconds = time.monotonic() - started
            prober.terminate()
            probed, _ = await prober.communicate()
    finally:
        procs.stop()
    # the probe's windows: the slowest call of all, failures summed (None: the burst ended before its first window)
    probed_max: dict[str, float | None] = dict.fromkeys(
        ("router_slowest_call_s", "worker_slowest_call_s", "router_failed_calls", "worker_failed_calls"))
    for line in probed.decode().splitlines():
        for key, value in json.loads(line).items():
            before = probed_max.get(key) or 0
            probed_max[key] = max(before, value) if key.endswith("_s") else before + value
    log = router_log.read_text()
    return {
        "requests": requests, "image_mb": image_mb, "cpus": os.cpu_count(), "seconds": round(seconds, 1),
        "outcomes": dict(outcomes), "answered": outcomes["LENGTH"] + outcomes["STOP"],
        **probed_max,
        "worker_marked_down": log.count(" down: "),
        "router_saw_cancelled_calls": log.count("call was cancelled"),
        "first_rpc_error_by_code": errors,
    }


async def run_probe(router: str, worker: str) -> None:
    """Prints each window's slowest calls and failures (one JSON line a window), until terminated."""
    stubs = {"router": pb_grpc.RouterServiceStub(open_channel(router)),
             "worker": pb_grpc.WorkerServiceStub(open_channel(worker))}
    while True:
        print(json.dumps(await probe(stubs, 1.0)), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--image-mb", type=float, default=2.0)
    parser.add_argument("--probe", nargs=2, metavar=("ROUTER", "WORKER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        asyncio.run(run_probe(*args.probe))
        return
    print(json.dumps(asyncio.run(burst(args.requests, args.image_mb))))



if __name__ == "__main__":  # the burst's probe runs as `python -m lab.bench.router_burst --probe`
    main()
