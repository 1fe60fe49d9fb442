"""WorkerServer: serves one AsyncEngine over gRPC (WorkerService), registers with the router, heartbeats.

Streams tokens coalesced per chunk, aborts the engine request when the caller goes away, and hands a prefill
worker's KV to a decode worker: over a KvLink when the pair has one (GPU to GPU, the KvHandle's transport_hint
says so), else held for the decode worker to pull (PullKv, layer by layer).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio

from contract import event_loop
from contract.network import is_loopback, split_host_port
from contract.transport import (
    add_listener, call_metadata, open_channel, server_interceptors, server_options, when_call_ends_unfinished,
)
from contract.types import FinishReason, PromptInput, RequestOutput, SamplingParams
from contract.wire import pb, pb_grpc
from workers.engine_api import ServingEngine
from workers.kv_cache import ImageLayout, KvExport
from workers.request_options import ONLY_AT_END, RequestOptions
from workers.serve.kv_transfer import KvLink, KvLinkError
from workers.serve.kv_wire import kv_from_chunks, kv_to_chunks
from workers.serve.multiplexed import Multiplexer
from workers.serve.registration import load_report, report_to_router, router_addresses
from workers.serve.worker_build import ServedEngine, WorkerSettings, serve_llm_engine

log = logging.getLogger(__name__)

_FINISH = {
    FinishReason.STOP: pb.STOP,
    FinishReason.LENGTH: pb.LENGTH,
    FinishReason.ABORT: pb.ABORT,
    FinishReason.ERROR: pb.ERROR,
}
_END = object()  # marks the end of an engine stream in the coalescing queue


class Preempted(Exception):
    """The engine dropped a request it cannot compute again (FinishReason.PREEMPTED): the call ends ABORTED, which
    the router answers by replaying the request, with its images, on a serving worker."""


def image_layout(handle: pb.KvHandle) -> tuple[ImageLayout, ...]:
    """The prompt's images as a KvHandle describes them."""
    return tuple(ImageLayout(i.grid_rows, i.grid_cols, i.content_digest) for i in handle.images)


@dataclass
class _HeldKv:
    request_id: str
    export: KvExport
    expires_at: float


def _layout_on_wire(export: KvExport) -> list[pb.ImageLayout]:
    return [pb.ImageLayout(grid_rows=i.grid_rows, grid_cols=i.grid_cols, content_digest=i.digest)
            for i in export.image_layout]


def role_value(role: int | str) -> int:
    """pb.WorkerRole from an enum value or a name ('prefill', 'DECODE', ...)."""
    if isinstance(role, str):
        try:
            return pb.WorkerRole.Value(role.upper())
        except ValueError:
            raise ValueError(f"role {role!r}: expected aggregated, prefill or decode") from None
    return int(role)


