"""The bench's gRPC stand-in (lab/bench/constant_worker.py): it registers with a router like a worker and answers
every request, through the router's gRPC and HTTP front ends, with the same final chunk of fixed tokens, whether the
router reaches it with a call a request or on one stream."""

from __future__ import annotations

import aiohttp
import pytest

from contract.wire import pb
from lab.bench.constant_worker import TOKEN_ID, ConstantWorker
from router.client import RouterClient
from router.config import parse_router_config
from router.server import RouterServer
from tests.helpers.router_fixtures import request, run


@pytest.mark.parametrize("transport", ["call", "stream"])
def test_the_constant_worker_registers_and_answers_every_request_with_its_fixed_reply(transport):
    async def main():
        router = RouterServer(parse_router_config({"listen": "127.0.0.1:0", "http_listen": "127.0.0.1:0",
                                                   "policy": {"name": "round_robin"}, "worker_transport": transport}))
        await router.start()
        workers = [ConstantWorker(f"c{i}", router.address, output_tokens=5, heartbeat_interval_s=0.1)
                   for i in range(2)]
        try:
            for worker in workers:
                await worker.start()
            async with RouterClient(router.address) as client:
                await client.wait_for_workers(2, timeout=10)
                answers = [[c async for c in client.generate(request(rid, max_tokens=50))] for rid in "ab"]
            for streamed in answers:  # one final chunk, whatever was asked
                assert [list(c.token_ids) for c in streamed] == [[TOKEN_ID] * 5]
                assert streamed[-1].finish_reason == pb.LENGTH
            assert {a[-1].worker_id for a in answers} == {"c0", "c1"}  # round_robin: both registered and served
            url = f"http://127.0.0.1:{router.http_port}/v1/chat/completions"
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
            async with aiohttp.ClientSession() as session:
                replies = []
                for _ in range(2):
                    async with session.post(url, json=body) as resp:
                        assert resp.status == 200
                        replies.append(await resp.json())
            assert {r["usage"]["completion_tokens"] for r in replies} == {5}
            assert len({r["choices"][0]["message"]["content"] for r in replies}) == 1
        finally:
            for worker in workers:
                await worker.stop()
            await router.stop()

    run(main())
