"""A prefill WorkerServer and a decode WorkerServer joined by a KvLink (gloo on CPU; NCCL between GPUs): the
prefill worker sends each KV over the link, the decode worker takes it from there, greedy tokens equal the
aggregated path's, also when decode requests come in another order than their prefills."""

from __future__ import annotations

import concurrent.futures
import io
import socket

import grpc
import grpc.aio
import numpy as np
import pytest
from PIL import Image

from contract.transport import open_channel
from contract.wire import pb, pb_grpc
from tests.helpers.router_fixtures import collect, run
from workers.config import EngineConfig, KvLinkConfig
from workers.engine import LLMEngine
from workers.serve.async_engine import AsyncEngine
from workers.serve.kv_transfer import KvLink
from workers.serve.server import WorkerServer
from workers.serve.worker_build import WorkerSettings
from workers.sim.instant_engine import InstantEngine


def image_bytes() -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (70, 90, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


# 70x90 with min_pixels 4096 resizes to 64x96: 2 x 3 = 6 visual tokens.
REQUESTS = {
    "image": ([151644, 872, 198, 151652] + [151655] * 6 + [151653, 3838, 374, 151645, 198], [image_bytes()]),
    "text": ([151644, 872, 198, 3838, 374, 1000, 2000, 3000, 151645, 198], []),
}


def greedy(rid: str, max_tokens: int, **kw) -> pb.GenerateRequest:
    ids, images = REQUESTS[rid.split("-")[0]]
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=ids, images=images,
                              sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens), **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LinkedPair:
    """Two engines on the CPU, each served by a WorkerServer, joined by a gloo KvLink."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint

    def engine(self) -> AsyncEngine:
        return AsyncEngine(LLMEngine.from_config(EngineConfig(checkpoint=self.checkpoint, num_kv_blocks=64, block_size=4,
                                                              max_model_len=256, min_pixels=4096, max_pixels=65536)))

    async def __aenter__(self):
        port = free_port()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # each end waits for the other to connect
            links = list(pool.map(lambda role: KvLink(KvLinkConfig("127.0.0.1", port, role, "cpu", timeout_s=60)),
                                  ("prefill", "decode")))
        self.engines = [self.engine(), self.engine()]
        self.servers = [WorkerServer(e, WorkerSettings(f"w-{role}", role), kv_link=link)
                        for e, role, link in zip(self.engines, ("prefill", "decode"), links)]
        for server in self.servers:
            await server.start()
        self.channels = [open_channel(s.address) for s in self.servers]
        self.prefill, self.decode = (pb_grpc.WorkerServiceStub(c) for c in self.channels)
        return self

    async def __aexit__(self, *exc):
        for channel in self.channels:
            await channel.close()
        for server, engine in zip(self.servers, self.engines):
            await server.stop(0)
            engine.shutdown()


async def prefill(pair: LinkedPair, rid: str) -> pb.GenerateChunk:
    _, chunks = await collect(pair.prefill.Generate(greedy(rid, 1, prefill_only=True)))
    return chunks[-1]


async def decode(pair: LinkedPair, rid: str, last: pb.GenerateChunk, max_tokens: int) -> list[int]:
    req = greedy(rid, max_tokens)
    req.kv_handle.CopyFrom(last.kv_handle)
    tokens, _ = await collect(pair.decode.Generate(req, timeout=30))
    return list(last.token_ids) + tokens


def test_kv_sent_over_the_link_decodes_to_the_aggregated_greedy_tokens_in_any_claim_order(tiny_moe_checkpoint):
    async def body():
        async with LinkedPair(tiny_moe_checkpoint) as pair:
            reference = {rid: (await collect(pair.prefill.Generate(greedy(rid, 8))))[0] for rid in REQUESTS}
            firsts = {rid: await prefill(pair, f"{rid}-pd") for rid in REQUESTS}  # sent as transfers 0, 1
            for last in firsts.values():
                assert last.kv_handle.transport_hint and last.finish_reason == pb.LENGTH
            assert not pair.engines[0].engine.scheduler.held  # sent at once: the prefill engine holds no KV
            for rid in reversed(REQUESTS):  # claimed 1, then 0
                assert await decode(pair, f"{rid}-pd", firsts[rid], 7) == reference[rid]

    run(body(), timeout=90)


def test_a_handle_announcing_another_link_is_unavailable_so_the_router_replays_it(tiny_moe_checkpoint):
    async def body():
        async with LinkedPair(tiny_moe_checkpoint) as pair:
            last = await prefill(pair, "text-a")
            other = free_port()
            last.kv_handle.transport_hint = last.kv_handle.transport_hint.replace(
                str(pair.servers[1].kv_link.config.port).encode(), str(other).encode())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await decode(pair, "text-a", last, 4)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "kv link" in err.value.details()

    run(body(), timeout=90)


def test_a_link_whose_role_differs_from_the_worker_role_is_refused():
    class Link:
        config = KvLinkConfig("127.0.0.1", 1, "decode", "cpu")

    with pytest.raises(ValueError, match="kv_link role"):
        WorkerServer(InstantEngine(), WorkerSettings("w", "prefill"), kv_link=Link())
