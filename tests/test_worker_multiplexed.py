"""workers.serve.multiplexed on its own, driven through a stand-in for the stream's ServicerContext: what the worker
writes on a GenerateMultiplexed stream."""

from __future__ import annotations

import asyncio

import grpc.aio

from contract.multiplexed_wire import generate_entry
from contract.wire import pb
from tests.helpers.router_fixtures import request, run
from workers.serve.multiplexed import Multiplexer


class StreamContext:
    """The stream's ServicerContext: reads `messages` then the router's half-close, records what is written."""

    def __init__(self, messages: list[bytes]):
        self._messages = [pb.MultiplexedRequests.FromString(m) for m in messages]
        self.written: list[pb.MultiplexedReplies] = []

    async def read(self):
        return self._messages.pop(0) if self._messages else grpc.aio.EOF

    async def write(self, message: pb.MultiplexedReplies) -> None:
        self.written.append(message)


def test_the_replies_that_wait_while_the_stream_writes_go_in_one_message():
    async def whole(req, context):
        return pb.GenerateChunk(request_id=req.request_id, token_ids=[1, 2], finish_reason=pb.LENGTH)

    async def never(req, context):  # the stream's requests here are all whole
        raise AssertionError("not a whole request")
        yield

    async def body():
        entries = b"".join(generate_entry(i, request(f"r{i}").SerializeToString(), whole=True) for i in (1, 2, 3))
        context = StreamContext([entries])
        await asyncio.wait_for(Multiplexer(never, whole, context, lambda: False).run(), 5)
        assert [[r.call_id for r in m.replies] for m in context.written] == [[1, 2, 3]]
        assert [r.chunk.request_id for r in context.written[0].replies] == ["r1", "r2", "r3"]

    run(body())
