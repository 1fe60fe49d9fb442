"""Keeping a worker known to its router: RegisterWorker once (and again whenever the router forgets it), then a
Heartbeat carrying the engine's load every interval, for as long as the worker serves.

A worker may report to several routers at once (`router_addresses`): the router process, and with the harness's
router.mode embedded, the router inside the LoadGen SUT's process too, which comes and goes with each test."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
import grpc.aio

from contract.network import KeepaliveConfig
from contract.transport import open_channel
from contract.types import EngineLoad
from contract.wire import pb, pb_grpc

log = logging.getLogger(__name__)


def router_addresses(addresses: str) -> list[str]:
    """'host:a,host:b' -> ['host:a', 'host:b']: the routers a worker registers with, one or more."""
    parts = [a.strip() for a in addresses.split(",") if a.strip()]
    if not parts:
        raise ValueError(f"no router address in {addresses!r}")
    return parts


def load_report(worker_id: str, load: EngineLoad) -> pb.LoadReport:
    """The engine's load as a heartbeat carries it."""
    return pb.LoadReport(
        worker_id=worker_id,
        waiting_requests=load.waiting_requests,
        running_requests=load.running_requests,
        queued_prompt_tokens=load.queued_prompt_tokens,
        free_kv_blocks=load.free_kv_blocks,
        total_kv_blocks=load.total_kv_blocks,
        active_kv_blocks=load.total_kv_blocks - load.free_kv_blocks,
        steps=load.steps,
    )


async def report_to_router(
    router_address: str,
    info: Callable[[], pb.WorkerInfo],
    report: Callable[[], pb.LoadReport],
    metadata: tuple,
    interval_s: float,
    max_message_bytes: int,
    after_each: Callable[[], Awaitable[None]],
    keepalive: KeepaliveConfig = KeepaliveConfig(),
) -> None:
    """Registers, then heartbeats every interval (the router's reply may set it) until cancelled; registers again
    whenever the router says it does not know the worker or cannot be reached. after_each runs once per interval
    (the worker's own periodic chores). A router that was away (restarted, or not started yet) is tried again
    every interval, not on gRPC's growing backoff, so the worker is back in its registry within about one."""
    async with open_channel(router_address, max_message_bytes=max_message_bytes, keepalive=keepalive,
                            reconnect_backoff_s=interval_s) as channel:
        stub = pb_grpc.RouterServiceStub(channel)
        registered = False
        while True:
            try:
                if not registered:
                    reply = await stub.RegisterWorker(info(), metadata=metadata, timeout=5)
                    interval_s = reply.heartbeat_interval_s or interval_s
                    registered = True
                registered = (await stub.Heartbeat(report(), metadata=metadata, timeout=5)).known
                if not registered:
                    continue
            except grpc.aio.AioRpcError as exc:
                log.info("worker %s: router %s unreachable (%s)", info().worker_id, router_address, exc.code())
                registered = False
            await after_each()
            await asyncio.sleep(interval_s)
