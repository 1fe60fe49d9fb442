"""A worker's side of WorkerService.GenerateMultiplexed: many requests on one stream from the router.

Each request runs in a task of its own through the servicer's Generate (GenerateWhole when the router asks for a
whole reply), the same code a call of its own runs, with a RequestContext standing in for the call's ServicerContext:
its time_remaining is the request's deadline_s, its abort ends the request with a status, its done callbacks run
when the request ends. A `cancel` from the router cancels the request's task, which aborts the engine's request as a
cancelled call does; so does the request's deadline passing, and the stream ending (every request on it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

import grpc
import grpc.aio

from contract.wire import pb

log = logging.getLogger(__name__)


# A message of the stream stops taking replies once this large (a reply is ~10-500 bytes; a whole reply of many
# tokens more), so it stays far below the router's max_message_bytes.
_BATCH_BYTES = 1 << 20


class CallAborted(Exception):
    """A handler aborted its request (RequestContext.abort): it ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class RequestContext:
    """What the servicer's handlers use of a ServicerContext, for one request on the stream."""

    def __init__(self, deadline_s: float):
        self.deadline = time.monotonic() + deadline_s if deadline_s > 0 else None
        self._callbacks: list[Callable] = []

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def add_done_callback(self, callback: Callable) -> None:
        self._callbacks.append(callback)

    async def abort(self, code: grpc.StatusCode, details: str):
        raise CallAborted(code, details)

    def end(self) -> None:
        for callback in self._callbacks:
            callback(self)


Generate = Callable[[pb.GenerateRequest, RequestContext], AsyncGenerator[pb.GenerateChunk, None]]
GenerateWhole = Callable[[pb.GenerateRequest, RequestContext], Awaitable[pb.GenerateChunk]]


class Multiplexer:
    """Serves one GenerateMultiplexed stream: run() returns when the stream ends, its requests aborted."""

    def __init__(self, generate: Generate, generate_whole: GenerateWhole, context: grpc.aio.ServicerContext,
                 stopping: Callable[[], bool]):
        """stopping: whether the server is stopping; a request that comes meanwhile is refused UNAVAILABLE, as gRPC
        refuses a new call during a graceful stop (the router replays it on another worker)."""
        self._generate = generate
        self._stopping = stopping
        self._generate_whole = generate_whole
        self._context = context
        self._requests: dict[int, asyncio.Task] = {}
        # (call id, its chunk or how it ended, a future to resolve once it is written), in order; None: the router
        # sends no more
        self._outbox: asyncio.Queue[tuple[int, pb.GenerateChunk | pb.CallStatus, asyncio.Future | None] | None] = (
            asyncio.Queue())

    async def run(self) -> None:
        """Writes the replies, every one that waited while the last write was under way in one message."""
        reader = asyncio.get_running_loop().create_task(self._read())
        outbox = self._outbox
        try:
            while (item := await outbox.get()) is not None:
                batch, written, size = pb.MultiplexedReplies(), [], 0
                while True:
                    call_id, outcome, done = item
                    reply = batch.replies.add(call_id=call_id)
                    (reply.chunk if isinstance(outcome, pb.GenerateChunk) else reply.status).CopyFrom(outcome)
                    size += outcome.ByteSize()
                    if done is not None:
                        written.append(done)
                    if outbox.empty() or size >= _BATCH_BYTES:
                        break
                    if (item := outbox.get_nowait()) is None:
                        outbox.put_nowait(None)
                        break
                await self._context.write(batch)
                for done in written:
                    if not done.done():
                        done.set_result(None)
        finally:
            reader.cancel()
            tasks = [reader, *self._requests.values()]
            for task in tasks:
                task.cancel()  # a request still running is aborted on the engine
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        while (batch := await self._context.read()) is not grpc.aio.EOF:
            for message in batch.requests:
                call_id = message.call_id
                if message.HasField("generate"):
                    if self._stopping():
                        refused = pb.CallStatus(code=grpc.StatusCode.UNAVAILABLE.value[0],
                                                details="the worker is stopping")
                        self._outbox.put_nowait((call_id, refused, None))
                        continue
                    task = loop.create_task(self._serve(call_id, message.generate, message.whole))
                    self._requests[call_id] = task
                elif (task := self._requests.pop(call_id, None)) is not None:  # cancel
                    task.cancel()
        if self._requests:  # the router half-closed the stream: its requests run to their end
            await asyncio.gather(*self._requests.values(), return_exceptions=True)
        self._outbox.put_nowait(None)

    async def _serve(self, call_id: int, request: pb.GenerateRequest, whole: bool) -> None:
        context = RequestContext(request.deadline_s)
        send = self._outbox.put_nowait
        loop = asyncio.get_running_loop()
        chunks = None
        try:
            async with asyncio.timeout(context.time_remaining()):
                if whole:
                    send((call_id, await self._generate_whole(request, context), None))
                    return
                chunks = self._generate(request, context)
                async for chunk in chunks:
                    if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        send((call_id, chunk, None))
                        return  # the router's last reply about call_id
                    # The next chunk is read once this one is written, as a call's handler writes each before the
                    # next: what the engine produces meanwhile joins that chunk (WorkerServer.coalesce), so a busy
                    # stream carries fewer, larger chunks rather than one an engine step.
                    written = loop.create_future()
                    send((call_id, chunk, written))
                    await written
            status = pb.CallStatus(code=grpc.StatusCode.OK.value[0])  # ended without a final chunk
        except CallAborted as exc:
            status = pb.CallStatus(code=exc.code.value[0], details=exc.details)
        except TimeoutError:
            status = pb.CallStatus(code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0], details="Deadline Exceeded")
        except Exception as exc:  # as gRPC answers a handler that raised
            log.exception("request %s on the stream failed", request.request_id)
            status = pb.CallStatus(code=grpc.StatusCode.UNKNOWN.value[0], details=f"Unexpected {exc!r}")
        finally:
            self._requests.pop(call_id, None)
            if chunks is not None:
                await chunks.aclose()  # the handler's clean-up, where it stopped at its final chunk
            context.end()
        send((call_id, status, None))
