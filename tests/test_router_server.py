"""RouterService with instant-engine workers in one process: streaming, cancel, limits, auth, health,
worker failure (down detection, migration) and disaggregated prefill/decode; each test that takes `route` the same
whether its caller reaches the router over gRPC or routes in the router's own process (router.embedded), and whether
the router reaches its workers with a call a request or on one stream a worker (worker_transport)."""

from __future__ import annotations

import asyncio
import time

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contract.types import FinishReason, RequestOutput
from contract.wire import pb
from router.client import RouterClient, wait_for_workers
from router.config import parse_router_config
from router.server import RouterServicer
from tests.helpers.call_context import CallContext
from tests.helpers.router_fixtures import (FAST_HEALTH, MODES, TRANSPORTS, Cluster, collect, expected_tokens, request,
                                          run, wait_until)
from workers.request_options import NO_OPTIONS
from workers.serve.server import WorkerServicer
from workers.sim.instant_engine import InstantEngine


@pytest.fixture(params=[(m, t) for m in MODES for t in TRANSPORTS], ids="-".join)
def route(request):
    """Each test that takes it runs four times: the caller reaches the router over gRPC or from inside its process,
    the router its workers with a call a request or on one stream a worker (Cluster's keywords)."""
    mode, transport = request.param
    return {"mode": mode, "transport": transport}


def test_generate_streams_every_token_once_and_ends_with_counts(route):
    async def body():
        async with Cluster(**route) as c:
            req = request("r1", prompt_len=40, max_tokens=12)
            tokens, chunks = await collect(c.client.generate(req))
            assert tokens == expected_tokens(req)
            last = chunks[-1]
            assert last.finish_reason == pb.LENGTH
            assert (last.prompt_tokens, last.completion_tokens) == (40, 12)
            assert all(ch.request_id == "r1" and ch.worker_id in {"w0", "w1"} for ch in chunks)
            assert sum(ch.finish_reason != pb.FINISH_REASON_UNSPECIFIED for ch in chunks) == 1

    run(body())


def test_booked_load_is_released_after_every_request(route):
    async def body():
        async with Cluster(**route) as c:
            await asyncio.gather(*(collect(c.client.generate(request(f"r{i}"))) for i in range(20)))
            for entry in c.router.registry.entries():
                assert (entry.inflight, entry.booked_prefill_tokens, entry.booked_blocks) == (0, 0, 0)

    run(body())


def test_a_requests_slots_are_free_when_its_final_chunk_reaches_the_caller():
    # a caller may send its next request as soon as it has an answer: that request must not be refused for the
    # slot of the one whose answer it holds (the router ends its side of the call a moment later)
    async def body():
        async with Cluster(roles=("aggregated",), config={"limits": {"max_inflight_per_worker": 1}}) as c:
            dispatcher = c.router.dispatcher
            stream = dispatcher.generate(request("r1", max_tokens=4))
            async for chunk in stream:
                if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    break  # the router's generator is still suspended at this chunk
            (entry,) = c.router.registry.entries()
            assert (dispatcher.inflight, entry.inflight) == (0, 0)
            assert dispatcher._has_capacity()
            await stream.aclose()
            assert (dispatcher.inflight, entry.inflight, entry.booked_blocks) == (0, 0, 0)  # released once

    run(body())


def test_client_cancel_aborts_the_engine_request_upstream(route):
    async def body():
        async with Cluster(**route, roles=("aggregated",), step_delay_s=0.05) as c:
            stream = c.client.generate(request("gone", max_tokens=100))
            await stream.__anext__()
            await stream.aclose()  # the caller goes away
            await wait_until(lambda: "gone#1" in c.engines[0].aborted)
            await wait_until(lambda: c.router.registry.entries()[0].inflight == 0)

    run(body())


def test_a_call_that_ends_while_the_router_writes_its_chunk_frees_the_slot_and_aborts_it_upstream():
    """gRPC cancels a call it is writing a chunk of in its own code, leaving the router's Generate suspended at its
    yield: the call's end closes the dispatcher's stream all the same (the admission slot back, the worker's call
    cancelled), where before that waited for the handler to be collected."""
    async def body():
        async with Cluster(roles=("aggregated",), step_delay_s=0.01) as c:
            servicer = RouterServicer(c.router.config, c.router.registry, c.router.dispatcher, None)
            context = CallContext()
            stream = servicer.Generate(request("gone", max_tokens=2000), context)
            await anext(stream)  # the first chunk, which gRPC now writes while the caller goes away
            assert c.router.dispatcher.inflight == 1
            context.end()
            await wait_until(lambda: "gone#1" in c.engines[0].aborted)
            await wait_until(lambda: c.router.dispatcher.inflight == 0 and c.router.registry.entries()[0].inflight == 0)
            await stream.aclose()

    run(body())


