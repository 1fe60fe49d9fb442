"""Brings a system up and down: the router as its own process (`python -m router`), the workers as Ray
actors, then waits until every worker is registered, healthy and warm (one request each) before LoadGen.

With router.mode embedded the cluster also holds the address where each LoadGen test process's own router listens
(harness/embedded_routing.py), and every worker registers there as well as with the router process."""

from __future__ import annotations

import asyncio
import functools
import io
import logging
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import grpc.aio
import ray
import yaml
from PIL import Image

from contract.chat import encode_chat
from contract.tokenizer import load_tokenizer
from contract.transport import call_metadata, open_channel
from contract.types import PromptInput
from contract.wire import pb, pb_grpc
from harness.embedded_routing import ReservedAddress
from harness.interrupts import deferred
from harness.ray_workers import (
    RaySession,
    ServedEngine,
    WorkerFleet,
    WorkerSpec,
    engine_factory_for,
    init_ray,
    simulated_factory_for_pool,
)
from harness.system_config import (
    PoolSection,
    SystemConfig,
    engine_config,
    router_config,
    simulation_config,
    worker_settings,
)
from router.client import RouterClient, wait_for_workers
from router.shards import ShardedRouterClient, connect_router
from workers.config import EngineConfig

logger = logging.getLogger(__name__)

ROUTER_START_TIMEOUT_S = 60.0
ROUTER_POLL_S = 0.5
MAX_ROUTER_RESTARTS = 5
WARMUP_MAX_TOKENS = 4
RAY_LOG = "ray.log"  # Ray's own log lines of the run, beside router.log (harness.ray_log)
SIMULATED_CPUS_PER_PROCESS = 0.01  # simulated workers sleep; they must not claim the cores LoadGen needs


class RouterProcess:
    """`python -m router --config <run_dir>/router.yaml`, its output in <run_dir>/router.log.

    Supervised once started: if it dies, it is started again on the same address (workers re-register,
    the SUT re-sends what was not answered), up to MAX_ROUTER_RESTARTS times.
    """

    def __init__(self, config: SystemConfig, run_dir: Path) -> None:
        self._system = config
        self._config = router_config(config, "127.0.0.1:0")
        self._run_dir = run_dir
        self._process: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.address = ""
        self.restarts = 0

    @property
    def token(self) -> str | None:
        return self._config.token

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> str:
        self.address = self._launch(self._config)
        self._supervisor = threading.Thread(target=self._supervise, name="router-supervisor", daemon=True)
        self._supervisor.start()
        return self.address

    def _launch(self, config) -> str:
        self._run_dir.mkdir(parents=True, exist_ok=True)
        conf = self._run_dir / "router.yaml"
        conf.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
        with deferred(), (self._run_dir / "router.log").open("ab") as log:  # a signal in Popen would lose the child
            self._process = subprocess.Popen(
                [sys.executable, "-m", "router", "--config", str(conf), "--log-level", "INFO"],
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,  # Ctrl-C in the terminal reaches the harness, which stops the router
            )
        line = _read_line(self._process, ROUTER_START_TIMEOUT_S)
        prefix = "router listening on "
        if not line.startswith(prefix):
            self._terminate()
            raise RuntimeError(f"router did not start (see {self._run_dir / 'router.log'}): {line or 'no output'}")
        return line[len(prefix):].strip()

    def _supervise(self) -> None:
        while not self._stopping.wait(ROUTER_POLL_S):
            process = self._process
            if process is None or process.poll() is None:
                continue
            if self.restarts >= MAX_ROUTER_RESTARTS:
                logger.error("router exited with status %s; not restarting it again (%d restarts)",
                             process.returncode, self.restarts)
                return
            self.restarts += 1
            logger.warning("router exited with status %s; restarting it on %s (restart %d)",
                           process.returncode, self.address, self.restarts)
            self._close_stdout(process)
            try:
                self._launch(router_config(self._system, self.address))
            except Exception as exc:  # e.g. the port was taken meanwhile: the next poll tries again
                logger.error("router restart failed: %s", exc)

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join()
            self._supervisor = None
        self._terminate()

    def _terminate(self) -> None:
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._close_stdout(process)

    @staticmethod
    def _close_stdout(process: subprocess.Popen) -> None:
        if process.stdout is not None:
            process.stdout.close()


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    """The first stdout line of `process`, or "" when it exits or stays silent for timeout_s."""
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return lines[0].decode(errors="replace").strip() if lines else ""


def warmup_prompt(min_pixels: int, max_pixels: int) -> PromptInput:
    """A short chat with one small image: exercises the vision tower and the text tower of every worker."""
    image = io.BytesIO()
    Image.new("RGB", (256, 256), (200, 120, 40)).save(image, format="PNG")
    messages = [{"role": "user", "content": [
        {"type": "image", "image": image.getvalue()},
        {"type": "text", "text": "Describe this product in one word."},
    ]}]
    return encode_chat(messages, load_tokenizer(), min_pixels=min_pixels, max_pixels=max_pixels)


def _warmup_request(request_id: str, prompt: PromptInput) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt.token_ids,
        images=prompt.images,
        sampling=pb.SamplingParams(use_model_defaults=True, max_tokens=WARMUP_MAX_TOKENS),
    )


async def _drain(stream, what: str) -> None:
    async for chunk in stream:
        if chunk.finish_reason == pb.ERROR:
            raise RuntimeError(f"warm-up request to {what} failed: {chunk.error}")


