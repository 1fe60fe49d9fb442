"""ShardedRouterClient: RouterClient's interface over N router processes, each fronting its own subset of workers
(one Python router process carries ~150 req/s; an NVL72 at 2,323 QPS needs many). Requests go round-robin;
an abort goes to the shard that took the request."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

from contract.wire import pb
from router.client import RouterClient


def split_addresses(addresses: str) -> list[str]:
    """'host:a,host:b' -> ['host:a', 'host:b'] (the form a sharded router address travels in)."""
    parts = [a.strip() for a in addresses.split(",") if a.strip()]
    if not parts:
        raise ValueError(f"no router address in {addresses!r}")
    return parts


def connect_router(addresses: str, token: str | None = None, **kwargs) -> RouterClient | ShardedRouterClient:
    """A RouterClient for one address, a ShardedRouterClient for a comma-separated list."""
    parts = split_addresses(addresses)
    return RouterClient(parts[0], token, **kwargs) if len(parts) == 1 else ShardedRouterClient(parts, token, **kwargs)


class ShardedRouterClient:
    def __init__(self, addresses: list[str], token: str | None = None, **kwargs):
        self.shards = [RouterClient(address, token, **kwargs) for address in addresses]
        self.address = ",".join(addresses)
        self._next = itertools.cycle(self.shards)
        self._owner: dict[str, RouterClient] = {}

    async def generate(self, request: pb.GenerateRequest, timeout: float | None = None) -> AsyncIterator[pb.GenerateChunk]:
        shard = next(self._next)
        self._owner[request.request_id] = shard
        try:
            async for chunk in shard.generate(request, timeout):
                yield chunk
        finally:
            self._owner.pop(request.request_id, None)

    async def abort(self, request_id: str) -> bool:
        shard = self._owner.get(request_id)
        return False if shard is None else await shard.abort(request_id)

    async def list_workers(self) -> pb.WorkerList:
        """Every shard's workers in one list."""
        merged = pb.WorkerList()
        for shard in self.shards:
            listing = await shard.list_workers()
            merged.workers.extend(listing.workers)
            merged.healthy.extend(listing.healthy)
        return merged

    async def wait_for_workers(self, count_per_shard: int, timeout: float = 60.0) -> None:
        for shard in self.shards:
            await shard.wait_for_workers(count_per_shard, timeout)

    async def close(self) -> None:
        for shard in self.shards:
            await shard.close()

    async def __aenter__(self) -> ShardedRouterClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
