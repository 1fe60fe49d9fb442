"""Many attempts on one bidirectional stream per worker (WorkerService.GenerateMultiplexed), a WorkerTransport.

A gRPC call costs the router ~0.15 ms of CPU and the worker as much again (benchmarks/README.md, thirty-first and
thirty-second passes); on a stream opened once per worker, an attempt is one message each way for a whole reply. Each
attempt gets a call id on its stream; a writer task sends what the attempts have to say in order, every entry that
waited while its last write was under way in one message, and a reader task hands each reply to the attempt its id
names.

What a gRPC call did for each attempt is done here, attempt by attempt:
- its deadline: a timer ends the attempt with DEADLINE_EXCEEDED and cancels it on the worker (which also ends it at
  GenerateRequest.deadline_s on its own);
- cancel(): the caller went away, or the registry cut a down worker's attempts; a `cancel` message makes the worker
  abort the request, and a reader waiting for the attempt's next chunk gets asyncio.CancelledError;
- the stream's failure (the worker died, restarted or was cut off): every attempt on it fails with the stream's own
  status (UNAVAILABLE for a dead worker), which the dispatcher answers as it answers a failed call, by marking the
  worker down and replaying each attempt elsewhere; the next attempt opens a new stream.

An attempt whose request is larger than `max_request_bytes` (inline images) takes a call of its own instead
(router.worker_calls.PerCall): on one stream every message waits for the one before it to be written, so a request of
megabytes would hold up every other request to its worker for as long as its bytes take.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque

import grpc
import grpc.aio

from contract.multiplexed_wire import cancel_entry, generate_entry
from contract.wire import pb
from router.registry import MULTIPLEXED_METHOD, WorkerEntry
from router.worker_calls import PerCall, Upstream, WorkerCall

log = logging.getLogger(__name__)

_STATUS = {code.value[0]: code for code in grpc.StatusCode}
# A message of the stream stops taking entries once this large (so it is at most this plus one max_request_bytes).
_BATCH_BYTES = 1 << 20


def call_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a gRPC call ending with `code` raises."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class StreamPerWorker:
    """One GenerateMultiplexed stream per worker, opened at its first attempt and again after it fails."""

    def __init__(self, metadata, max_request_bytes: int):
        self._metadata = metadata
        self._max_request_bytes = max_request_bytes
        self._per_call = PerCall(metadata)
        self._streams: dict[WorkerEntry, _WorkerStream] = {}

    def open(self, entry: WorkerEntry, upstream: Upstream) -> WorkerCall:
        if len(upstream.payload) > self._max_request_bytes:
            return self._per_call.open(entry, upstream)
        stream = self._streams.get(entry)
        if stream is None:
            stream = self._streams[entry] = _WorkerStream(entry, self._metadata, self._forget)
        return stream.start(upstream)

    def _forget(self, stream: _WorkerStream) -> None:
        if self._streams.get(stream.entry) is stream:
            del self._streams[stream.entry]

    async def close(self) -> None:
        for stream in list(self._streams.values()):
            await stream.close()


class _WorkerStream:
    """The stream to one worker: its attempts in flight by call id, a writer task and a reader task."""

    def __init__(self, entry: WorkerEntry, metadata, forget):
        self.entry = entry
        self._forget = forget
        self._call = entry.multiplexed(metadata=metadata)
        self._attempts: dict[int, _StreamCall] = {}
        self._ids = itertools.count(1)  # call_id 0 would not be on the wire (proto3 leaves defaults out)
        self._outbox: deque[bytes] = deque()  # MultiplexedRequests entries not written yet
        self._ready: asyncio.Future | None = None  # the writer waits on it for the outbox to fill
        self._ended = False
        loop = asyncio.get_running_loop()
        self._writer = loop.create_task(self._write())
        self._reader = loop.create_task(self._read())

    def start(self, upstream: Upstream) -> _StreamCall:
        call_id = next(self._ids)
        attempt = self._attempts[call_id] = _StreamCall(self, call_id, upstream)
        self._send(generate_entry(call_id, upstream.payload, upstream.whole))
        return attempt

    def cancel(self, call_id: int) -> None:
        """The attempt gave up before its end: the worker aborts it."""
        if self._attempts.pop(call_id, None) is not None and not self._ended:
            self._send(cancel_entry(call_id))

    def _send(self, entry: bytes) -> None:
        self._outbox.append(entry)
        if self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    def ended(self, call_id: int) -> None:
        """The attempt's last reply arrived: nothing more is sent or expected about it."""
        self._attempts.pop(call_id, None)

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        outbox = self._outbox
        try:
            while True:
                if not outbox:
                    self._ready = loop.create_future()
                    await self._ready
                size, batch = 0, []
                while outbox and size < _BATCH_BYTES:
                    batch.append(outbox.popleft())
                    size += len(batch[-1])
                await self._call.write(b"".join(batch))
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            # the stream is over; the reader learns how from its status
            log.debug("stream to worker %s: write failed: %r", self.entry.worker_id, exc)

    async def _read(self) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, f"worker {self.entry.worker_id} ended the stream"
        try:
            while True:
                reply = await self._call.read()
                if reply is grpc.aio.EOF:
                    break
                attempts = self._attempts
                for item in reply.replies:
                    attempt = attempts.get(item.call_id)
                    if attempt is not None:  # else it was cancelled, its reply crossing the cancel
                        attempt.deliver(item)
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, "the router closed the stream"
            raise
        finally:
            self._fail(code, details)

    def _fail(self, code: grpc.StatusCode, details: str) -> None:
        """The stream is over: every attempt on it ends with its status; the next attempt opens a new stream."""
        if self._ended:
            return
        self._ended = True
        self._forget(self)
        self._writer.cancel()
        self._call.cancel()
        attempts, self._attempts = list(self._attempts.values()), {}
        if attempts:
            log.info("stream to worker %s ended (%s %s): %d attempts in flight fail", self.entry.worker_id, code.name,
                     details, len(attempts))
        error = call_error(code, details)
        for attempt in attempts:
            attempt.fail(error)

    async def close(self) -> None:
        self._reader.cancel()
        for task in (self._reader, self._writer):
            try:
                await task
            except asyncio.CancelledError:
                pass


