"""RouterClient: the harness's handle on the router (generate stream, abort, list workers) over gRPC.

One channel per client, reused for every call; large messages allowed for inline images; keepalive on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc.aio

from router.config import MIB
from router.transport import call_metadata, open_channel
from router.wire import pb, pb_grpc


class RouterClient:
    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        root_certificates: bytes | None = None,
        max_message_bytes: int = 64 * MIB,
    ):
        self.address = address
        self._channel: grpc.aio.Channel = open_channel(
            address, max_message_bytes=max_message_bytes, root_certificates=root_certificates
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
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            listing = await self.list_workers()
            healthy = [w for w, ok in zip(listing.workers, listing.healthy) if ok and (roles is None or w.role in roles)]
            if len(healthy) >= count:
                return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{len(healthy)} of {count} workers registered at {self.address} after {timeout}s")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> RouterClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
