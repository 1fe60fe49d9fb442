"""The router's view of its workers: registration, heartbeats, liveness, and the load it has booked on each.

Load is booked when a request is dispatched and released on every exit path, so snapshots stay accurate
between heartbeats; a worker whose heartbeats stop, or whose engine stops stepping while busy, is down.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import grpc.aio

from contract.wire import pb, pb_grpc
from router.config import HealthConfig
from router.policies import WorkerSnapshot

log = logging.getLogger(__name__)

SERVING_ROLES = (pb.AGGREGATED, pb.DECODE)  # workers that can serve a whole request
_WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name
GENERATE_METHOD = f"/{_WORKER_SERVICE}/Generate"
GENERATE_WHOLE_METHOD = f"/{_WORKER_SERVICE}/GenerateWhole"
MULTIPLEXED_METHOD = f"/{_WORKER_SERVICE}/GenerateMultiplexed"


class Cancellable(Protocol):
    """An attempt in flight on a worker (a gRPC call, or one on a stream: router.worker_calls.WorkerCall)."""

    def cancel(self) -> object: ...


class WorkerEntry:
    """One registered worker: its identity, last load report, health, booked load and channel."""

    def __init__(self, info: pb.WorkerInfo, channel: grpc.aio.Channel, now: float):
        self.info = info
        self.worker_id = info.worker_id
        self.address = info.address
        self.role = info.role
        self.channel = channel
        self.stub = pb_grpc.WorkerServiceStub(channel)
        # WorkerService.Generate and GenerateWhole taking the request already serialized (router.dispatch builds it
        # from bytes)
        self.generate = channel.unary_stream(GENERATE_METHOD, request_serializer=None,
                                             response_deserializer=pb.GenerateChunk.FromString)
        self.generate_whole = channel.unary_unary(GENERATE_WHOLE_METHOD, request_serializer=None,
                                                  response_deserializer=pb.GenerateChunk.FromString)
        # WorkerService.GenerateMultiplexed taking its messages serialized (contract.multiplexed_wire frames them)
        self.multiplexed = channel.stream_stream(MULTIPLEXED_METHOD, request_serializer=None,
                                                 response_deserializer=pb.MultiplexedReplies.FromString)
        self.healthy = True
        self.down_reason = ""
        self.last_seen = now
        # Until its first heartbeat a worker counts as what it registered: every KV block free (an empty report
        # would read as a worker with no KV at all for one heartbeat interval).
        self.report = pb.LoadReport(worker_id=info.worker_id, total_kv_blocks=info.total_kv_blocks,
                                    free_kv_blocks=info.total_kv_blocks)
        self.steps_moved_at = now
        self.inflight = 0
        self.booked_prefill_tokens = 0
        self.booked_blocks = 0
        self.calls: set[Cancellable] = set()  # attempts in flight, cancelled when the worker goes down

    def snapshot(self) -> WorkerSnapshot:
        # Booked load shows new work before the next heartbeat; the report shows work booked elsewhere.
        return WorkerSnapshot(
            worker_id=self.worker_id,
            active_prefill_tokens=max(self.booked_prefill_tokens, self.report.queued_prompt_tokens),
            active_decode_blocks=max(self.booked_blocks, self.report.active_kv_blocks),
            inflight=self.inflight,
        )


@dataclass
class Booking:
    """Load booked on a worker for one dispatched request; every method is safe to call more than once."""

    entry: WorkerEntry
    prefill_tokens: int
    blocks: int
    released: bool = False

    def prefill_done(self) -> None:
        """The first token arrived: the prompt's tokens are no longer waiting for prefill."""
        if not self.released and self.prefill_tokens:
            self.entry.booked_prefill_tokens -= self.prefill_tokens
            self.prefill_tokens = 0

    def release(self) -> None:
        if self.released:
            return
        self.prefill_done()
        self.entry.booked_blocks -= self.blocks
        self.entry.inflight -= 1
        self.released = True