def _fold(chunk: pb.GenerateChunk, item: RequestOutput | Exception | object) -> bool:
    """Adds one item of an engine's stream (an output, the exception the stream failed with, or _END where it
    ended) to `chunk`; True when that makes it the final chunk. A PREEMPTED output raises Preempted, its tokens
    added."""
    if item is _END:
        if chunk.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            chunk.finish_reason, chunk.error = pb.ERROR, "engine stream ended without finishing"
        return True
    if isinstance(item, Exception):
        chunk.finish_reason, chunk.error = pb.ERROR, f"engine error: {item}"
        return True
    chunk.token_ids.extend(item.new_token_ids)
    if item.finish_reason is FinishReason.PREEMPTED:
        raise Preempted(item.error or "preempted")
    if item.finished:
        chunk.finish_reason = _FINISH[item.finish_reason or FinishReason.STOP]
        chunk.error = item.error or ""
        chunk.prompt_tokens = item.num_prompt_tokens
        chunk.completion_tokens = item.num_generated_tokens
        return True
    return False


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    def __init__(self, server: WorkerServer):
        self.s = server

    async def Generate(self, request, context):
        s = self.s
        rid = request.request_id
        try:
            sampling = s.sampling_params(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request {rid}: {exc}")
        kv_import = None
        if request.kv_handle.transfer_id:
            try:
                kv_import = await s.pull_kv(request.kv_handle, context.time_remaining())
            except (ValueError, KvLinkError, grpc.aio.AioRpcError) as exc:
                # UNAVAILABLE: the router replays the request here or elsewhere with a local prefill.
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"request {rid}: KV pull failed: {exc}")
            kv_import.image_layout = image_layout(request.kv_handle)
        prompt = PromptInput(token_ids=list(request.prompt_token_ids), images=list(request.images))
        # the engine hands out tokens as this call sends them (its thread then makes and passes on fewer outputs)
        interval = ONLY_AT_END if request.final_chunk_only else request.stream_interval
        options = RequestOptions(resume_token_ids=list(request.resume_token_ids), prefill_only=request.prefill_only,
                                 kv_import=kv_import, latency_bound_s=request.latency_bound_s, stream_interval=interval)
        outputs = s.engine.generate(rid, prompt, sampling, options)
        s.running.add(rid)
        ended = aborted = False  # the engine's request ended (its final chunk, or preempted); it was aborted here

        async def abort() -> None:  # the caller went away: free the engine's slot and KV now, once
            nonlocal aborted
            if not (ended or aborted):
                aborted = True
                await s.engine.abort(rid)

        # coalesce's pump reads the engine's outputs on while this generator may be left suspended at its yield
        when_call_ends_unfinished(context, lambda: ended or aborted, abort)
        try:
            async for chunk in s.coalesce(rid, outputs, request.stream_interval, request.final_chunk_only):
                if request.prefill_only and chunk.finish_reason in (pb.LENGTH, pb.STOP) and chunk.token_ids:
                    chunk.kv_handle.CopyFrom(await s.hold_kv(rid, chunk.token_ids[-1], len(request.prompt_token_ids)))
                ended = chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                yield chunk
        except Preempted as exc:
            ended = True
            await context.abort(grpc.StatusCode.ABORTED, f"request {rid}: {exc}")
        except asyncio.CancelledError:
            await abort()
            raise
        finally:
            s.running.discard(rid)

    async def GenerateWhole(self, request, context):
        request.final_chunk_only = True
        async for chunk in self.Generate(request, context):
            pass  # one chunk; before it only the tokens of a request handed back, which then ends ABORTED
        return chunk

    async def GenerateMultiplexed(self, request_iterator, context):
        await Multiplexer(self.Generate, self.GenerateWhole, context, lambda: self.s.stopping).run()

    async def Abort(self, request, context):
        return pb.AbortReply(found=await self.s.abort(request.request_id))

    async def GetLoad(self, request, context):
        return self.s.load_report()

    async def GetInfo(self, request, context):
        return self.s.info()

    async def PullKv(self, request, context):
        held = self.s.take_held(request.transfer_id)
        if held is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no KV held for transfer {request.transfer_id!r}")
        try:
            for chunk in kv_to_chunks(held.export):
                yield chunk
        finally:
            await self.s.engine.release(held.request_id)


