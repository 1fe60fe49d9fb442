"""RouterServer: the gRPC RouterService (generate, abort, worker registration, heartbeats) plus grpc health.

Embeddable (`await start()`, `.port`, `await stop()`); also starts the OpenAI HTTP front end when configured.
router.embedded runs one inside a caller's process and calls its dispatcher directly.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from contract.network import split_host_port
from contract.transport import (
    add_listener, call_metadata, open_channel, server_interceptors, server_options, when_call_ends_unfinished,
)
from contract.wire import pb, pb_grpc
from router.config import RouterConfig
from router.dispatch import Dispatcher, RouterError
from router.registry import SERVING_ROLES, Registry

log = logging.getLogger(__name__)

SERVICE_NAME = "q3vl.v1.RouterService"


class RouterServicer(pb_grpc.RouterServiceServicer):
    def __init__(self, config: RouterConfig, registry: Registry, dispatcher: Dispatcher, on_registered):
        self.config = config
        self.registry = registry
        self.dispatcher = dispatcher
        self._on_registered = on_registered  # async callback: health must say SERVING as soon as a worker is in

    async def Generate(self, request, context):
        chunks = 0
        ended = False  # the final chunk was sent
        stream = self.dispatcher.generate(request, context.time_remaining())
        # a generator left suspended at its yield would hold the admission slot and the worker's call until collected
        when_call_ends_unfinished(context, lambda: ended, lambda: _close_stream(stream))
        try:
            async for chunk in stream:
                chunks += 1
                ended = chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                yield chunk
        except RouterError as exc:
            await context.abort(exc.code, exc.message)
        except asyncio.CancelledError:  # the caller cancelled, or its transport did: say which request, and when
            log.warning("request %s: the caller's call was cancelled after %d chunks", request.request_id, chunks)
            raise

    async def Abort(self, request, context):
        return pb.AbortReply(found=await self.dispatcher.abort(request.request_id))

    async def RegisterWorker(self, request, context):
        try:
            self.registry.register(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.dispatcher.admission.notify()
        await self._on_registered()
        return pb.RegisterReply(accepted=True, heartbeat_interval_s=self.config.health.heartbeat_interval_s)

    async def Heartbeat(self, request, context):
        return pb.HeartbeatReply(known=self.registry.heartbeat(request))

    async def ListWorkers(self, request, context):
        return worker_list(self.registry)


async def _close_stream(stream) -> None:
    """Closes a dispatcher stream left suspended (its finally blocks free the slot and cancel the worker's call);
    one still running is being cancelled already."""
    with contextlib.suppress(RuntimeError):
        await stream.aclose()


def worker_list(registry: Registry) -> pb.WorkerList:
    """Every registered worker: its registration, last load report and whether it gets new work."""
    entries = registry.entries()
    return pb.WorkerList(
        workers=[e.info for e in entries], loads=[e.report for e in entries], healthy=[e.healthy for e in entries]
    )


class RouterServer:
    def __init__(self, config: RouterConfig | None = None):
        self.config = config or RouterConfig()
        max_bytes, keepalive = self.config.limits.max_message_bytes, self.config.keepalive
        self.registry = Registry(  # no gRPC retries on the workers' channels: the dispatcher migrates failed calls
            self.config.health, self.config.policy.block_size,
            lambda address: open_channel(address, max_message_bytes=max_bytes, keepalive=keepalive, retries=False),
        )
        self.dispatcher = Dispatcher(self.config, self.registry)
        self.port = 0
        self.http_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._monitor: asyncio.Task | None = None
        self._http = None

    @property
    def address(self) -> str:
        host, _ = split_host_port(self.config.listen)
        return f"{host}:{self.port}"

    async def start(self) -> None:
        config = self.config
        self._server = grpc.aio.server(
            interceptors=server_interceptors(config.token), options=server_options(config.limits.max_message_bytes)
        )
        pb_grpc.add_RouterServiceServicer_to_server(RouterServicer(config, self.registry, self.dispatcher, self._update_health), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = add_listener(self._server, config.listen, config.tls)
        await self._server.start()
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._update_health()
        self._monitor = asyncio.get_running_loop().create_task(self._watch_workers())
        if config.http_listen:
            from router.openai_http import HttpFrontend  # aiohttp and the tokenizer only when asked for

            self._http = HttpFrontend(config, self.dispatcher, self.registry)
            self.http_port = await self._http.start()
        log.info("router listening on %s (policy %s)", self.address, config.policy.name)

    async def stop(self, grace: float = 1.0) -> None:
        log.info("router %s served %s", self.address, self.dispatcher.metrics.summary())
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        if self._http is not None:
            await self._http.stop()
        if self._server is not None:
            await self._health.enter_graceful_shutdown()
            await self._server.stop(grace)
        await self.dispatcher.close()
        await self.registry.close()

    async def _watch_workers(self) -> None:
        """Every half heartbeat interval: mark silent or stalled workers down, optionally poll their load. How late
        this loop wakes up measures how long the event loop was held (a burst of large requests can hold it for
        seconds); the heartbeats that arrived meanwhile may not be handled yet, so the latest down_after_s of such
        delays is the check's grace."""
        interval = self.config.health.heartbeat_interval_s / 2
        metadata = call_metadata(self.config.token)
        delays: collections.deque[tuple[float, float]] = collections.deque()  # (when, how late the wake-up was)
        while True:
            due = time.monotonic() + interval
            await asyncio.sleep(interval)
            now = time.monotonic()
            delays.append((now, now - due))
            while delays[0][0] < now - self.config.health.down_after_s:
                delays.popleft()
            if self.config.health.poll_load:
                for entry in self.registry.entries():
                    with contextlib.suppress(grpc.aio.AioRpcError):
                        self.registry.heartbeat(await entry.stub.GetLoad(pb.Empty(), metadata=metadata, timeout=interval))
            self.registry.check(grace_s=max(delay for _, delay in delays))
            await self._update_health()
            self.dispatcher.admission.notify()

    async def _update_health(self) -> None:
        serving = bool(self.registry.healthy(SERVING_ROLES))
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set(SERVICE_NAME, status)