def test_a_caller_that_goes_away_from_a_request_read_whole_aborts_it_upstream(route):
    async def body():
        async with Cluster(**route, roles=("aggregated",), step_delay_s=0.05) as c:
            answer = asyncio.create_task(collect(c.client.generate(request("gone", max_tokens=100,
                                                                           final_chunk_only=True))))
            await wait_until(lambda: c.engines[0].load().running_requests == 1)
            answer.cancel()  # the caller goes away
            await wait_until(lambda: "gone#1" in c.engines[0].aborted)
            await wait_until(lambda: c.router.registry.entries()[0].inflight == 0)

    run(body())


def test_abort_rpc_ends_the_stream_with_abort(route):
    async def body():
        async with Cluster(**route, roles=("aggregated",), step_delay_s=0.05) as c:
            stream = c.client.generate(request("ab", max_tokens=100))
            await stream.__anext__()
            assert await c.client.abort("ab") is True
            tokens, chunks = await collect(stream)
            assert chunks[-1].finish_reason == pb.ABORT
            assert len(tokens) < 100
            assert await c.client.abort("unknown") is False

    run(body())


def test_requests_beyond_inflight_limit_and_queue_get_resource_exhausted(route):
    async def body():
        limits = {"max_inflight_total": 1, "max_queue": 1}
        async with Cluster(**route, roles=("aggregated",), step_delay_s=0.02, config={"limits": limits}) as c:
            first = asyncio.create_task(collect(c.client.generate(request("a", max_tokens=10))))
            await wait_until(lambda: c.router.dispatcher.inflight == 1)
            queued = asyncio.create_task(collect(c.client.generate(request("b", max_tokens=10))))
            await wait_until(lambda: c.router.dispatcher.admission.queue_depth == 1)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(c.client.generate(request("c")))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for task in (first, queued):  # the queued one runs once the first finishes
                tokens, _ = await task
                assert len(tokens) == 10
            assert b'q3vl_router_rejections_total{reason="queue_full"} 1.0' in c.router.dispatcher.metrics.render()

    run(body())


def test_a_router_without_a_healthy_worker_refuses_unavailable(route):
    async def body():
        async with Cluster(**route, roles=()) as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(c.client.generate(request("early")))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no healthy worker" in err.value.details()

    run(body())


def test_request_deadline_gives_deadline_exceeded(route):
    async def body():
        async with Cluster(**route, roles=("aggregated",), step_delay_s=0.05) as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(c.client.generate(request("slow", max_tokens=100, deadline_s=0.3)))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await wait_until(lambda: c.router.registry.entries()[0].inflight == 0)

    run(body())


def test_non_loopback_bind_without_token_is_rejected_naming_the_key():
    with pytest.raises(ValueError, match="listen"):
        parse_router_config({"listen": "0.0.0.0:50051"})
    with pytest.raises(ValueError, match="key 'policy.name'"):
        parse_router_config({"policy": {"name": "fastest"}})
    assert parse_router_config({"listen": "0.0.0.0:50051", "token": "s3cret"}).token == "s3cret"


def test_calls_without_the_token_are_unauthenticated(route):
    async def body():
        async with Cluster(**route, token="s3cret") as c:
            tokens, _ = await collect(c.client.generate(request("ok")))  # workers registered with the token too
            assert len(tokens) == 8
            async with RouterClient(c.router.address) as anonymous:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await anonymous.list_workers()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            async with RouterClient(c.router.address, token="wrong") as wrong:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(wrong.generate(request("no")))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

    run(body())


def test_health_service_reports_serving_with_workers(route):
    async def body():
        async with Cluster(**route) as c:
            async with grpc.aio.insecure_channel(c.router.address) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                reply = await stub.Check(health_pb2.HealthCheckRequest(service="q3vl.v1.RouterService"))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING

    run(body())


def test_waiting_for_named_workers_returns_the_listing_once_all_are_healthy_and_names_the_missing_on_timeout(route):
    async def body():
        async with Cluster(**route, roles=("aggregated", "decode")) as c:
            listing = await wait_for_workers(c.client, worker_ids=["w0", "w1"], timeout_s=10)
            assert sorted(w.worker_id for w in listing.workers) == ["w0", "w1"] and all(listing.healthy)
            with pytest.raises(TimeoutError, match="not registered and healthy: w2"):
                await wait_for_workers(c.client, worker_ids=["w1", "w2"], timeout_s=0.2)
            with pytest.raises(TimeoutError, match="1 of 2 workers registered"):
                await wait_for_workers(c.client, count=2, roles=(pb.DECODE,), timeout_s=0.2)
            await c.add_worker("w2")
            listing = await wait_for_workers(c.client, worker_ids=["w2"], timeout_s=10)
            assert "w2" in {w.worker_id for w in listing.workers}

    run(body())


