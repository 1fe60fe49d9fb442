"""EmbeddedRouter: the router inside its caller's process, as Dynamo's frontend embeds its router.

It is router.server.RouterServer started in the caller's event loop: workers register with its listener and
heartbeat to it as they do to the router process, and registration, health, admission, the policies and migration
are the same code. Only the caller's requests skip the gRPC hop to it: generate() calls the dispatcher directly and
streams from the chosen worker, so a request crosses the network once.

It answers as router.client.RouterClient does, so a caller takes either: generate() streams GenerateChunk and
raises grpc.aio.AioRpcError with the status and message the router's gRPC service would have sent (a RouterError's),
and abort, list_workers, wait_for_workers and close behave alike.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import grpc.aio

from contract.wire import pb
from router.client import wait_for_workers
from router.config import RouterConfig
from router.dispatch import RouterError
from router.server import RouterServer, worker_list


def call_error(error: RouterError) -> grpc.aio.AioRpcError:
    """The error a RouterClient caller gets when the router's service aborts a call with `error`."""
    return grpc.aio.AioRpcError(error.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=error.message)


class EmbeddedRouter:
    """A RouterServer in this process's event loop, and a RouterClient's interface over its dispatcher."""

    def __init__(self, config: RouterConfig | None = None):
        self.server = RouterServer(config)

    @property
    def address(self) -> str:
        """Where workers register (the listener's bound address)."""
        return self.server.address

    async def start(self) -> None:
        await self.server.start()

    async def generate(self, request: pb.GenerateRequest, timeout: float | None = None
                       ) -> AsyncIterator[pb.GenerateChunk]:
        """Stream the request's chunks; leaving the loop early (or being cancelled) cancels the worker's request.

        The request is the dispatcher's from here on (it moves the images out once admitted). Refusals arrive as
        grpc.aio.AioRpcError (RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ...), as through RouterClient.
        """
        stream = self.server.dispatcher.generate(request, timeout)
        try:
            async for chunk in stream:
                yield chunk
        except RouterError as exc:
            raise call_error(exc) from None
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> bool:
        return await self.server.dispatcher.abort(request_id)

    async def list_workers(self) -> pb.WorkerList:
        return worker_list(self.server.registry)

    async def wait_for_workers(self, count: int, timeout: float = 60.0, roles: tuple[int, ...] | None = None) -> None:
        """Wait until `count` healthy workers (of `roles`, default any) are registered."""
        await wait_for_workers(self, count=count, roles=roles, timeout_s=timeout, where=f"the router at {self.address}")

    async def close(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)

    async def __aenter__(self) -> EmbeddedRouter:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
