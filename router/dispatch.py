"""One request's way through the router: admission, worker choice, (disaggregated) streaming, migration.

Both front ends (gRPC router.server, HTTP router.openai_http) call Dispatcher.generate and get one stream
of GenerateChunk per request, whatever happened upstream: no gap, no duplicate, exactly one final chunk.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import grpc.aio

from contract.resend import Resume, resend_with_resume
from contract.transport import call_metadata
from contract.wire import pb
from router.admission import Admission, Rejected
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.policies import RouteRequest, Selector
from router.registry import SERVING_ROLES, Booking, Registry, WorkerEntry
from router.worker_calls import PerCall, Upstream, WorkerTransport
from router.worker_stream import StreamPerWorker

log = logging.getLogger(__name__)

# Upstream failures worth replaying elsewhere (the worker died, restarted, was cut off or is overloaded).
_MIGRATABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class RouterError(Exception):
    """The request was refused or timed out before it could be served; `code` is the gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class _WorkerFailed(Exception):
    def __init__(self, stage: str, reason: str):
        super().__init__(reason)
        self.stage = stage


class _Aborted(Exception):
    """The caller aborted the request while it was between workers: it ends with finish_reason ABORT."""


@dataclass
class _Migration:
    """One request's migrations so far, and whether a remote prefill may still serve it."""

    retries: int = 0
    remote_prefill_ok: bool = True


@dataclass
class _Active:
    """A request this router holds: where it is running now, and whether the caller aborted it."""

    request_id: str
    aborted: bool = False
    entry: WorkerEntry | None = None
    upstream_id: str = ""
    attempts: int = 0
    emitted: list[int] = field(default_factory=list)
    complete_early: bool = False  # the caller has its whole answer before the final chunk (a stop string)
    outcome: str | None = None  # how it ended, once counted
    wire: bytes = b""  # the caller's request serialized once, images and all: every attempt's upstream starts with it


