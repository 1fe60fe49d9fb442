"""worker_transport stream: the router's requests to a worker share one bidirectional stream
(WorkerService.GenerateMultiplexed; router.worker_stream, workers.serve.multiplexed).

What a call a request gives each request, the stream gives it too: its own chunks, its own cancellation (the worker
aborts that request and no other), its own deadline (the router's and the worker's), and migration when the stream
fails under it. The behaviour every transport shares (streaming, limits, migration on a worker's death, ...) is in
test_router_server.py, which runs on both transports.
"""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest

from contract.multiplexed_wire import generate_entry
from contract.transport import call_metadata, open_channel, server_options
from contract.wire import pb, pb_grpc
from router.registry import MULTIPLEXED_METHOD
from tests.helpers.router_fixtures import TRANSPORTS, Cluster, collect, expected_tokens, request, run, wait_until
from workers.serve.multiplexed import RequestContext
from workers.serve.server import WorkerServicer

STREAM = {"worker_transport": "stream"}


@pytest.fixture
def served(monkeypatch):
    """How the workers' servicer was reached: 'stream' for each GenerateMultiplexed call, and per request served,
    whether through the stream or a call of its own."""
    seen = {"streams": 0, "on_stream": [], "own_call": []}
    multiplexed, generate = WorkerServicer.GenerateMultiplexed, WorkerServicer.Generate

    async def count_stream(self, request_iterator, context):
        seen["streams"] += 1
        await multiplexed(self, request_iterator, context)

    def note_request(self, request, context):
        seen["on_stream" if isinstance(context, RequestContext) else "own_call"].append(request.request_id)
        return generate(self, request, context)

    monkeypatch.setattr(WorkerServicer, "GenerateMultiplexed", count_stream)
    monkeypatch.setattr(WorkerServicer, "Generate", note_request)
    return seen


def test_many_concurrent_requests_share_one_stream_and_each_gets_its_own_tokens(served):
    async def body():
        async with Cluster(roles=("aggregated",), config=STREAM, step_delay_s=0.002) as c:
            reqs = [request(f"r{i}", prompt_len=10 + i, max_tokens=5 + i % 7, final_chunk_only=i % 2 == 0)
                    for i in range(40)]
            answers = await asyncio.gather(*(collect(c.client.generate(r)) for r in reqs))
            for req, (tokens, chunks) in zip(reqs, answers):
                assert tokens == expected_tokens(req)
                assert chunks[-1].finish_reason == pb.LENGTH and {ch.request_id for ch in chunks} == {req.request_id}
            assert served["streams"] == 1 and served["own_call"] == []
            assert sorted(served["on_stream"]) == sorted(f"{r.request_id}#1" for r in reqs)
            assert c.router.registry.entries()[0].inflight == 0

    run(body())


def test_a_request_the_caller_leaves_is_aborted_on_the_worker_and_the_others_on_its_stream_go_on(served):
    async def body():
        async with Cluster(roles=("aggregated",), config=STREAM, step_delay_s=0.02) as c:
            others = [asyncio.create_task(collect(c.client.generate(request(f"keep{i}", max_tokens=30))))
                      for i in range(3)]
            gone = c.client.generate(request("gone", max_tokens=30))
            await anext(gone)
            await gone.aclose()  # the caller goes away
            await wait_until(lambda: "gone#1" in c.engines[0].aborted)
            for i, task in enumerate(others):
                tokens, chunks = await task
                assert tokens == expected_tokens(request(f"keep{i}", max_tokens=30))
                assert chunks[-1].finish_reason == pb.LENGTH
            assert c.engines[0].aborted == ["gone#1"] and served["streams"] == 1

    run(body())


def test_a_stream_that_fails_under_its_requests_migrates_every_one_and_loses_or_repeats_no_token(served):
    async def body():
        async with Cluster(config=STREAM | {"policy": {"name": "round_robin"}}, step_delay_s=0.02) as c:
            reqs = [request(f"m{i}", max_tokens=30) for i in range(6)]
            streams = [c.client.generate(r) for r in reqs]
            firsts = [await anext(s) for s in streams]  # every request has its first tokens, on both workers
            victim = c.workers[0]
            on_victim = [i for i, f in enumerate(firsts) if f.worker_id == victim.worker_id]
            assert len(on_victim) == 3
            await victim._server.stop(0)  # its stream fails; it still heartbeats
            for i, stream in enumerate(streams):
                tokens, chunks = await collect(stream)
                assert list(firsts[i].token_ids) + tokens == expected_tokens(reqs[i])
                assert chunks[-1].finish_reason == pb.LENGTH and chunks[-1].worker_id == "w1"
            migrated = 'q3vl_router_migrations_total{kind="ongoing_request"} 3.0'
            assert migrated.encode() in c.router.dispatcher.metrics.render()
            await wait_until(lambda: {f"m{i}#1" for i in on_victim} <= set(c.engines[0].aborted))

    run(body())


