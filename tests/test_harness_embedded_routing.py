"""router.mode embedded, the pieces a run shares: the address the cluster holds for the test processes' routers,
and workers that register with the router process and with a router that comes and goes at that address."""

from __future__ import annotations

import socket

import pytest

from harness.embedded_routing import ReservedAddress, embedded_routing, start_embedded_router
from router.config import parse_router_config
from tests.helpers.router_fixtures import FAST_HEALTH, Cluster, collect, request, run


def test_a_reserved_address_is_refused_to_others_and_taken_by_an_embedded_router():
    async def body(address: str) -> None:
        config = parse_router_config({"listen": address, "http_listen": "127.0.0.1:0"})
        router = await start_embedded_router(embedded_routing(config, workers=0))
        try:
            assert router.address == address
            assert router.server.http_port is None  # HTTP clients are the router process's
        finally:
            await router.close(0)

    with ReservedAddress() as reserved:
        host, port = reserved.address.rsplit(":", 1)
        with socket.socket() as other, pytest.raises(OSError):
            other.bind((host, int(port)))
        for _ in range(2):  # one test process after another
            run(body(reserved.address))


def test_workers_register_with_both_routers_and_with_one_started_after_them():
    async def body(address: str) -> None:
        async with Cluster(also_register_at=address) as c:  # nothing listens at `address` yet
            for attempt in range(2):  # the router of one LoadGen test, then the next one's
                config = parse_router_config({"health": FAST_HEALTH, "listen": address})
                router = await start_embedded_router(embedded_routing(config, workers=2))
                try:
                    listing = await router.list_workers()
                    assert sorted(w.worker_id for w in listing.workers) == ["w0", "w1"] and all(listing.healthy)
                    tokens, chunks = await collect(router.generate(request(f"r{attempt}")))
                    assert len(tokens) == 8 and chunks[-1].worker_id in {"w0", "w1"}
                finally:
                    await router.close(0)
            listing = await c.client.list_workers()  # the router process had them all along
            assert all(listing.healthy) and len(listing.workers) == 2

    with ReservedAddress() as reserved:
        run(body(reserved.address))
