"""contract.transport's refusal of unparseable requests (MalformedRequestInterceptor), on a worker's streaming and
unary methods, and its handlers looked up once per method."""

from __future__ import annotations

import types

import grpc
import grpc.aio
import pytest

from contract.transport import MalformedRequestInterceptor, open_channel
from contract.wire import pb
from tests.helpers.router_fixtures import collect, request, run
from workers.serve.server import WorkerServer
from workers.serve.worker_build import WorkerSettings
from workers.sim.instant_engine import InstantEngine

GARBAGE = b"\x0a\xff\xff\xff\xff\x0f"  # a string field whose length runs past the end


def test_a_worker_refuses_bytes_that_do_not_parse_invalid_argument_on_every_call_and_serves_the_next_request():
    async def body():
        server = WorkerServer(InstantEngine(), WorkerSettings("wt"))
        await server.start()
        channel = open_channel(server.address)
        try:
            for method, kind in (("Generate", channel.unary_stream), ("GenerateWhole", channel.unary_unary)):
                raw = kind(f"/q3vl.v1.WorkerService/{method}")
                for _ in range(2):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        call = raw(GARBAGE)
                        await (collect(call) if method == "Generate" else call)
                    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert f"/q3vl.v1.WorkerService/{method}: request is not a valid message" in err.value.details()
            whole = channel.unary_unary("/q3vl.v1.WorkerService/GenerateWhole",
                                        response_deserializer=pb.GenerateChunk.FromString)
            reply = await whole(request("after", max_tokens=4).SerializeToString())
            assert len(reply.token_ids) == 4 and reply.finish_reason == pb.LENGTH
        finally:
            await channel.close()
            await server.stop(0)

    run(body())


def test_each_methods_handler_is_looked_up_and_wrapped_at_its_first_call_only():
    async def body():
        interceptor = MalformedRequestInterceptor()
        lookups = []

        async def answer(request, context):
            return request

        async def continuation(details):
            lookups.append(details.method)
            if details.method == "/s/Known":
                return grpc.unary_unary_rpc_method_handler(answer, pb.Empty.FromString, pb.Empty.SerializeToString)
            return None

        known = types.SimpleNamespace(method="/s/Known", invocation_metadata=())
        unknown = types.SimpleNamespace(method="/s/Unknown", invocation_metadata=())
        first = await interceptor.intercept_service(continuation, known)
        assert await interceptor.intercept_service(continuation, known) is first
        assert await interceptor.intercept_service(continuation, unknown) is None
        assert await interceptor.intercept_service(continuation, unknown) is None
        assert lookups == ["/s/Known", "/s/Unknown", "/s/Unknown"]

    run(body())
