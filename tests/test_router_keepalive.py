"""gRPC keepalive: a router, its worker and its client, all pinging every second, keep their connections through
streams and idle stretches many keepalive periods long, and no server answers a ping with GOAWAY "too_many_pings".

The periods come from one setting (contract.network.KeepaliveConfig) so that this runs in seconds; the servers'
ping policy (contract.transport.server_options) takes any rate. Before that policy, the servers allowed one ping
per 10 s without data, and a one-second keepalive lost its connection within a few idle seconds.
"""

from __future__ import annotations

import asyncio

import grpc

from contract.network import KeepaliveConfig
from router.client import RouterClient
from tests.helpers.router_fixtures import Cluster, collect, request, run

KEEPALIVE = KeepaliveConfig(time_s=1.0, timeout_s=1.0)
PERIODS = 4  # each stretch lasts this many keepalive periods


async def states_over(channels: list[grpc.aio.Channel], seconds: float) -> set:
    """Every connectivity state the channels pass through in `seconds` (sampled ten times a keepalive period)."""
    seen = set()
    for _ in range(round(seconds / (KEEPALIVE.time_s / 10))):
        seen |= {channel.get_state() for channel in channels}
        await asyncio.sleep(KEEPALIVE.time_s / 10)
    return seen


def test_connections_outlive_several_keepalive_periods_streaming_and_idle_without_goaway(capfd):
    async def body():
        config = {"keepalive": KEEPALIVE.model_dump()}
        # a stream of 4 * PERIODS engine steps spans PERIODS keepalive periods
        async with Cluster(roles=(), config=config, step_delay_s=KEEPALIVE.time_s / 4) as c:
            await c.add_worker("w0", keepalive=KEEPALIVE)
            async with RouterClient(c.router.address, keepalive=KEEPALIVE) as client:
                await client.wait_for_workers(1)
                await collect(client.generate(request("connect", max_tokens=1)))  # channels connect on first use
                channels = [client._channel, c.router.registry.get("w0").channel]
                streaming = asyncio.ensure_future(collect(client.generate(request("long", max_tokens=4 * PERIODS))))
                during_stream = await states_over(channels, PERIODS * KEEPALIVE.time_s)
                tokens, _ = await streaming
                idle = await states_over(channels, PERIODS * KEEPALIVE.time_s)
                after, _ = await collect(client.generate(request("after", max_tokens=2)))
            assert len(tokens) == 4 * PERIODS and len(after) == 2
            assert during_stream == idle == {grpc.ChannelConnectivity.READY}  # never reconnected
            assert c.router.registry.get("w0").healthy
            assert c.router.dispatcher.metrics.summary().endswith("migrations 0; rejections 0")

    run(body(), timeout=60)
    assert "too_many_pings" not in capfd.readouterr().err