class _StreamCall:
    """One attempt on a stream: its chunks as they arrive, or how it ended (a WorkerCall)."""

    __slots__ = ("_stream", "_id", "_whole", "_chunks", "_error", "_done", "_waiter", "_timer")

    def __init__(self, stream: _WorkerStream, call_id: int, upstream: Upstream):
        self._stream = stream
        self._id = call_id
        self._whole = upstream.whole
        self._chunks: deque[pb.GenerateChunk] = deque()
        self._error: BaseException | None = None
        self._done = False  # nothing more will arrive
        self._waiter: asyncio.Future | None = None
        self._timer = None
        if upstream.timeout is not None:
            self._timer = asyncio.get_running_loop().call_later(upstream.timeout, self._expire)

    def deliver(self, reply: pb.MultiplexedReply) -> None:
        if reply.HasField("chunk"):
            chunk = reply.chunk
            self._chunks.append(chunk)
            if self._whole or chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                self._end()
        else:
            status = reply.status
            if status.code != grpc.StatusCode.OK.value[0]:
                self._error = call_error(_STATUS.get(status.code, grpc.StatusCode.UNKNOWN), status.details)
            self._end()
        self._wake()

    def fail(self, error: BaseException) -> None:
        """The attempt ends with `error` (the stream failed, or its deadline passed)."""
        if not self._done:
            self._error = error
            self._end()
            self._wake()

    async def next(self) -> pb.GenerateChunk | None:
        while True:
            if self._chunks:
                return self._chunks.popleft()
            if self._error is not None:
                raise self._error
            if self._done:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def cancel(self) -> None:
        if self._done:
            return
        self._stream.cancel(self._id)
        self._chunks.clear()
        self.fail(asyncio.CancelledError())  # as a cancelled gRPC call's reader gets: the registry cut it

    async def close(self) -> None:
        pass  # its last reply ended it on the stream

    def _expire(self) -> None:
        self._timer = None
        if not self._done:
            self._stream.cancel(self._id)
            self.fail(call_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def _end(self) -> None:
        self._done = True
        self._stream.ended(self._id)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