def test_worker_without_heartbeats_is_marked_down_and_gets_no_new_work(route):
    async def body():
        async with Cluster(**route) as c:
            c.workers[0]._reporter.cancel()  # w0 goes silent
            await wait_until(lambda: not c.router.registry.get("w0").healthy)
            listing = await c.client.list_workers()
            assert dict(zip([w.worker_id for w in listing.workers], listing.healthy)) == {"w0": False, "w1": True}
            for i in range(6):
                _, chunks = await collect(c.client.generate(request(f"r{i}")))
                assert {ch.worker_id for ch in chunks} == {"w1"}

    run(body())


class Calls:
    """Records each call of `obj.name` (wrapped in place) by `key` of its arguments; `until` waits on an event the
    calls set, never on a sleep."""

    def __init__(self, obj, name: str, key=lambda *args: None):
        self.keys: list = []
        self._called = asyncio.Event()
        original = getattr(obj, name)

        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs)
            self.keys.append(key(*args))
            self._called.set()
            return result

        setattr(obj, name, wrapper)

    async def until(self, predicate) -> None:
        while not predicate(self.keys):
            self._called.clear()
            await self._called.wait()


def test_a_stall_of_the_routers_own_event_loop_marks_no_worker_down(route):
    # A burst of large requests can hold the router's loop for seconds (1,500 queries of 2 MB images on 2 cores:
    # 6 s); heartbeats that arrived meanwhile wait behind the health check, which must not read them as silence.
    async def body():
        async with Cluster(**route) as c:
            registry = c.router.registry
            marked_down = Calls(registry, "mark_down", key=lambda entry, reason: reason)
            heartbeats = Calls(registry, "heartbeat", key=lambda report: report.worker_id)
            checks = Calls(registry, "check")
            await heartbeats.until(lambda ids: {"w0", "w1"} <= set(ids))  # heartbeats flowing
            time.sleep(FAST_HEALTH["down_after_s"] + 1.5)  # the loop blocks (the workers' heartbeats too)
            heartbeats.keys.clear()  # nothing ran meanwhile: what is recorded from here came after the stall
            checks.keys.clear()
            # The health checks after the stall have run, the first of them on the silence, and both workers'
            # heartbeats have been handled since.
            await checks.until(lambda calls: len(calls) >= 2)
            await heartbeats.until(lambda ids: {"w0", "w1"} <= set(ids))
            assert marked_down.keys == []
            assert {e.worker_id: e.healthy for e in registry.entries()} == {"w0": True, "w1": True}

    run(body())


def test_hung_engine_is_marked_down_and_its_request_migrates(route):
    async def body():
        async with Cluster(**route, step_delay_s=0.02, config={"policy": {"name": "round_robin"}}) as c:
            req = request("hang", max_tokens=40)
            stream = c.client.generate(req)
            first = await stream.__anext__()
            victim = int(first.worker_id[1:])
            c.engines[victim].stall()  # steps stop while the request is running
            tokens, chunks = await collect(stream)
            assert list(first.token_ids) + tokens == expected_tokens(req)
            assert not c.router.registry.get(first.worker_id).healthy
            assert "stalled" in c.router.registry.get(first.worker_id).down_reason
            assert chunks[-1].worker_id != first.worker_id

    run(body())


def test_a_request_read_whole_is_one_generate_whole_reply_from_its_worker_and_one_chunk_to_its_caller(
        route, monkeypatch):
    replies = []
    generate_whole = WorkerServicer.GenerateWhole

    async def counted(self, request, context):
        replies.append(request.request_id)
        return await generate_whole(self, request, context)

    monkeypatch.setattr(WorkerServicer, "GenerateWhole", counted)

    async def body():
        async with Cluster(**route) as c:
            req = request("whole", prompt_len=40, max_tokens=12, final_chunk_only=True)
            tokens, chunks = await collect(c.client.generate(req))
            assert tokens == expected_tokens(req) and len(chunks) == 1
            final = chunks[0]
            assert (final.finish_reason, final.prompt_tokens, final.completion_tokens) == (pb.LENGTH, 40, 12)
            assert replies == ["whole#1"]
            await collect(c.client.generate(request("streamed")))
            assert replies == ["whole#1"]  # a stream is still Generate's
            for entry in c.router.registry.entries():
                assert (entry.inflight, entry.booked_prefill_tokens, entry.booked_blocks) == (0, 0, 0)

    run(body())


