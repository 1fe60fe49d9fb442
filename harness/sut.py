"""The LoadGen SUT: each query becomes one RouterService.Generate stream, run on a dedicated asyncio
event-loop thread so issue_queries never blocks LoadGen; every issued query is completed exactly once.

The stream goes through a RouterPath (harness/embedded_routing.py): a RouterClient to the router process, or with
router.mode embedded the router started in this process, which streams straight from the chosen worker.

When the router is unreachable (it died and is being restarted) or its call ends CANCELLED (which this SUT never
asks for while it still wants the answer: its own cancellations come as asyncio.CancelledError at teardown), a
query not yet answered is sent again, resuming after the tokens it already received (contract.resend, as the router
replays a request on another worker), for up to `reconnect_s` without progress. (Product-path Offline runs on the
H200 saw a few calls end CANCELLED among 1,500 in flight: run42, run53, run64; the side that cancels is not yet
known.)"""

from __future__ import annotations

import array
import asyncio
import contextlib
import functools
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc.aio
import mlperf_loadgen as lg

from contract import event_loop
from contract.resend import Resume, resend_with_resume
from contract.types import PromptInput
from contract.wire import pb
from harness.embedded_routing import EmbeddedRouting, RouterPath, start_embedded_router
from harness.progress import Progress
from router.shards import connect_router

logger = logging.getLogger(__name__)


class PreparedSampleLike(Protocol):
    prompt: PromptInput | None
    error: str | None


class SampleSource(Protocol):
    def get(self, index: int) -> PreparedSampleLike: ...


# Router call endings worth sending the query again for (see the module docstring).
RESENDABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class SampleFailed(Exception):
    """A query that gets an empty response: its prompt could not be built or its request failed."""


@dataclass
class _Attempts:
    """One query's calls to the router: how many were sent again, when it last made progress (tokens or its first
    call) and when it must have its answer."""

    progress_at: float
    deadline: float
    number: int = 0
    received_before: int = 0  # tokens it had when its latest call was sent


@dataclass(frozen=True)
class SUTSettings:
    router_address: str
    max_tokens: int = 150
    timeout_s: float = 7200.0
    token: str | None = None
    report_first_token: bool = False  # LoadGen's use_token_latencies (off for this benchmark)
    reconnect_s: float = 0.0  # how long a query waits for an unreachable router to come back (0: fails at once)
    reconnect_interval_s: float = 0.5
    stream_interval: int = 0  # GenerateRequest.stream_interval: 0 streams every engine step's tokens
    latency_bound_s: float = 0.0  # GenerateRequest.latency_bound_s: the scenario's target latency (0: Offline)
    # At most this many router calls at once (None: no bound); the other issued queries wait here, in issue order.
    # An Offline test issues every sample at once (48,289 on the real dataset), more than a router admits
    # (its workers' in-flight limits plus its queue): the rest would be refused RESOURCE_EXHAUSTED, and the
    # images of all of them would sit in the router's memory.
    max_inflight: int | None = None
    # router.mode embedded: route in this process instead of at router_address (harness/embedded_routing.py)
    embedded: EmbeddedRouting | None = None


