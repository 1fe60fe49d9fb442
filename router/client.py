"""RouterClient: the harness's handle on the router (generate stream, abort, list workers) over gRPC, and
wait_for_workers, the one wait for workers to register (on a RouterClient or a sharded one).

One channel per client, reused for every call; large messages allowed for inline images; keepalive on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection
from typing import Protocol

import grpc.aio

from contract.network import MIB, KeepaliveConfig
from contract.transport import call_metadata, open_channel
from contract.wire import pb, pb_grpc


class RouterClient:
    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        root_certificates: bytes | None = None,
        max_message_bytes: int = 64 * MIB,
        keepalive: KeepaliveConfig = KeepaliveConfig(),
    ):
        self.address = address
        self._channel: grpc.aio.Channel = open_channel(
            address, max_message_bytes=max_message_bytes, root_certificates=root_certificates, keepalive=keepalive
        )
        self._stub = pb_grpc.RouterServiceStub(self._channel)
        self._metadata = call_metadata(token)

    async def generate(self, request: pb.GenerateRequest, timeout: float | None = None) -> AsyncIterator[pb.GenerateChunk]:
        """Stream the request's chunks; leaving the loop early cancels the call (the router aborts upstream).

        Refusals arrive as grpc.aio.AioRpcError (RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ...).
        """
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()

    async def abort(self, request_id: str) -> bool:
        reply = await self._stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self._metadata)
        return reply.found

    async def list_workers(self) -> pb.WorkerList:
        return await self._stub.ListWorkers(pb.Empty(), metadata=self._metadata)

    async def wait_for_workers(self, count: int, timeout: float = 60.0, roles: tuple[int, ...] | None = None) -> None:
        """Wait until `count` healthy workers (of `roles`, default any) are registered."""
        await wait_for_workers(self, count=count, roles=roles, timeout_s=timeout, where=self.address)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> RouterClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class WorkerLister(Protocol):
    async def list_workers(self) -> pb.WorkerList: ...


async def wait_for_workers(
    client: WorkerLister, *, count: int = 0, worker_ids: Collection[str] = (), roles: tuple[int, ...] | None = None,
    timeout_s: float = 60.0, poll_s: float = 0.05, where: str = "the router",
) -> pb.WorkerList:
    """Polls ListWorkers until at least `count` workers (of `roles`, default any) and every one of `worker_ids` are
    registered and healthy, and returns that listing; TimeoutError after timeout_s says which are missing."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        listing = await client.list_workers()
        healthy = [w for w, ok in zip(listing.workers, listing.healthy) if ok and (roles is None or w.role in roles)]
        missing = sorted(set(worker_ids) - {w.worker_id for w in healthy})
        if len(healthy) >= count and not missing:
            return listing
        if loop.time() > deadline:
            short = [f"{len(healthy)} of {count} workers registered"] if len(healthy) < count else []
            short += [f"not registered and healthy: {', '.join(missing)}"] if missing else []
            raise TimeoutError(f"{'; '.join(short)} at {where} after {timeout_s:g} s")
        await asyncio.sleep(poll_s)
