"""WorkerServer around an engine (the instant engine here): sampling mapping, coalesced streaming, cancel,
KV hold / pull / release, registration and heartbeats."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest
import torch

from contract.transport import open_channel
from contract.types import FinishReason, RequestOutput
from contract.wire import pb, pb_grpc
from tests.helpers.call_context import CallContext
from tests.helpers.router_fixtures import Cluster, collect, request, run
from workers.kv_cache import KvExport
from workers.request_options import ONLY_AT_END
from workers.serve.kv_wire import kv_from_chunks, kv_to_chunks
from workers.serve.server import WorkerServer, WorkerServicer
from workers.serve.worker_build import WorkerSettings
from workers.sim.instant_engine import InstantEngine


class Worker:
    """A WorkerServer on loopback with a stub to call it directly."""

    def __init__(self, engine: InstantEngine | None = None, role: str = "aggregated"):
        self.engine = engine or InstantEngine()
        self.server = WorkerServer(self.engine, WorkerSettings("wt", role))

    async def __aenter__(self):
        await self.server.start()
        self.channel = open_channel(self.server.address)
        self.stub = pb_grpc.WorkerServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        await self.server.stop(0)


def test_model_default_sampling_comes_from_the_engine_generation_defaults():
    async def body():
        async with Worker() as w:
            req = request("d", max_tokens=5)
            req.sampling.use_model_defaults = True
            req.sampling.temperature = 0.0  # ignored: the defaults win
            tokens, _ = await collect(w.stub.Generate(req))
            seen = w.engine.sampling_seen["d"]
            assert (seen.temperature, seen.top_p, seen.top_k, seen.max_tokens) == (0.7, 0.8, 20, 5)
            assert len(tokens) == 5

    run(body())


def test_a_requests_latency_bound_reaches_the_engine():
    async def body():
        async with Worker() as w:
            await collect(w.stub.Generate(request("bounded", max_tokens=2, latency_bound_s=1.5)))
            await collect(w.stub.Generate(request("unbounded", max_tokens=2)))
            assert w.engine.latency_bounds_seen == {"bounded": 1.5, "unbounded": 0.0}

    run(body())


def test_explicit_sampling_is_passed_through_and_bad_values_are_invalid_argument():
    async def body():
        async with Worker() as w:
            req = request("e", max_tokens=3)
            req.sampling.temperature, req.sampling.top_k, req.sampling.has_seed, req.sampling.seed = 0.5, 4, True, 9
            await collect(w.stub.Generate(req))
            seen = w.engine.sampling_seen["e"]
            assert (seen.temperature, seen.top_p, seen.top_k, seen.seed) == (0.5, 1.0, 4, 9)
            bad = request("bad")
            bad.sampling.temperature = -1
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(w.stub.Generate(bad))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    run(body())


class HeldEngine(InstantEngine):
    """Streams a request's first token, then holds the rest until `release` is set and hands them over together, as
    an engine does with the tokens it produced while the first chunk was on its way."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def generate(self, request_id, prompt, sampling, *options):
        outputs = aiter(super().generate(request_id, prompt, sampling, *options))
        yield await anext(outputs)
        await self.release.wait()
        rest = [out async for out in outputs]
        for out in rest:  # back to back, nothing awaited between them
            yield out