def test_a_request_read_whole_whose_worker_is_killed_is_replayed_from_the_start_elsewhere(route):
    async def body():
        async with Cluster(**route, step_delay_s=0.02) as c:
            req = request("whole-mig", max_tokens=40, final_chunk_only=True)
            answer = asyncio.create_task(collect(c.client.generate(req)))
            await wait_until(lambda: any(e.load().running_requests for e in c.engines))
            victim = next(w for w, e in zip(c.workers, c.engines) if e.load().running_requests)
            await victim.stop(0)
            tokens, chunks = await answer
            assert tokens == expected_tokens(req) and len(chunks) == 1
            assert chunks[0].worker_id != victim.worker_id and chunks[0].completion_tokens == 40
            assert b'q3vl_router_migrations_total{kind="new_request"} 1.0' in c.router.dispatcher.metrics.render()

    run(body())


def test_worker_killed_mid_stream_loses_no_token_and_repeats_none(route):
    async def body():
        async with Cluster(**route, step_delay_s=0.02) as c:
            req = request("mig", max_tokens=40)
            stream = c.client.generate(req)
            seen = []
            async for chunk in stream:
                seen.append(chunk)
                if sum(len(ch.token_ids) for ch in seen) >= 5:
                    break_worker = next(w for w in c.workers if w.worker_id == chunk.worker_id)
                    await break_worker.stop(0)
                    break
            tokens, chunks = await collect(stream)
            streamed = [t for ch in seen for t in ch.token_ids] + tokens
            assert streamed == expected_tokens(req)
            assert chunks[-1].finish_reason == pb.LENGTH and chunks[-1].completion_tokens == 40
            assert b'q3vl_router_migrations_total{kind="ongoing_request"} 1.0' in c.router.dispatcher.metrics.render()

    run(body())


def test_migration_gives_up_after_max_retries_with_an_error_chunk(route):
    async def body():
        no_retries = {"migration": {"max_retries": 0}}
        async with Cluster(**route, roles=("aggregated",), step_delay_s=0.02, config=no_retries) as c:
            stream = c.client.generate(request("lost", max_tokens=40))
            await stream.__anext__()
            await c.workers[0].stop(0)
            _, chunks = await collect(stream)
            assert chunks[-1].finish_reason == pb.ERROR and "failed" in chunks[-1].error

    run(body())


def test_a_request_whose_only_worker_died_waits_for_its_restart_and_loses_no_token(route):
    async def body():
        async with Cluster(**route, roles=("aggregated",), step_delay_s=0.02) as c:
            req = request("restart", max_tokens=40)
            stream = c.client.generate(req)
            first = await stream.__anext__()
            await c.workers[0].stop(0)  # no other worker: the migration has nowhere to go yet

            async def restart():
                await asyncio.sleep(0.5)
                await c.add_worker("w0")  # as Ray restarts the actor: same id, new port

            restarted = asyncio.create_task(restart())
            tokens, chunks = await collect(stream)
            await restarted
            assert list(first.token_ids) + tokens == expected_tokens(req)
            assert chunks[-1].finish_reason == pb.LENGTH

    run(body())


def test_restarted_worker_replaces_its_old_entry(route):
    async def body():
        async with Cluster(**route, roles=("aggregated",)) as c:
            old_address = c.workers[0].address
            await c.workers[0].stop(0)
            await c.add_worker("w0")  # same id, new port
            await wait_until(lambda: c.router.registry.get("w0").address != old_address)
            listing = await c.client.list_workers()
            assert [w.worker_id for w in listing.workers] == ["w0"] and list(listing.healthy) == [True]
            tokens, _ = await collect(c.client.generate(request("after")))
            assert len(tokens) == 8

    run(body())


DISAGG = {"disaggregation": {"enabled": True}}


@pytest.mark.parametrize("whole", [False, True], ids=["streamed", "final_chunk_only"])
def test_disaggregated_request_prefills_on_prefill_worker_and_decodes_with_pulled_kv(route, whole):
    async def body():
        async with Cluster(**route, roles=("prefill", "decode"), config=DISAGG) as c:
            req = request("pd", prompt_len=64, max_tokens=10, final_chunk_only=whole)
            tokens, chunks = await collect(c.client.generate(req))
            assert tokens == expected_tokens(req)  # the decode engine rebuilt the prompt from the pulled KV
            assert chunks[0].worker_id == "w0" and chunks[-1].worker_id == "w1"
            assert c.engines[0].requests_seen == ["pd#1"] and c.engines[1].requests_seen == ["pd#2"]
            await wait_until(lambda: c.engines[0].held_kv == [])  # released after the pull
            assert chunks[-1].completion_tokens == 10

    run(body())