async def warm_up(client: RouterClient | ShardedRouterClient, listing: pb.WorkerList, token: str | None, prompt: PromptInput) -> None:
    """One request straight to each worker, then one through the router (the path LoadGen will use)."""
    metadata = call_metadata(token)
    for worker in listing.workers:
        channel = open_channel(worker.address)
        try:
            stub = pb_grpc.WorkerServiceStub(channel)
            stream = stub.Generate(_warmup_request(f"warmup-{worker.worker_id}", prompt), metadata=metadata)
            await _drain(stream, f"worker {worker.worker_id}")
        finally:
            await channel.close()
    shards = client.shards if isinstance(client, ShardedRouterClient) else [client]
    for k, shard in enumerate(shards):
        await _drain(shard.generate(_warmup_request(f"warmup-router-{k}", prompt)), f"router {shard.address}")


def parallel_engine_factory(engine: EngineConfig, pool: PoolSection) -> Callable[[], ServedEngine]:
    """The pool's layout decides the engine's: tp ranks over the actor's GPUs, experts split whole when ep == tp > 1."""
    layout = {"tensor_parallel_size": pool.tp, "expert_parallel": pool.ep > 1}
    return engine_factory_for(EngineConfig.model_validate({**engine.model_dump(), **layout}))


class Cluster:
    """Context manager: router process + Ray worker fleet, registered, healthy and warm inside the block."""

    def __init__(self, config: SystemConfig, checkpoint: Path, run_dir: Path, ray_address: str | None,
                 ready_timeout_s: float = 900.0) -> None:
        self._config = config
        self._checkpoint = checkpoint
        self._run_dir = run_dir
        self._ray_address = ray_address
        self._ready_timeout_s = ready_timeout_s
        shards = config.router_shards
        self._routers = [RouterProcess(config, run_dir if shards == 1 else run_dir / f"router-{k}") for k in range(shards)]
        self._fleet: WorkerFleet | None = None
        self._ray: RaySession | None = None
        self._embedded: ReservedAddress | None = None

    @property
    def router_address(self) -> str:
        """The router's address; comma-separated addresses when the router is sharded."""
        return ",".join(router.address for router in self._routers)

    @property
    def embedded_router_address(self) -> str | None:
        """With router.mode embedded: where the LoadGen test processes' routers listen for the workers."""
        return None if self._embedded is None else self._embedded.address

    @property
    def router_token(self) -> str | None:
        return self._routers[0].token

    def __enter__(self) -> Cluster:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self) -> None:
        engine = engine_config(self._config, self._checkpoint)
        logger.info("starting Ray")
        self._ray = init_ray(self._config.ray, self._ray_address, log_file=self._run_dir / RAY_LOG)
        have = ray.cluster_resources()
        simulated = self._config.model.simulated_hardware
        if simulated is None:
            self._config.workers.check_fits(have.get("GPU", 0), have.get("CPU", 0), "the Ray cluster")
        logger.info("starting %d router process(es)", len(self._routers))
        addresses = [router.start() for router in self._routers]
        address = addresses[0]
        logger.info("router listening on %s", self.router_address)
        if self._config.router_mode == "embedded":  # one router process (the config says so): workers report to both
            self._embedded = ReservedAddress()
            addresses = [f"{address},{self._embedded.address}"]
            logger.info("LoadGen's tests route in their own process; workers register at %s too",
                        self._embedded.address)
        template = WorkerSpec(worker_settings(self._config, self._checkpoint, address, self.router_token),
                              engine_factory_for(engine))
        if simulated is None:
            self._fleet = WorkerFleet(self._config.workers.pools, template, router_addresses=addresses,
                                      factory_for_pool=functools.partial(parallel_engine_factory, engine))
        else:  # model-free workers timed by workers.sim: many per process, no GPUs
            sim = simulation_config(self._config)
            self._fleet = WorkerFleet(
                self._config.workers.pools, template, factory_for_pool=simulated_factory_for_pool(engine, sim, simulated),
                workers_per_actor=sim.workers_per_process, use_gpus=False, cpus_per_actor=SIMULATED_CPUS_PER_PROCESS,
                router_addresses=addresses,
            )
        logger.info("starting %d workers", self._config.workers.num_workers)
        self._fleet.start()
        self._fleet.addresses(self._ready_timeout_s)  # every engine built
        asyncio.run(self._wait_ready(engine))

    async def _wait_ready(self, engine) -> None:
        client = connect_router(self.router_address, self.router_token)
        try:
            listing = await wait_for_workers(client, worker_ids=self._fleet.worker_ids, timeout_s=self._ready_timeout_s,
                                             poll_s=0.2, where=self.router_address)
            logger.info("%d workers registered and healthy; warming up", len(listing.workers))
            await warm_up(client, listing, self.router_token, warmup_prompt(engine.min_pixels, engine.max_pixels))
        except grpc.aio.AioRpcError as exc:
            raise RuntimeError(f"router at {self.router_address} failed: {exc.code().name}: {exc.details()}") from None
        finally:
            await client.close()

    def kv_link_transfers(self) -> dict[str, int]:
        """worker_id -> KV transfers over the workers' kv link (empty without one)."""
        return self._fleet.kv_link_transfers() if self._fleet is not None else {}

    def stop(self) -> None:
        """Idempotent: actors, Ray (stopped and its session files removed if embedded, disconnected if joined),
        then the router; each runs even if the one before it failed. A signal meanwhile (a second Ctrl-C) is
        delivered once all of it is done, never in the middle."""
        with deferred():
            try:
                if self._fleet is not None:
                    self._fleet.stop()
                    self._fleet = None
            finally:
                try:
                    if self._ray is not None:
                        self._ray, session = None, self._ray
                        session.close()
                finally:
                    for router in self._routers:
                        router.stop()
                    if self._embedded is not None:
                        self._embedded, reserved = None, self._embedded
                        reserved.close()
