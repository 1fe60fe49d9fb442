"""`python -m router --listen 127.0.0.1:50051 [--http 127.0.0.1:8000] [--config router.yaml]`.

Prints the bound address(es) on one line each, serves until SIGTERM/SIGINT, then shuts down cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys

from contract import event_loop
from router.config import RouterConfig, load_router_config, parse_router_config
from router.server import RouterServer

GC_THRESHOLD = (20_000, 20, 20)  # the collector's generation thresholds in the router process (Python's: 700, 10, 10)


def parse_args(argv: list[str] | None) -> tuple[RouterConfig, str]:
    parser = argparse.ArgumentParser(prog="python -m router", description="The q3vl gRPC router.")
    parser.add_argument("--config", help="router YAML (router.config.RouterConfig)")
    parser.add_argument("--listen", help="gRPC host:port (overrides the config)")
    parser.add_argument("--http", dest="http_listen", help="OpenAI-compatible HTTP host:port (overrides the config)")
    parser.add_argument("--token", help="shared secret (overrides the config)")
    parser.add_argument("--policy", choices=["round_robin", "least_loaded", "kv_aware"])
    parser.add_argument("--worker-transport", choices=["call", "stream"], help="overrides the config")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    overrides = {"listen": args.listen, "http_listen": args.http_listen, "token": args.token,
                 "worker_transport": args.worker_transport}
    try:
        if args.config:
            config = load_router_config(args.config, **overrides)
        else:
            config = parse_router_config({k: v for k, v in overrides.items() if v is not None}, "command line")
        if args.policy:
            config = config.model_copy(update={"policy": config.policy.model_copy(update={"name": args.policy})})
    except (OSError, ValueError) as exc:
        parser.exit(2, f"error: {exc}\n")
    return config, args.log_level


async def serve(config: RouterConfig) -> None:
    server = RouterServer(config)
    await server.start()
    print(f"router listening on {server.address}", flush=True)
    if server.http_port is not None:
        host = config.http_listen.rpartition(":")[0]
        print(f"router http on {host}:{server.http_port}", flush=True)
    # What start-up made (the tokenizer's tables, grpc's and aiohttp's modules, the config) lives as long as the
    # process: frozen out of the collector's generations, a full collection under load no longer walks it. And the
    # youngest generation is collected every GC_THRESHOLD[0] allocations instead of 700: a request's objects live
    # for its ~ms, so at 700 each collection found the 64 in flight and walked them again as they were promoted
    # (gc_collect_main was 5.6% of the process's samples under bench_router's HTTP load, 0.8% with this).
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
    logging.getLogger("router").info("start-up objects frozen out of the garbage collector: %d; thresholds %s",
                                     gc.get_freeze_count(), gc.get_threshold())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


def main(argv: list[str] | None = None) -> None:
    config, log_level = parse_args(argv)
    logging.basicConfig(level=log_level, stream=sys.stderr)
    event_loop.run(serve(config))


if __name__ == "__main__":
    main()