def test_images_cross_each_hop_once_the_decode_worker_gets_none(route):
    async def body():
        async with Cluster(**route, roles=("prefill", "decode"), config=DISAGG) as c:
            req = request("img", prompt_len=64, max_tokens=6, images=[b"an encoded image", b"another"])
            tokens, _ = await collect(c.client.generate(req))
            assert tokens == expected_tokens(req)
            assert c.engines[0].images_seen == {"img#1": 2} and c.engines[1].images_seen == {"img#2": 0}

    run(body())


class PreemptingEngine(InstantEngine):
    """An instant engine that, like a decode worker short of KV blocks, drops a KV-imported request after its first
    tokens and cannot compute it again (it has none of the prompt's images): it ends it PREEMPTED."""

    async def generate(self, request_id, prompt, sampling, options=NO_OPTIONS):
        outputs = super().generate(request_id, prompt, sampling, options)
        async for out in outputs:
            if options.kv_import is not None and out.num_generated_tokens == 2:
                await outputs.aclose()
                yield RequestOutput(request_id, out.new_token_ids, True, FinishReason.PREEMPTED, "preempted",
                                    out.num_prompt_tokens, out.num_generated_tokens)
                return
            yield out


@pytest.mark.parametrize("whole", [False, True], ids=["streamed", "final_chunk_only"])
def test_a_decode_worker_that_cannot_recompute_a_preempted_request_hands_it_back_and_it_is_replayed_with_images(
        route, whole):
    async def body():
        async with Cluster(**route, roles=("prefill",), config=DISAGG) as c:
            await c.add_worker("w1", "decode", engine=PreemptingEngine())
            await c.client.wait_for_workers(2)
            req = request("pre", prompt_len=64, max_tokens=8, images=[b"an encoded image"], final_chunk_only=whole)
            tokens, chunks = await collect(c.client.generate(req))
            assert tokens == expected_tokens(req)  # no token lost or repeated across the hand-back
            assert chunks[-1].completion_tokens == 8
            decode = c.engines[1]
            assert decode.images_seen == {"pre#2": 0, "pre#3": 1}  # the replay carries the image again
            assert c.router.registry.get("w1").healthy

    run(body())


def test_short_prompts_prefill_locally_under_conditional_disaggregation(route):
    async def body():
        config = {"disaggregation": {"enabled": True, "min_remote_prefill_tokens": 100}}
        async with Cluster(**route, roles=("prefill", "decode"), config=config) as c:
            req = request("short", prompt_len=40)
            tokens, _ = await collect(c.client.generate(req))
            assert tokens == expected_tokens(req)
            assert c.engines[0].requests_seen == []

    run(body())


def test_prefill_worker_failure_falls_back_to_local_prefill(route):
    async def body():
        async with Cluster(**route, roles=("prefill", "decode"), config=DISAGG) as c:
            await c.workers[0]._server.stop(0)  # the prefill worker stops serving but still heartbeats
            req = request("fallback", prompt_len=64)
            tokens, chunks = await collect(c.client.generate(req))
            assert tokens == expected_tokens(req)
            assert {ch.worker_id for ch in chunks} == {"w1"}

    run(body())


def test_least_loaded_sends_less_traffic_to_a_slow_worker(route):
    async def body():
        async with Cluster(**route, config={"policy": {"name": "least_loaded"}}) as c:
            c.engines[0].step_delay_s = 0.03  # w0 is slow, w1 instant
            counts = {"w0": 0, "w1": 0}
            sem = asyncio.Semaphore(8)

            async def one(i):
                async with sem:
                    _, chunks = await collect(c.client.generate(request(f"r{i}", max_tokens=10)))
                    counts[chunks[-1].worker_id] += 1

            await asyncio.gather(*(one(i) for i in range(80)))
            assert counts["w1"] > 2 * counts["w0"], counts

    run(body())


def test_a_registered_worker_counts_as_all_its_kv_free_until_its_first_heartbeat():
    from router.registry import WorkerEntry

    async def body():
        info = pb.WorkerInfo(worker_id="w0", address="127.0.0.1:1", role=pb.AGGREGATED, total_kv_blocks=4096)
        channel = grpc.aio.insecure_channel(info.address)
        entry = WorkerEntry(info, channel, now=0.0)
        await channel.close()
        return entry.report

    report = run(body())
    assert report.total_kv_blocks == report.free_kv_blocks == 4096 and report.running_requests == 0