def test_a_request_whose_deadline_passes_ends_deadline_exceeded_and_the_others_on_its_stream_go_on():
    async def body():
        async with Cluster(roles=("aggregated",), config=STREAM, step_delay_s=0.02) as c:
            other = asyncio.create_task(collect(c.client.generate(request("other", max_tokens=30))))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(c.client.generate(request("late", max_tokens=100, deadline_s=0.2)))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await wait_until(lambda: "late#1" in c.engines[0].aborted)
            tokens, _ = await other
            assert tokens == expected_tokens(request("other", max_tokens=30))

    run(body())


class SilentWorker:
    """A WorkerService that takes GenerateMultiplexed streams, records what comes on them and never answers."""

    def __init__(self):
        self.received: list[pb.MultiplexedRequest] = []
        self.port = 0

    async def _multiplexed(self, messages, context) -> None:
        async for message in messages:
            self.received.extend(message.requests)

    async def __aenter__(self) -> SilentWorker:
        service, _, method = MULTIPLEXED_METHOD[1:].rpartition("/")
        handler = grpc.stream_stream_rpc_method_handler(self._multiplexed, pb.MultiplexedRequests.FromString,
                                                        pb.MultiplexedReplies.SerializeToString)
        self._server = grpc.aio.server(options=server_options())
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {method: handler}),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._server.stop(0)


def test_the_router_ends_a_request_at_its_deadline_and_cancels_it_on_the_stream_when_the_worker_does_not():
    async def body():
        async with Cluster(roles=(), config=STREAM) as c, SilentWorker() as silent:
            c.router.registry.register(pb.WorkerInfo(worker_id="silent", address=f"127.0.0.1:{silent.port}",
                                                     role=pb.AGGREGATED, total_kv_blocks=1000))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(c.client.generate(request("late", deadline_s=0.3)))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await wait_until(lambda: len(silent.received) == 2)
            start, cancel = silent.received
            assert start.generate.request_id == "late#1" and 0 < start.generate.deadline_s <= 0.3
            assert (cancel.call_id, cancel.cancel) == (start.call_id, True)
            assert c.router.registry.get("silent").inflight == 0

    run(body())


def test_a_worker_ends_a_request_on_its_stream_at_its_deadline_on_its_own():
    async def body():
        async with Cluster(roles=("aggregated",), step_delay_s=0.05) as c:
            address, worker = c.workers[0].address, c.engines[0]
            async with open_channel(address) as channel:
                stream = pb_grpc.WorkerServiceStub(channel).GenerateMultiplexed(metadata=call_metadata(None))
                late = request("late", max_tokens=100, deadline_s=0.2).SerializeToString()
                await stream.write(pb.MultiplexedRequests.FromString(generate_entry(7, late, whole=False)))
                replies = []
                while not replies or replies[-1].HasField("chunk"):
                    replies += (await stream.read()).replies
                assert {r.call_id for r in replies} == {7}
                assert replies[-1].status.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
                await wait_until(lambda: "late" in worker.aborted)
                stream.cancel()

    run(body())


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_worker_stopping_gracefully_refuses_new_requests_which_go_to_another_worker(transport):
    # as gRPC refuses a new call during a graceful stop, the worker refuses a new request on its stream: it is
    # replayed elsewhere now, not served by a worker about to go
    async def body():
        config = {"worker_transport": transport, "policy": {"name": "round_robin"}}
        async with Cluster(config=config, step_delay_s=0.02) as c:
            running = c.client.generate(request("running", max_tokens=100))
            first = await anext(running)
            stopping = next(w for w in c.workers if w.worker_id == first.worker_id)
            stop = asyncio.create_task(stopping.stop(grace=10))
            await wait_until(lambda: stopping.stopping)
            started = asyncio.get_running_loop().time()
            for i in range(2):  # round_robin: one of them is sent to the stopping worker first
                req = request(f"new{i}", max_tokens=4)
                tokens, chunks = await collect(c.client.generate(req))
                assert tokens == expected_tokens(req) and chunks[-1].worker_id != stopping.worker_id
            assert asyncio.get_running_loop().time() - started < 5  # well within the stopping worker's grace
            await running.aclose()
            await stopping._server.stop(0)  # the grace cut short (the shorter of two stops' graces wins)
            await stop

    run(body())


def test_a_request_with_inline_images_over_the_limit_takes_a_call_of_its_own(served):
    async def body():
        config = STREAM | {"worker_stream": {"max_request_bytes": 4096}}
        async with Cluster(roles=("aggregated",), config=config) as c:
            small = request("small", images=[b"x" * 1000])
            large = request("large", images=[b"x" * 5000])
            for req in (small, large):
                tokens, _ = await collect(c.client.generate(req))
                assert tokens == expected_tokens(req)
            assert served["on_stream"] == ["small#1"] and served["own_call"] == ["large#1"]

    run(body())


def test_a_stream_opened_without_the_token_is_refused_unauthenticated():
    async def body():
        async with Cluster(roles=("aggregated",), token="s3cret") as c:
            async with open_channel(c.workers[0].address) as channel:
                stream = pb_grpc.WorkerServiceStub(channel).GenerateMultiplexed(metadata=call_metadata("wrong"))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stream.read()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

    run(body())