class FailedSamplesLog:
    """The failed queries of one test ({sample_index, error} per query), written as one JSON list at
    close (atomically) next to LoadGen's logs, where the submission tree builder files it for the audit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._records: list[dict[str, object]] = []
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return len(self._records)

    def record(self, sample_index: int, error: str) -> None:
        with self._lock:
            self._records.append({"sample_index": sample_index, "error": error})

    def close(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        with self._lock:
            partial.write_text(json.dumps(self._records, indent=1) + "\n", encoding="utf-8")
        os.replace(partial, self.path)


class RouterSUT:
    """Sends queries to the router (over gRPC, or the one in this process); completes them with the detokenized
    UTF-8 text."""

    def __init__(
        self,
        samples: SampleSource,
        decode: Callable[[Sequence[int]], str],
        settings: SUTSettings,
        failed_samples: FailedSamplesLog,
        progress: Progress | None = None,
    ) -> None:
        self._samples = samples
        self._decode = decode
        self._settings = settings
        self._failed = failed_samples
        self.progress = progress
        self._outstanding: dict[int, int] = {}  # LoadGen query id -> qsl index, until completed
        self.resent = 0  # queries sent again because the router was unreachable or their call was cancelled
        self._tasks: set[asyncio.Task] = set()
        self._slots = asyncio.Semaphore(settings.max_inflight) if settings.max_inflight else contextlib.nullcontext()
        self._loop = event_loop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sut-event-loop", daemon=True)
        self._thread.start()
        try:
            self._client: RouterPath = self._call(self._connect())
        except BaseException:  # no router path (an embedded router that could not start): no loop left behind
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
            raise
        self.handle = lg.ConstructSUT(self.issue_queries, self.flush_queries)

    async def _connect(self) -> RouterPath:
        """The path to the workers, made in this loop (its channels, and an embedded router's server, bind to it)."""
        if self._settings.embedded is not None:
            return await start_embedded_router(self._settings.embedded)
        return connect_router(self._settings.router_address, self._settings.token)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # LoadGen's thread ------------------------------------------------------------------------------

    def issue_queries(self, query_samples: Sequence[lg.QuerySample]) -> None:
        batch = [(q.id, q.index) for q in query_samples]
        if self.progress is not None:
            self.progress.issued(len(batch))
        self._loop.call_soon_threadsafe(self._start_queries, batch, time.monotonic())

    def flush_queries(self) -> None:
        """Nothing to flush: every query is sent to the router as soon as it is issued."""

    # The event loop's thread -----------------------------------------------------------------------

    def _start_queries(self, batch: list[tuple[int, int]], issued_at: float) -> None:
        for query_id, index in batch:
            self._outstanding[query_id] = index
            task = self._loop.create_task(self._serve(query_id, index, issued_at))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _serve(self, query_id: int, index: int, issued_at: float) -> None:
        text, n_tokens, error = "", 0, None
        try:
            prepared = self._samples.get(index)
            if prepared.error is not None or prepared.prompt is None:
                raise SampleFailed(f"prompt could not be built: {prepared.error}")
            async with self._slots:  # the per-request timeout starts once the query goes to the router
                token_ids = await asyncio.wait_for(
                    self._generate(query_id, index, prepared.prompt), self._settings.timeout_s
                )
            text, n_tokens = self._decode(token_ids), len(token_ids)
        except asyncio.TimeoutError:
            error = f"no response within {self._settings.timeout_s:g} s"
        except grpc.aio.AioRpcError as exc:
            error = f"router call failed: {exc.code().name}: {exc.details()}"
        except Exception as exc:  # any failure still completes the query, or LoadGen would hang
            error = str(exc) or type(exc).__name__
        if error is not None:
            logger.error("sample %d (query %d) failed: %s", index, query_id, error)
            self._failed.record(index, error)
        self._complete(query_id, text.encode("utf-8"), n_tokens)
        if self.progress is not None:
            self.progress.completed(time.monotonic() - issued_at, ok=error is None)

    async def _generate(self, query_id: int, index: int, prompt: PromptInput) -> list[int]:
        """The query's tokens; while the router's call ends RESENDABLE, re-sends it with the tokens received so far
        (contract.resend)."""
        resume, now = Resume(self._settings.max_tokens), time.monotonic()
        attempts = _Attempts(progress_at=now, deadline=now + self._settings.timeout_s)
        send = functools.partial(self._attempt, query_id, index, prompt, resume, attempts)
        resend = functools.partial(self._resend, query_id, index, resume, attempts)
        async for _ in resend_with_resume(send, resume, resend):
            pass
        return resume.received

    async def _resend(self, query_id: int, index: int, resume: Resume, attempts: _Attempts, exc: Exception) -> bool:
        """Whether to send the query again after its call ended with `exc`: a RESENDABLE ending, while it has made
        progress within reconnect_s and its deadline is ahead; then after reconnect_interval_s."""
        if not isinstance(exc, grpc.aio.AioRpcError) or exc.code() not in RESENDABLE:
            return False
        if len(resume.received) > attempts.received_before:
            attempts.progress_at = time.monotonic()
        retry_at = time.monotonic() + self._settings.reconnect_interval_s
        if retry_at - attempts.progress_at > self._settings.reconnect_s or retry_at >= attempts.deadline:
            return False
        attempts.number += 1
        attempts.received_before = len(resume.received)
        self.resent += 1
        logger.warning("query %d (sample %d): router call %s (%s); sending it again (attempt %d, %d tokens kept)",
                       query_id, index, exc.code().name, exc.details(), attempts.number + 1, len(resume.received))
        await asyncio.sleep(self._settings.reconnect_interval_s)
        return True

    def _request(self, query_id: int, index: int, prompt: PromptInput, attempt: int, patch: pb.GenerateRequest
                 ) -> pb.GenerateRequest:
        request = pb.GenerateRequest(
            request_id=f"q{query_id}-s{index}" + (f"-r{attempt}" if attempt else ""),
            prompt_token_ids=prompt.token_ids,
            images=prompt.images,
            sampling=pb.SamplingParams(use_model_defaults=True, max_tokens=self._settings.max_tokens),
            deadline_s=self._settings.timeout_s,
            stream_interval=self._settings.stream_interval,
            latency_bound_s=self._settings.latency_bound_s,
        )
        request.MergeFrom(patch)  # the tokens received so far, and the rest of max_tokens
        return request

    async def _attempt(self, query_id: int, index: int, prompt: PromptInput, resume: Resume, attempts: _Attempts,
                       patch: pb.GenerateRequest) -> AsyncIterator[pb.GenerateChunk]:
        """One call to the router, streamed until a finish reason has arrived and the router has ended the call.

        The call is read to its end, not left at the final chunk: the router frees the call's admission slot when
        its side of the call ends, so a query sent on the SUT slot this one frees is never refused for it."""
        finished = False
        try:
            async for chunk in self._client.generate(self._request(query_id, index, prompt, attempts.number, patch)):
                if finished:
                    raise SampleFailed("router sent a chunk after the final one")
                if chunk.token_ids and not resume.received and self._settings.report_first_token:
                    self._first_token(query_id, chunk.token_ids[0])
                if chunk.finish_reason in (pb.ERROR, pb.ABORT):
                    raise SampleFailed(f"{pb.FinishReason.Name(chunk.finish_reason)}: {chunk.error or 'no detail'}")
                finished = chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                yield chunk
        except grpc.aio.AioRpcError as exc:
            if not finished:
                raise
            # the answer is whole: sending it again would continue past its stop
            logger.warning("query %d: router call ended %s after its final chunk", query_id, exc.code().name)
        if not finished:
            raise SampleFailed("router stream ended without a finish reason")

    def _first_token(self, query_id: int, token_id: int) -> None:
        data = array.array("B", self._decode([token_id]).encode("utf-8"))
        address, length = data.buffer_info()
        lg.FirstTokenComplete([lg.QuerySampleResponse(query_id, address, length, 1)])

    def _complete(self, query_id: int, data: bytes, n_tokens: int) -> None:
        if self._outstanding.pop(query_id, None) is None:
            logger.error("query %d completed twice; ignoring the second completion", query_id)
            return
        buffer = array.array("B", data)
        address, length = buffer.buffer_info()
        lg.QuerySamplesComplete([lg.QuerySampleResponse(query_id, address, length, n_tokens)])

    # Teardown --------------------------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        return self._call(self._count_outstanding())

    async def _count_outstanding(self) -> int:
        return len(self._outstanding)

    def close(self) -> None:
        """Cancels what is still running (completing it), closes the channel and the loop thread."""
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        lg.DestroySUT(self.handle)

    async def _shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for query_id, index in list(self._outstanding.items()):
            self._failed.record(index, "the test ended before the query finished")
            self._complete(query_id, b"", 0)
        await self._client.close()