class Dispatcher:
    def __init__(self, config: RouterConfig, registry: Registry):
        self.config = config
        self.registry = registry
        self.selector = Selector(config.policy)
        self.admission = Admission(config.limits.max_queue)
        self.inflight = 0
        self.metrics = RouterMetrics(registry, lambda: self.admission.queue_depth, lambda: self.inflight)
        self._metadata = call_metadata(config.token)
        self._active: dict[str, _Active] = {}
        self.transport: WorkerTransport = (
            StreamPerWorker(self._metadata, config.worker_stream.max_request_bytes)
            if config.worker_transport == "stream" else PerCall(self._metadata))

    # -- public ---------------------------------------------------------------------------------

    async def generate(self, request: pb.GenerateRequest, timeout_s: float | None = None) -> AsyncIterator[pb.GenerateChunk]:
        """Serve `request`; raises RouterError (refused, no worker, deadline) before or instead of chunks.

        `timeout_s` is the caller's transport deadline; request.deadline_s, if set and sooner, wins. The request is
        the dispatcher's from here on: once admitted, its images are moved out of it (into the serialized request
        every attempt sends).
        """
        arrival = time.monotonic()
        self._validate(request)
        limits = [t for t in (timeout_s, request.deadline_s or None) if t is not None]
        deadline = arrival + min(limits) if limits else None
        if not self.registry.healthy(SERVING_ROLES):
            self.metrics.count(self.metrics.rejections, "no_worker")
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no healthy worker is registered")
        active = _Active(request.request_id)
        self._active[request.request_id] = active
        try:
            await self._admit(deadline)
            active.wire = request.SerializeToString()
            request.ClearField("images")  # they travel in active.wire from here on: held once, never copied per attempt
            self.inflight += 1
            holds_slot = True

            def leave() -> None:  # the request's admission slot goes to the next one
                nonlocal holds_slot
                if holds_slot:
                    holds_slot = False
                    self.inflight -= 1
                    self.admission.notify()

            ended_by = "CANCELLED"  # the caller closed the stream or went away before the final chunk
            try:
                async for chunk in self._serve(request, active, deadline, arrival):
                    if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        leave()  # before the caller has its answer, which may send the next request at once
                        self._count_end(active, arrival, pb.FinishReason.Name(chunk.finish_reason))
                    yield chunk
            except Exception:  # RouterError (a deadline, a worker's refusal) or a failure of the router's own
                ended_by = "ERROR"
                raise
            finally:
                leave()
                self._count_end(active, arrival, "STOP" if active.complete_early else ended_by)
        finally:
            self._active.pop(request.request_id, None)

    async def close(self) -> None:
        """End the attempts in flight on the workers (the router is stopping)."""
        await self.transport.close()

    def complete_early(self, request_id: str) -> None:
        """The caller has the whole answer before the final chunk (a stop string matched): when it closes the
        stream, which cancels the worker's request, the request counts as ended by STOP, not CANCELLED."""
        active = self._active.get(request_id)
        if active is not None:
            active.complete_early = True

    async def abort(self, request_id: str) -> bool:
        """Stop a request: the worker aborts it and the stream ends with finish_reason ABORT."""
        active = self._active.get(request_id)
        if active is None:
            return False
        active.aborted = True
        entry = active.entry
        if entry is not None:
            try:
                await entry.stub.Abort(pb.AbortRequest(request_id=active.upstream_id), metadata=self._metadata, timeout=5)
            except grpc.aio.AioRpcError as exc:  # the worker is gone: the stream fails and ends as ABORT
                log.info("abort of %s on %s failed: %s", request_id, entry.worker_id, exc.code())
        self.admission.notify()
        return True

    def _count_end(self, active: _Active, arrival: float, outcome: str) -> None:
        """Every admitted request is counted once, as it ends, whatever ended it (the final chunk's reason, a
        stop string, the caller going away, an error); the duration is arrival to that moment."""
        if active.outcome is None:
            active.outcome = outcome
            self.metrics.count(self.metrics.requests, outcome)
            self.metrics.duration.observe(time.monotonic() - arrival)

    # -- admission ------------------------------------------------------------------------------

    def _validate(self, request: pb.GenerateRequest) -> None:
        problem = None
        if not request.request_id:
            problem = "request_id is empty"
        elif request.request_id in self._active:
            problem = f"request_id {request.request_id!r} is already in flight"
        elif not request.prompt_token_ids:
            problem = f"request {request.request_id!r}: prompt_token_ids is empty"
        elif request.sampling.max_tokens <= 0:
            problem = f"request {request.request_id!r}: sampling.max_tokens must be > 0"
        if problem:
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, problem)

    def _has_capacity(self) -> bool:
        if self.inflight >= self.config.limits.max_inflight_total:
            return False
        per_worker = self.config.limits.max_inflight_per_worker
        return any(e.inflight < per_worker for e in self.registry.healthy(SERVING_ROLES))

    async def _admit(self, deadline: float | None) -> None:
        if self.admission.admit_now(self._has_capacity):
            return  # the common case: no queue, no timer
        try:
            async with asyncio.timeout(None if deadline is None else deadline - time.monotonic()):
                await self.admission.admit(self._has_capacity)
        except Rejected as exc:
            self.metrics.count(self.metrics.rejections, "queue_full")
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except TimeoutError:
            self.metrics.count(self.metrics.rejections, "deadline_in_queue")
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while queued") from None

    # -- serving with migration -----------------------------------------------------------------

    async def _serve(
        self, request: pb.GenerateRequest, active: _Active, deadline: float | None, arrival: float
    ) -> AsyncIterator[pb.GenerateChunk]:
        """The request's chunks, migrated to another worker when one fails (contract.resend: resuming after the
        tokens it emitted), each chunk's latency observed; the final chunk counts the prompt and every token."""
        if active.aborted:  # while it was queued
            yield self._final(request, active, pb.ABORT)
            return
        migration = _Migration()
        attempts = resend_with_resume(
            functools.partial(self._attempt, request, active, deadline, migration),
            Resume(request.sampling.max_tokens, active.emitted),
            functools.partial(self._migrate, request, active, deadline, migration),
        )
        ended, last_chunk_at = False, None
        timed = not request.final_chunk_only  # tokens held back to the final chunk say nothing of TTFT or ITL
        try:
            async for chunk in attempts:
                if timed and chunk.token_ids:
                    now = time.monotonic()
                    if last_chunk_at is None:
                        self.metrics.ttft.observe(now - arrival)
                    else:
                        self.metrics.itl.observe((now - last_chunk_at) / len(chunk.token_ids))
                    last_chunk_at = now
                ended = chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                if ended:
                    chunk.prompt_tokens = len(request.prompt_token_ids)
                    chunk.completion_tokens = len(request.resume_token_ids) + len(active.emitted)
                yield chunk
        except _Aborted:
            yield self._final(request, active, pb.ABORT)
            return
        except _WorkerFailed as failure:  # migration.max_retries spent
            yield self._final(request, active, pb.ERROR, f"{failure.stage} failed after {migration.retries} "
                              f"migrations: {failure}")
            return
        if not ended:  # every token arrived, the call that carried them failed
            yield self._final(request, active, pb.LENGTH)

    def _attempt(self, request: pb.GenerateRequest, active: _Active, deadline: float | None, migration: _Migration,
                 patch: pb.GenerateRequest) -> AsyncIterator[pb.GenerateChunk]:
        """One attempt: disaggregated for a fresh request when a prefill pool can take it (and has not failed it),
        else aggregated, resuming after the tokens emitted (patch)."""
        if (migration.remote_prefill_ok and not active.emitted and not request.resume_token_ids
                and self._remote_prefill_pool(request)):
            return self._disaggregated(request, active, deadline)
        return self._aggregated(request, active, deadline, patch)

    async def _migrate(self, request: pb.GenerateRequest, active: _Active, deadline: float | None,
                       migration: _Migration, exc: Exception) -> bool:
        """Whether to replay the request after an attempt failed with `exc`: a worker's failure, within
        migration.max_retries, once a serving worker is healthy; raises _Aborted when the caller aborted it."""
        if not isinstance(exc, _WorkerFailed):
            return False
        if active.aborted:
            raise _Aborted
        if migration.retries >= self.config.migration.max_retries:
            return False
        migration.retries += 1
        kind = "ongoing_request" if active.emitted else "new_request"
        self.metrics.count(self.metrics.migrations, kind)
        log.info("request %s: %s failed (%s); migrating (%s)", request.request_id, exc.stage, exc, kind)
        if exc.stage == "prefill":
            migration.remote_prefill_ok = False  # Dynamo's fallback: prefill on the decode worker
        await self._wait_for_worker(active, deadline)
        if active.aborted:
            raise _Aborted
        return True

    async def _wait_for_worker(self, active: _Active, deadline: float | None) -> None:
        """Until a serving worker is healthy, the caller aborts, migration.wait_for_worker_s passes or the deadline
        does (then the next attempt fails as before)."""
        end = time.monotonic() + self.config.migration.wait_for_worker_s
        if deadline is not None:
            end = min(end, deadline)
        while not self.registry.healthy(SERVING_ROLES) and not active.aborted and time.monotonic() < end:
            await asyncio.sleep(0.05)

    def _final(self, request: pb.GenerateRequest, active: _Active, reason: int, error: str = "") -> pb.GenerateChunk:
        return pb.GenerateChunk(
            request_id=request.request_id,
            finish_reason=reason,
            error=error,
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=len(request.resume_token_ids) + len(active.emitted),
        )

    # -- the two ways to serve an attempt -------------------------------------------------------

    def _route_request(self, request: pb.GenerateRequest, prefill_tokens: int) -> RouteRequest:
        return RouteRequest(prompt_tokens=prefill_tokens)

    def _pick(self, roles: tuple[int, ...], route: RouteRequest, stage: str) -> WorkerEntry:
        per_worker = self.config.limits.max_inflight_per_worker
        healthy = self.registry.healthy(roles)
        candidates = [e for e in healthy if e.inflight < per_worker] or healthy
        if not candidates:
            raise _WorkerFailed(stage, "no healthy worker")
        by_id = {e.worker_id: e for e in candidates}
        choice = self.selector.choose(route, [e.snapshot() for e in candidates])
        self.metrics.count(self.metrics.decisions, choice.worker_id, stage)
        return by_id[choice.worker_id]

    def _remote_prefill_pool(self, request: pb.GenerateRequest) -> bool:
        """Disaggregate this prompt? Only when enabled, long enough, and some prefill worker has room."""
        cfg = self.config.disaggregation
        if not cfg.enabled or len(request.prompt_token_ids) < cfg.min_remote_prefill_tokens:
            self.metrics.count(self.metrics.prefill_mode, "local")
            return False
        per_worker = self.config.limits.max_inflight_per_worker
        prefill_ok = any(
            e.inflight < per_worker and e.snapshot().active_prefill_tokens < cfg.prefill_busy_threshold
            for e in self.registry.healthy((pb.PREFILL,))
        )
        remote = prefill_ok and bool(self._decode_roles())
        self.metrics.count(self.metrics.prefill_mode, "remote" if remote else "local")
        return remote

    def _decode_roles(self) -> tuple[int, ...]:
        return (pb.DECODE,) if self.registry.healthy((pb.DECODE,)) else ((pb.AGGREGATED,) if self.registry.healthy((pb.AGGREGATED,)) else ())

    def _upstream(self, request: pb.GenerateRequest, active: _Active, deadline: float | None, patch: pb.GenerateRequest,
                  base: bytes | None = None) -> Upstream:
        """The attempt's request: `base` (the caller's request as serialized once, by default) followed by `patch`,
        which protobuf merges into it on parsing (a singular field set in the patch wins, a repeated one appends,
        a message merges field by field). So no attempt copies or re-encodes the prompt's images: they cross each
        hop once, as bytes already on the wire."""
        active.attempts += 1
        patch.request_id = f"{request.request_id}#{active.attempts}"
        timeout = request.deadline_s or None
        if deadline is not None:
            timeout = patch.deadline_s = max(deadline - time.monotonic(), 1e-3)
        base = active.wire if base is None else base
        return Upstream(patch.request_id, base + patch.SerializeToString(), timeout, request.final_chunk_only)

    async def _aggregated(self, request, active: _Active, deadline, patch: pb.GenerateRequest
                          ) -> AsyncIterator[pb.GenerateChunk]:
        """patch: resume after the tokens emitted, ask for the rest (contract.resend.Resume.patch)."""
        remaining = patch.sampling.max_tokens
        upstream = self._upstream(request, active, deadline, patch)
        context = len(request.prompt_token_ids) + len(request.resume_token_ids) + len(active.emitted)
        entry = self._pick(SERVING_ROLES, self._route_request(request, context), "aggregated")
        booking = self.registry.book(entry, prefill_tokens=context, kv_tokens=context + remaining)
        async for chunk in self._stream(entry, upstream, booking, active, "aggregated"):
            yield chunk

    async def _disaggregated(self, request, active: _Active, deadline) -> AsyncIterator[pb.GenerateChunk]:
        prompt_len = len(request.prompt_token_ids)
        # Stage 1: prefill on a PREFILL worker, which samples the first token and holds the KV.
        patch = pb.GenerateRequest(prefill_only=True, sampling=pb.SamplingParams(max_tokens=1))
        prefill = self._upstream(request, active, deadline, patch)
        p_entry = self._pick((pb.PREFILL,), self._route_request(request, prompt_len), "prefill")
        booking = self.registry.book(p_entry, prefill_tokens=prompt_len, kv_tokens=prompt_len)
        last = None
        async for chunk in self._stream(p_entry, prefill, booking, active, "prefill"):
            last = chunk
        if last is None or last.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            raise _WorkerFailed("prefill", "prefill stream ended without a final chunk")
        handle = last.kv_handle
        first = pb.GenerateChunk(request_id=request.request_id, token_ids=last.token_ids, worker_id=p_entry.worker_id)
        done = last.finish_reason in (pb.STOP, pb.ABORT, pb.ERROR) or request.sampling.max_tokens <= 1
        if last.finish_reason == pb.LENGTH and not handle.transfer_id:
            raise _WorkerFailed("prefill", "prefill worker returned no KV handle")
        if done:
            if handle.transfer_id:
                self._release_kv(p_entry, handle)
            if last.finish_reason == pb.LENGTH and request.sampling.max_tokens <= 1:
                first.finish_reason = pb.LENGTH
            else:
                first.finish_reason, first.error = last.finish_reason, last.error
            yield first
            return
        yield first
        # Stage 2: decode on a DECODE worker, which pulls the KV from the prefill worker and continues. It gets the
        # request without its images (the dispatcher holds it so): the KV and the handle's image layout stand for
        # them, and the first token travels in the handle.
        patch = pb.GenerateRequest(kv_handle=handle, sampling=pb.SamplingParams(
            max_tokens=request.sampling.max_tokens - len(active.emitted)))
        decode = self._upstream(request, active, deadline, patch, base=request.SerializeToString())
        d_entry = self._pick(self._decode_roles(), RouteRequest(prompt_tokens=0), "decode")
        booking = self.registry.book(d_entry, prefill_tokens=0, kv_tokens=prompt_len + request.sampling.max_tokens)
        try:
            async for chunk in self._stream(d_entry, decode, booking, active, "decode"):
                yield chunk
        except _WorkerFailed:
            self._release_kv(p_entry, handle)  # the decode worker may not have pulled it
            raise

    def _release_kv(self, entry: WorkerEntry, handle: pb.KvHandle) -> None:
        """Tell a prefill worker to drop KV nobody will pull (fire and forget; it also expires on its own)."""

        async def release() -> None:
            try:
                await entry.stub.Abort(pb.AbortRequest(request_id=handle.transfer_id), metadata=self._metadata, timeout=5)
            except grpc.aio.AioRpcError:
                pass

        if entry.healthy:
            asyncio.get_running_loop().create_task(release())

    async def _stream(
        self, entry: WorkerEntry, upstream: Upstream, booking: Booking, active: _Active, stage: str
    ) -> AsyncIterator[pb.GenerateChunk]:
        """Stream one attempt on the worker (for a whole answer, GenerateWhole's one reply), over the configured
        transport; worker failures become _WorkerFailed, the booking is always released."""
        call = self.transport.open(entry, upstream)
        entry.calls.add(call)
        active.entry, active.upstream_id = entry, upstream.request_id
        finished = False
        try:
            while not finished:
                chunk = await call.next()
                if chunk is None or (upstream.whole and chunk.finish_reason == pb.FINISH_REASON_UNSPECIFIED):
                    raise _WorkerFailed(stage, f"worker {entry.worker_id} ended the stream without a final chunk")
                if chunk.token_ids:
                    booking.prefill_done()
                chunk.request_id = active.request_id
                chunk.worker_id = entry.worker_id
                finished = chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                if finished:  # the worker's slot is free once its answer is complete, before anyone reads it
                    booking.release()
                yield chunk
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RouterError(code, f"deadline passed on worker {entry.worker_id}") from None
            if code not in _MIGRATABLE:
                raise RouterError(code, f"worker {entry.worker_id}: {exc.details()}") from None
            if code == grpc.StatusCode.UNAVAILABLE:
                self.registry.mark_down(entry, f"stream failed: {exc.details()}")
            raise _WorkerFailed(stage, f"worker {entry.worker_id}: {code.name} {exc.details()}") from None
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling() == 0:  # the registry cut the call: worker down
                raise _WorkerFailed(stage, f"worker {entry.worker_id} went down ({entry.down_reason})") from None
            raise
        finally:
            entry.calls.discard(call)
            if not finished:
                call.cancel()  # the caller went away or gave up: the worker aborts the engine request
            else:
                await call.close()
            booking.release()
            if active.entry is entry:
                active.entry = None