class Registry:
    def __init__(
        self,
        health: HealthConfig,
        block_size: int,
        connect: Callable[[str], grpc.aio.Channel],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.health = health
        self.block_size = block_size
        self._connect = connect
        self._clock = clock
        self._entries: dict[str, WorkerEntry] = {}
        self._retired: list[grpc.aio.Channel] = []

    # -- membership -----------------------------------------------------------------------------

    def register(self, info: pb.WorkerInfo) -> WorkerEntry:
        """Add a worker; the same id at a new address (a restart) replaces the old entry, whose streams fail
        over. The same id at the same address (it lost contact with us) keeps its entry and streams."""
        if not info.worker_id or not info.address:
            raise ValueError("WorkerInfo needs worker_id and address")
        now = self._clock()
        old = self._entries.get(info.worker_id)
        if old is not None and old.address == info.address:
            old.info, old.role = info, info.role
            old.last_seen = old.steps_moved_at = now
            self._revive(old)
            return old
        if old is not None:
            self.mark_down(old, f"re-registered at {info.address}")
            self._retired.append(old.channel)
        entry = WorkerEntry(info, self._connect(info.address), now)
        self._entries[info.worker_id] = entry
        log.info("worker %s registered at %s (role %s)", info.worker_id, info.address, pb.WorkerRole.Name(info.role))
        return entry

    def heartbeat(self, report: pb.LoadReport) -> bool:
        """Record a load report; False if the worker is unknown (it should register again)."""
        entry = self._entries.get(report.worker_id)
        if entry is None:
            return False
        now = self._clock()
        busy = report.running_requests + report.waiting_requests > 0
        if report.steps != entry.report.steps or not busy:
            entry.steps_moved_at = now
        entry.last_seen = now
        entry.report = report
        if not entry.healthy and now - entry.steps_moved_at <= self.health.down_after_s:
            self._revive(entry)
        return True

    def check(self, grace_s: float = 0.0) -> list[WorkerEntry]:
        """Mark down workers silent for down_after_s, or busy with a step counter stuck that long. grace_s: how long
        the caller's event loop was recently held up: heartbeats received meanwhile may still wait behind this
        check, so silence is judged past down_after_s + grace_s."""
        now = self._clock()
        limit = self.health.down_after_s + grace_s
        went_down = []
        for entry in self._entries.values():
            if not entry.healthy:
                continue
            if now - entry.last_seen > limit:
                self.mark_down(entry, f"no heartbeat for {now - entry.last_seen:.1f}s")
                went_down.append(entry)
            elif now - entry.steps_moved_at > limit:
                self.mark_down(entry, f"engine stalled: steps stuck at {entry.report.steps} while busy")
                went_down.append(entry)
        return went_down

    def mark_down(self, entry: WorkerEntry, reason: str) -> None:
        """No new work goes to it; its streams in flight are cancelled so their requests migrate now."""
        if entry.healthy:
            log.warning("worker %s down: %s", entry.worker_id, reason)
        entry.healthy = False
        entry.down_reason = reason
        for call in list(entry.calls):
            call.cancel()

    def _revive(self, entry: WorkerEntry) -> None:
        if not entry.healthy:
            log.info("worker %s back up", entry.worker_id)
        entry.healthy = True
        entry.down_reason = ""

    # -- queries --------------------------------------------------------------------------------

    def entries(self) -> list[WorkerEntry]:
        return list(self._entries.values())

    def get(self, worker_id: str) -> WorkerEntry | None:
        return self._entries.get(worker_id)

    def healthy(self, roles: Iterable[int]) -> list[WorkerEntry]:
        roles = tuple(roles)
        return [e for e in self._entries.values() if e.healthy and e.role in roles]

    # -- load booking ---------------------------------------------------------------------------

    def book(self, entry: WorkerEntry, prefill_tokens: int, kv_tokens: int) -> Booking:
        """Book a request on `entry`: `prefill_tokens` still to prefill, `kv_tokens` of KV it will hold."""
        blocks = math.ceil(kv_tokens / self.block_size)
        entry.inflight += 1
        entry.booked_prefill_tokens += prefill_tokens
        entry.booked_blocks += blocks
        return Booking(entry, prefill_tokens, blocks)

    async def close(self) -> None:
        for channel in [e.channel for e in self._entries.values()] + self._retired:
            await channel.close()
        self._entries.clear()
        self._retired.clear()