class WorkerServer:
    """Serves an engine (workers/engine_api.ServingEngine) as WorkerService; registers with `router_address` if
    given (comma-separated addresses: with each of those routers)."""

    def __init__(self, async_engine: ServingEngine, settings: WorkerSettings, *,
                 generation_defaults: SamplingParams | None = None, kv_link: KvLink | None = None):
        """settings: how it serves, registers and hands KV over. generation_defaults: generation_config.json's sampling,
        for requests with use_model_defaults (MLPerf sends no params; None: the engine's). kv_link: settings.kv_link,
        connected (build_worker connects it), to this worker's one peer (prefill -> decode); a prefill worker then
        sends every held KV over it at once, a decode worker takes KV announced over it from it."""
        if not is_loopback(settings.listen) and not settings.token:
            raise ValueError(f"listen={settings.listen!r} is not a loopback address: a token (shared secret) is "
                             "required")
        self.engine = async_engine
        self.settings = settings
        self.generation_defaults = generation_defaults or async_engine.generation_defaults
        self.worker_id = settings.worker_id
        self.role = role_value(settings.role)
        self.kv_link = kv_link
        if kv_link is not None and pb.WorkerRole.Name(self.role).lower() != kv_link.config.role:
            raise ValueError(f"kv_link role {kv_link.config.role!r} does not match worker role {pb.WorkerRole.Name(self.role).lower()!r}")
        self.port = 0
        self.running: set[str] = set()
        self.stopping = False
        self._metadata = call_metadata(settings.token)
        self._held: dict[str, _HeldKv] = {}
        self._peers: dict[str, grpc.aio.Channel] = {}
        self._server: grpc.aio.Server | None = None
        self._reporter: asyncio.Task | None = None

    @property
    def address(self) -> str:
        host, _ = split_host_port(self.settings.listen)
        if self.settings.advertise_host:
            host = self.settings.advertise_host
        elif host in ("0.0.0.0", "::", ""):
            host = socket.gethostbyname(socket.gethostname())
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    async def start(self) -> None:
        self._server = grpc.aio.server(interceptors=server_interceptors(self.settings.token),
                                       options=server_options(self.settings.max_message_bytes))
        pb_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(self), self._server)
        self.port = add_listener(self._server, self.settings.listen, None)
        await self._server.start()
        self._reporter = asyncio.get_running_loop().create_task(self._report_loop())
        log.info("worker %s (%s) serving on %s", self.worker_id, pb.WorkerRole.Name(self.role), self.address)

    async def stop(self, grace: float | None = 0.5) -> None:
        self.stopping = True  # new requests on a GenerateMultiplexed stream are refused, as new calls are
        if self._reporter is not None:
            self._reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reporter
        if self._server is not None:
            await self._server.stop(grace)
        for channel in self._peers.values():
            await channel.close()
        for held in self._held.values():
            await self.engine.release(held.request_id)
        self._held.clear()
        if self.kv_link is not None:
            self.kv_link.close()

    # -- what the servicer uses -----------------------------------------------------------------

    def sampling_params(self, s: pb.SamplingParams) -> SamplingParams:
        if any(t < 0 for t in s.stop_token_ids):
            raise ValueError(f"stop_token_ids must not be negative: {list(s.stop_token_ids)}")
        common = {"seed": s.seed if s.has_seed else None, "stop_token_ids": frozenset(s.stop_token_ids),
                  "json_schema": s.json_schema or None}
        if s.use_model_defaults:
            d = self.generation_defaults
            return SamplingParams(temperature=d.temperature, top_p=d.top_p, top_k=d.top_k,
                                  max_tokens=s.max_tokens or d.max_tokens, **common)
        if s.temperature < 0 or not 0 <= s.top_p <= 1 or s.top_k < 0 or s.max_tokens < 0:
            raise ValueError(f"bad sampling params: {s}".strip())
        return SamplingParams(temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k,
                              max_tokens=s.max_tokens or self.generation_defaults.max_tokens, **common)

    async def coalesce(
        self, rid: str, outputs: AsyncIterator[RequestOutput], interval: int = 1, final_only: bool = False
    ) -> AsyncIterator[pb.GenerateChunk]:
        """One chunk per send: whatever the engine produced while the previous chunk was being written. With
        interval N > 1, after the first token a chunk waits until N tokens are pending (or the request ends); with
        final_only, every token waits for the final chunk. A request the engine ended PREEMPTED raises Preempted
        once the tokens it had are sent."""
        if final_only:
            async for chunk in self._final_only(rid, outputs):
                yield chunk
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            try:
                async for out in outputs:
                    queue.put_nowait(out)
            except Exception as exc:  # surfaces as an ERROR chunk, never as a hung stream
                log.exception("engine failed on request %s", rid)
                queue.put_nowait(exc)
            queue.put_nowait(_END)

        task = asyncio.get_running_loop().create_task(pump())
        sent_any = False
        chunk = pb.GenerateChunk(request_id=rid, worker_id=self.worker_id)
        try:
            while True:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                finished = False
                for item in items:
                    try:
                        finished = _fold(chunk, item)
                    except Preempted:
                        if chunk.token_ids:
                            yield chunk
                        raise
                    if finished:
                        break
                if finished or (chunk.token_ids and (not sent_any or len(chunk.token_ids) >= interval)):
                    yield chunk
                    if finished:
                        return
                    sent_any = True
                    chunk = pb.GenerateChunk(request_id=rid, worker_id=self.worker_id)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _final_only(self, rid: str, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[pb.GenerateChunk]:
        """coalesce's final_only: nothing is sent before the end, so the engine's outputs are read as they come, with
        no task pumping them into a queue."""
        chunk = pb.GenerateChunk(request_id=rid, worker_id=self.worker_id)
        finished = False
        try:
            async for out in outputs:  # to its end, which follows the final output
                finished = finished or _fold(chunk, out)
        except Preempted:
            if chunk.token_ids:
                yield chunk
            raise
        except Exception as exc:  # surfaces as an ERROR chunk, as coalesce's
            log.exception("engine failed on request %s", rid)
            finished = finished or _fold(chunk, exc)
        if not finished:
            _fold(chunk, _END)
        yield chunk

    async def hold_kv(self, rid: str, first_token_id: int, num_tokens: int) -> pb.KvHandle:
        """The handle of a finished prefill's KV: sent over the kv link now (its blocks freed), or held for PullKv."""
        handle = pb.KvHandle(worker_address=self.address, transfer_id=rid, num_tokens=num_tokens, first_token_id=first_token_id)
        if self.kv_link is not None:
            export = await self.engine.export_kv(rid, on_device=True)
            handle.images.extend(_layout_on_wire(export))
            await self.engine.release(rid)  # the export is a copy: the send does not need the blocks
            handle.transport_hint = await asyncio.get_running_loop().run_in_executor(None, self.kv_link.send, export)
            return handle
        export = await self.engine.export_kv(rid)
        handle.images.extend(_layout_on_wire(export))
        await self._expire_held()
        self._held[rid] = _HeldKv(rid, export, time.monotonic() + self.settings.kv_hold_s)
        return handle

    def take_held(self, transfer_id: str) -> _HeldKv | None:
        return self._held.pop(transfer_id, None)

    async def pull_kv(self, handle: pb.KvHandle, timeout: float | None) -> KvExport:
        """The KV a prefill worker announced: from the kv link when the handle's transport_hint names it, else
        pulled over gRPC. KvLinkError when the hint names a link this worker is not on."""
        if handle.transport_hint:
            if self.kv_link is None:
                raise KvLinkError(f"the KV was sent over a kv link ({handle.transport_hint[:120]!r}); this worker has none")
            return await asyncio.get_running_loop().run_in_executor(
                None, self.kv_link.receive, handle.transport_hint, handle.num_tokens, handle.first_token_id, timeout)
        channel = self._peers.get(handle.worker_address)
        if channel is None:
            channel = self._peers[handle.worker_address] = open_channel(
                handle.worker_address, max_message_bytes=self.settings.max_message_bytes,
                keepalive=self.settings.keepalive
            )
        stub = pb_grpc.WorkerServiceStub(channel)
        chunks = [c async for c in stub.PullKv(pb.KvPullRequest(transfer_id=handle.transfer_id),
                                                metadata=self._metadata, timeout=timeout)]
        return kv_from_chunks(chunks, handle.first_token_id)

    async def abort(self, request_id: str) -> bool:
        """Abort a running request, or drop KV held for a decode worker that will not pull it."""
        held = self.take_held(request_id)
        if held is not None:
            await self.engine.release(held.request_id)
            return True
        if request_id in self.running:
            await self.engine.abort(request_id)
            return True
        return False

    async def _expire_held(self) -> None:
        if self.kv_link is not None and self.kv_link.rank == 1:
            self.kv_link.expire(self.settings.kv_hold_s)
        now = time.monotonic()
        for rid in [rid for rid, held in self._held.items() if held.expires_at < now]:
            log.warning("worker %s: KV of %s was never pulled; released", self.worker_id, rid)
            await self.engine.release(self._held.pop(rid).request_id)

    def load_report(self) -> pb.LoadReport:
        return load_report(self.worker_id, self.engine.load())

    def info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(
            worker_id=self.worker_id, address=self.address, role=self.role, model=self.settings.model_name,
            kv_block_size=self.settings.kv_block_size, max_model_len=self.settings.max_model_len,
            total_kv_blocks=self.engine.load().total_kv_blocks,
        )

    async def _report_loop(self) -> None:
        """Register with each router, then heartbeat (workers/serve/registration.py); held KV expires on the first
        one's beat."""
        s = self.settings
        if s.router_address is None:
            return

        async def nothing() -> None:
            pass

        await asyncio.gather(*(
            report_to_router(address, self.info, self.load_report, self._metadata, s.heartbeat_interval_s,
                             s.max_message_bytes, self._expire_held if k == 0 else nothing, s.keepalive)
            for k, address in enumerate(router_addresses(s.router_address))))


def build_worker(served: ServedEngine, settings: WorkerSettings) -> WorkerServer:
    """The WorkerServer for `served` (not started). With a KV link this waits for the peer to connect."""
    link = None if settings.kv_link is None else KvLink(settings.kv_link)
    return WorkerServer(served.async_engine, settings, generation_defaults=served.generation_defaults, kv_link=link)


def main(argv: list[str] | None = None) -> None:
    """`python -m workers.serve.server --checkpoint DIR --router ADDR`: one engine process serving the router."""
    parser = argparse.ArgumentParser(prog="python -m workers.serve.server", description=main.__doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--router", default=None,
                        help="router address host:port to register with (comma-separated: with each of them)")
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--worker-id", default=f"{socket.gethostname()}-{int(time.time())}")
    parser.add_argument("--role", default="aggregated", choices=["aggregated", "prefill", "decode"])
    parser.add_argument("--token", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                        help="KV cache element type (EngineConfig.kv_cache_dtype): fp8 stores float8_e4m3fn")
    parser.add_argument("--kv-link", default=None, metavar="HOST:PORT",
                        help="GPU-to-GPU KV link to this worker's one peer (a prefill and a decode worker given the same "
                             "address; the prefill worker listens there). Without it the KV goes over gRPC (PullKv).")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level)

    from workers.config import EngineConfig, KvLinkConfig

    config = EngineConfig(checkpoint=args.checkpoint, device=args.device, num_kv_blocks=args.num_kv_blocks,
                          kv_cache_dtype=args.kv_cache_dtype)

    link_config = None
    if args.kv_link is not None:
        if args.role == "aggregated":
            parser.error("--kv-link joins a prefill and a decode worker; --role aggregated has no peer")
        host, port = split_host_port(args.kv_link)
        link_config = KvLinkConfig(host, port, args.role, args.device)
    settings = WorkerSettings(worker_id=args.worker_id, role=args.role, router_address=args.router, listen=args.listen,
                              token=args.token, model_name=str(config.checkpoint), kv_block_size=config.block_size,
                              max_model_len=config.max_model_len, kv_link=link_config)

    async def serve() -> None:
        served = serve_llm_engine(config)
        # a KV link waits for its peer: off the event loop
        server = await asyncio.get_running_loop().run_in_executor(None, build_worker, served, settings)
        await server.start()
        print(f"worker {args.worker_id} listening on {server.address}", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()
        served.async_engine.shutdown()

    event_loop.run(serve())


if __name__ == "__main__":
    main()