def test_tokens_produced_while_a_chunk_is_in_flight_are_coalesced():
    async def body():
        async with Worker(HeldEngine()) as w:
            call = w.stub.Generate(request("c", max_tokens=200))
            chunks = [await call.read()]  # the first token's chunk is out; the other 199 pile up behind it
            w.engine.release.set()
            while (chunk := await call.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
            assert [len(c.token_ids) for c in chunks] == [1, 199]
            assert chunks[-1].finish_reason == pb.LENGTH and chunks[-1].completion_tokens == 200

    run(body())


def test_a_stream_interval_sends_the_first_token_at_once_then_chunks_of_at_least_that_many():
    async def body():
        async with Worker(InstantEngine(step_delay_s=0.002)) as w:
            tokens, chunks = await collect(w.stub.Generate(request("si", max_tokens=20, stream_interval=8)))
            assert len(tokens) == 20 and chunks[-1].finish_reason == pb.LENGTH
            assert chunks[0].token_ids  # the first token is not held back
            assert all(len(c.token_ids) >= 8 for c in chunks[1:-1])
            assert len(chunks) <= 4  # first, then at most two full chunks of 8, then the rest with the finish

    run(body())


def test_final_chunk_only_sends_every_token_in_the_final_chunk_and_nothing_before():
    async def body():
        async with Worker(InstantEngine(step_delay_s=0.002)) as w:
            for interval in (0, 8):  # stream_interval is moot then
                rid = f"whole{interval}"
                tokens, chunks = await collect(w.stub.Generate(
                    request(rid, max_tokens=20, stream_interval=interval, final_chunk_only=True)))
                assert len(chunks) == 1 and len(tokens) == 20
                assert chunks[0].finish_reason == pb.LENGTH and chunks[0].completion_tokens == 20

    run(body())


def test_the_engine_hands_out_tokens_as_often_as_the_call_sends_them():
    async def body():
        async with Worker(InstantEngine(step_delay_s=0.002)) as w:
            await collect(w.stub.Generate(request("every", max_tokens=4)))
            await collect(w.stub.Generate(request("by8", max_tokens=4, stream_interval=8)))
            await collect(w.stub.Generate(request("whole", max_tokens=4, stream_interval=8, final_chunk_only=True)))
            assert w.engine.stream_intervals_seen == {"every": 0, "by8": 8, "whole": ONLY_AT_END}

    run(body())


class EndingEngine(InstantEngine):
    """An instant engine whose stream ends its own way after `after` tokens: it raises, it stops without a finished
    output, or it ends the request PREEMPTED."""

    def __init__(self, how: str, after: int = 3):
        super().__init__()
        self.how, self.after = how, after

    async def generate(self, request_id, prompt, sampling, *options):
        async for out in super().generate(request_id, prompt, sampling, *options):
            if out.num_generated_tokens < self.after:
                yield out
                continue
            if self.how == "raises":
                raise RuntimeError("the GPU fell off")
            if self.how == "preempted":
                yield RequestOutput(request_id, out.new_token_ids, True, FinishReason.PREEMPTED, "no KV left",
                                    out.num_prompt_tokens, out.num_generated_tokens)
            return


@pytest.mark.parametrize("final_only", [False, True], ids=["streamed", "final_chunk_only"])
def test_an_engine_stream_that_fails_or_stops_short_ends_the_call_with_its_tokens_so_far(final_only):
    async def body():
        endings = (("raises", "engine error: the GPU fell off"), ("stops", "engine stream ended without finishing"))
        for how, error in endings:
            async with Worker(EndingEngine(how)) as w:
                call = w.stub.Generate(request(how, max_tokens=20, final_chunk_only=final_only))
                tokens, chunks = await collect(call)
                assert len(tokens) == 2 and (chunks[-1].finish_reason, chunks[-1].error) == (pb.ERROR, error)
                assert len(chunks) == 1 or not final_only
        async with Worker(EndingEngine("preempted")) as w:
            call = w.stub.Generate(request("p", max_tokens=20, final_chunk_only=final_only))
            chunks = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for chunk in call:
                    chunks.append(chunk)
            assert err.value.code() == grpc.StatusCode.ABORTED and "no KV left" in err.value.details()
            assert sum(len(c.token_ids) for c in chunks) == 3  # the router resumes after them
            assert len(chunks) == 1 or not final_only

    run(body())


def test_generate_whole_answers_with_the_final_chunk_and_a_request_handed_back_ends_aborted_without_tokens():
    async def body():
        async with Worker() as w:
            reply = await w.stub.GenerateWhole(request("whole", max_tokens=20))
            assert reply.finish_reason == pb.LENGTH and len(reply.token_ids) == reply.completion_tokens == 20
        async with Worker(EndingEngine("raises")) as w:
            reply = await w.stub.GenerateWhole(request("fails", max_tokens=20))
            assert (reply.finish_reason, len(reply.token_ids)) == (pb.ERROR, 2)
        async with Worker(EndingEngine("preempted")) as w:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await w.stub.GenerateWhole(request("p", max_tokens=20))
            assert err.value.code() == grpc.StatusCode.ABORTED and "no KV left" in err.value.details()

    run(body())


def test_cancelled_call_aborts_the_engine_request():
    async def body():
        async with Worker(InstantEngine(step_delay_s=0.02)) as w:
            call = w.stub.Generate(request("x", max_tokens=500))
            await call.read()
            call.cancel()
            for _ in range(100):
                if "x" in w.engine.aborted:
                    break
                await asyncio.sleep(0.02)
            assert "x" in w.engine.aborted

    run(body())


def test_a_call_that_ends_while_its_chunk_is_written_aborts_the_engine_request_once():
    """gRPC cancels a call it is writing a chunk of in its own code: the handler stays suspended at its yield
    (closed only when collected) while its pump reads on. The call's end aborts the engine's request all the same,
    and closing the handler later does not abort it again (CI, 2026-12-06: a stop string's cancel that landed so
    left the worker generating to max_tokens)."""
    async def body():
        engine = InstantEngine(step_delay_s=0.002)
        servicer = WorkerServicer(WorkerServer(engine, WorkerSettings("wt")))
        context = CallContext()
        stream = servicer.Generate(request("w", max_tokens=2000), context)
        await anext(stream)  # the first chunk, which gRPC now writes while the caller goes away
        context.end()
        for _ in range(200):
            if "w" in engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == ["w"] and engine.steps < 2000
        await stream.aclose()
        await asyncio.sleep(0.05)
        assert engine.aborted == ["w"]

    run(body())


def test_a_call_that_ends_after_its_final_chunk_aborts_nothing():
    async def body():
        engine = InstantEngine(step_delay_s=0.001)
        context = CallContext()
        chunks = [c async for c in WorkerServicer(WorkerServer(engine, WorkerSettings("wt"))).Generate(
            request("done", max_tokens=5), context)]
        context.end()
        await asyncio.sleep(0.05)
        assert chunks[-1].finish_reason == pb.LENGTH and engine.aborted == []

    run(body())


def test_prefill_only_holds_kv_until_pulled_layer_by_layer_then_releases_it():
    async def body():
        async with Worker(role="prefill") as w:
            req = request("p", prompt_len=33, prefill_only=True)
            _, chunks = await collect(w.stub.Generate(req))
            handle = chunks[-1].kv_handle
            assert handle.worker_address == w.server.address and handle.num_tokens == 33
            assert handle.first_token_id == chunks[-1].token_ids[-1]
            assert w.engine.held_kv == ["p"]
            pulled = [c async for c in w.stub.PullKv(pb.KvPullRequest(transfer_id=handle.transfer_id))]
            assert [c.layer for c in pulled] == [0, 1] and pulled[0].num_layers == 2
            export = kv_from_chunks(pulled, handle.first_token_id)
            assert export.keys[0][:, 0, 0].tolist() == list(req.prompt_token_ids)
            assert w.engine.held_kv == []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(w.stub.PullKv(pb.KvPullRequest(transfer_id=handle.transfer_id)))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

    run(body())


def test_abort_of_a_held_transfer_releases_its_kv():
    async def body():
        async with Worker(role="prefill") as w:
            _, chunks = await collect(w.stub.Generate(request("h", prefill_only=True)))
            assert (await w.stub.Abort(pb.AbortRequest(request_id=chunks[-1].kv_handle.transfer_id))).found
            assert w.engine.held_kv == []

    run(body())


def test_kv_chunks_round_trip_bfloat16_exactly():
    keys = [torch.randn(7, 2, 8).to(torch.bfloat16) for _ in range(3)]
    export = KvExport(num_tokens=7, first_token_id=5, mrope_position_delta=-3, keys=keys, values=[k * 2 for k in keys])
    back = kv_from_chunks(kv_to_chunks(export), first_token_id=5)
    assert back.mrope_position_delta == -3 and back.first_token_id == 5
    assert all(torch.equal(a, b) for a, b in zip(back.keys + back.values, export.keys + export.values))
    with pytest.raises(ValueError, match="layers"):
        kv_from_chunks(kv_to_chunks(export)[:2], first_token_id=5)


def test_decode_with_an_unreachable_kv_handle_is_unavailable():
    async def body():
        async with Worker(role="decode") as w:
            req = request("u")
            req.kv_handle.CopyFrom(pb.KvHandle(worker_address="127.0.0.1:1", transfer_id="t", first_token_id=3))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(w.stub.Generate(req, timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    run(body())


def test_worker_registers_again_when_the_router_forgets_it():
    async def body():
        async with Cluster(roles=("aggregated",)) as c:
            c.router.registry._entries.clear()  # as after a router restart
            await c.client.wait_for_workers(1, timeout=5)
            listing = await c.client.list_workers()
            assert listing.workers[0].address == c.workers[0].address
            assert listing.loads[0].total_kv_blocks == c.engines[0].total_kv_blocks

    run(body())


def test_non_loopback_listen_requires_a_token():
    with pytest.raises(ValueError, match="token"):
        WorkerServer(InstantEngine(), WorkerSettings("w", "decode", listen="0.0.0.0:0"))
    with pytest.raises(ValueError, match="role"):
        WorkerServer(InstantEngine(), WorkerSettings("w", "encoder"))
