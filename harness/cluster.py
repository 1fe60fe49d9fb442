"""Brings a system up and down: the router as its own process (`python -m router`), the workers as Ray
actors, then waits until every worker is registered, healthy and warm (one request each) before LoadGen."""

from __future__ import annotations

import asyncio
import io
import logging
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc.aio
import ray
import yaml
from PIL import Image

from harness.ray_workers import WorkerFleet, WorkerSpec, engine_factory_for, init_ray
from harness.system_config import SystemConfig, engine_config, router_config
from router.client import RouterClient
from router.transport import call_metadata, open_channel
from router.wire import pb, pb_grpc
from workers.chat import encode_chat
from workers.tokenizer import load_tokenizer
from workers.types import PromptInput

logger = logging.getLogger(__name__)

ROUTER_START_TIMEOUT_S = 60.0
WARMUP_MAX_TOKENS = 4


class RouterProcess:
    """`python -m router --config <run_dir>/router.yaml`, its output in <run_dir>/router.log."""

    def __init__(self, config: SystemConfig, run_dir: Path) -> None:
        self._config = router_config(config, "127.0.0.1:0")
        self._run_dir = run_dir
        self._process: subprocess.Popen | None = None
        self.address = ""

    @property
    def token(self) -> str | None:
        return self._config.token

    def start(self) -> str:
        self._run_dir.mkdir(parents=True, exist_ok=True)
        conf = self._run_dir / "router.yaml"
        conf.write_text(yaml.safe_dump(self._config.model_dump(mode="json", exclude_none=True)))
        log = (self._run_dir / "router.log").open("ab")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "router", "--config", str(conf), "--log-level", "INFO"],
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,  # Ctrl-C in the terminal reaches the harness, which stops the router
        )
        log.close()
        line = _read_line(self._process, ROUTER_START_TIMEOUT_S)
        prefix = "router listening on "
        if not line.startswith(prefix):
            self.stop()
            raise RuntimeError(f"router did not start (see {self._run_dir / 'router.log'}): {line or 'no output'}")
        self.address = line[len(prefix):].strip()
        return self.address

    def stop(self) -> None:
        if self._process is None or self._process.poll() is not None:
            return
        self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()


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


async def wait_until_registered(client: RouterClient, worker_ids: list[str], timeout_s: float) -> pb.WorkerList:
    """Polls ListWorkers until every expected worker is registered and healthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        listing = await client.list_workers()
        healthy = {w.worker_id for w, ok in zip(listing.workers, listing.healthy) if ok}
        missing = sorted(set(worker_ids) - healthy)
        if not missing:
            return listing
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers not registered and healthy after {timeout_s:g} s: {', '.join(missing)}")
        await asyncio.sleep(0.2)


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


async def warm_up(client: RouterClient, listing: pb.WorkerList, token: str | None, prompt: PromptInput) -> None:
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
    await _drain(client.generate(_warmup_request("warmup-router", prompt)), "the router")


class Cluster:
    """Context manager: router process + Ray worker fleet, registered, healthy and warm inside the block."""

    def __init__(self, config: SystemConfig, checkpoint: Path, run_dir: Path, ray_address: str | None,
                 ready_timeout_s: float = 900.0) -> None:
        self._config = config
        self._checkpoint = checkpoint
        self._run_dir = run_dir
        self._ray_address = ray_address
        self._ready_timeout_s = ready_timeout_s
        self._router = RouterProcess(config, run_dir)
        self._fleet: WorkerFleet | None = None
        self._connected_ray = False

    @property
    def router_address(self) -> str:
        return self._router.address

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
        logger.info("starting the router")
        address = self._router.start()
        logger.info("router listening on %s; starting Ray", address)
        self._connected_ray = init_ray(self._config.ray, self._ray_address)
        template = WorkerSpec(
            worker_id="",
            role="aggregated",
            router_address=address,
            router_token=self._router.token,
            engine_factory=engine_factory_for(engine),
            model_name=str(self._checkpoint),
            kv_block_size=engine.block_size,
            max_model_len=engine.max_model_len,
            heartbeat_interval_s=router_config(self._config, address).health.heartbeat_interval_s,
        )
        self._fleet = WorkerFleet(self._config.workers.pools, template)
        logger.info("starting %d workers", self._config.workers.num_workers)
        self._fleet.start()
        self._fleet.addresses(self._ready_timeout_s)  # every engine built
        asyncio.run(self._wait_ready(engine))

    async def _wait_ready(self, engine) -> None:
        client = RouterClient(self._router.address, self._router.token)
        try:
            listing = await wait_until_registered(client, self._fleet.worker_ids, self._ready_timeout_s)
            logger.info("%d workers registered and healthy; warming up", len(listing.workers))
            await warm_up(client, listing, self._router.token, warmup_prompt(engine.min_pixels, engine.max_pixels))
        except grpc.aio.AioRpcError as exc:
            raise RuntimeError(f"router at {self._router.address} failed: {exc.code().name}: {exc.details()}") from None
        finally:
            await client.close()

    def stop(self) -> None:
        """Idempotent: actors, Ray (stopped if embedded, disconnected if joined), then the router."""
        if self._fleet is not None:
            self._fleet.stop()
            self._fleet = None
        if self._connected_ray and ray.is_initialized():
            ray.shutdown()
            self._connected_ray = False
        self._router.stop()
