"""How the dispatcher reaches a worker for one attempt of a request: the WorkerCall it reads chunks from, and the
WorkerTransport that opens one. This module's transport makes a gRPC call per attempt (WorkerService.Generate, or
GenerateWhole for a whole reply); router.worker_stream multiplexes attempts on one stream per worker.

Every transport behaves as a gRPC call does, so the dispatcher handles them alike: a worker's failure or refusal
raises grpc.aio.AioRpcError with the status the call would have ended with (DEADLINE_EXCEEDED once the attempt's
timeout passes), and cancel() ends the attempt on the worker, whose engine aborts it; a reader waiting in next()
when cancel() comes (the registry cutting a down worker's calls) gets asyncio.CancelledError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from contract.wire import pb
from router.registry import WorkerEntry


@dataclass(frozen=True)
class Upstream:
    """One attempt's request to a worker, serialized: what the call sends and how the router names it."""

    request_id: str
    payload: bytes
    timeout: float | None
    whole: bool  # the caller reads the answer only whole: GenerateWhole's one reply


class WorkerCall(Protocol):
    async def next(self) -> pb.GenerateChunk | None:
        """The attempt's next chunk; None when it ended with no more (a whole attempt has one)."""

    def cancel(self) -> None:
        """End the attempt now; the worker aborts it. Safe to call more than once, and after its end."""

    async def close(self) -> None:
        """Let go of an attempt that ended with its final chunk."""


class WorkerTransport(Protocol):
    def open(self, entry: WorkerEntry, upstream: Upstream) -> WorkerCall: ...

    async def close(self) -> None:
        """End every attempt in flight (the router is stopping)."""


class PerCall:
    """One gRPC call an attempt."""

    def __init__(self, metadata):
        self._metadata = metadata

    def open(self, entry: WorkerEntry, upstream: Upstream) -> WorkerCall:
        return _Call(entry, upstream, self._metadata)

    async def close(self) -> None:
        pass  # the registry closes the channels, which ends their calls


class _Call:
    __slots__ = ("_call", "_messages")

    def __init__(self, entry: WorkerEntry, upstream: Upstream, metadata):
        method = entry.generate_whole if upstream.whole else entry.generate
        self._call = method(upstream.payload, timeout=upstream.timeout, metadata=metadata)
        self._messages = None if upstream.whole else aiter(self._call)

    async def next(self) -> pb.GenerateChunk | None:
        if self._messages is None:
            return await self._call
        return await anext(self._messages, None)

    def cancel(self) -> None:
        self._call.cancel()

    async def close(self) -> None:
        if self._messages is not None:  # gRPC's reader of the call, closed here rather than by the loop's finalizer
            await self._messages.aclose()
