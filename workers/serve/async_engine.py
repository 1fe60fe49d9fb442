"""AsyncEngine: runs an engine core's step loop (LLMEngine on any executor: workers/engine_api.EngineCore) in a
background thread and streams outputs to asyncio callers (it is a workers/engine_api.ServingEngine).

Every engine call happens on that thread; results cross back with loop.call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from contract.types import EngineLoad, PromptInput, RequestOutput, SamplingParams
from workers.config import EngineConfig
from workers.engine_api import EngineCore
from workers.kv_cache import KvExport
from workers.request_options import NO_OPTIONS, RequestOptions

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5


class EngineStoppedError(RuntimeError):
    """The engine loop was shut down while a request was in flight."""


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        _call_in(self.loop, self.queue.put_nowait, item)


def _call_in(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    """fn(*args) on loop's thread, soon; nothing if the loop is closed (nobody is listening any more)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _deliver(outputs: list[RequestOutput], streams: dict[str, _Stream]) -> None:
    """A step's outputs to their streams: one call into each listening loop, not one an output (each such call
    wakes the loop through its self-pipe, a system call on the engine's thread, and the loop's work competes with
    the engine's thread for the interpreter lock: benchmarks/README.md, forty-third pass)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
    for out in outputs:
        stream = streams.get(out.request_id)
        if stream is not None:
            by_loop.setdefault(stream.loop, []).append((stream, out))
    for loop, items in by_loop.items():
        _call_in(loop, _put_all, items)


class AsyncEngine:
    def __init__(self, engine: EngineCore):
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._load = engine.load()
        # Image decoding and preprocessing run on a small pool of their own, off both the event loop and the engine
        # thread, sized so that they leave the engine's thread its core (EngineConfig.preprocess_threads).
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(
            engine.config.preprocess_threads, thread_name_prefix="prepare"
        )
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- public API ------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt: PromptInput, sampling: SamplingParams,
                       options: RequestOptions = NO_OPTIONS) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs until one has finished=True. Leaving the loop early (or the
        caller being cancelled) aborts the request. options.latency_bound_s counts from now."""
        loop = asyncio.get_running_loop()
        submitted = time.monotonic()
        prepared = await loop.run_in_executor(
            self._prepare_pool, self.engine.prepare_request, request_id, prompt, sampling, options)
        prepared.submitted = submitted  # the wait for a preparation thread counts against the bound, and is traced
        stream = _Stream(loop)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already being generated")
        self._streams[request_id] = stream
        self._submit(functools.partial(self._add, prepared, stream))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(functools.partial(self.engine.abort, request_id))

    async def abort(self, request_id: str) -> bool:
        """Cancels a request; False if the engine does not know it."""
        return await asyncio.wrap_future(self._submit(functools.partial(self.engine.abort, request_id)))

    async def export_kv(self, request_id: str, on_device: bool = False) -> KvExport:
        """KV of a finished prefill_only request (KeyError if none is held under that id); on_device keeps it on
        the engine's device (for a GPU-to-GPU hand-off, workers/serve/kv_transfer.py)."""
        return await asyncio.wrap_future(self._submit(functools.partial(self.engine.export_kv, request_id, on_device)))

    async def release(self, request_id: str) -> bool:
        """Frees the KV blocks held for a finished prefill_only request."""
        return await asyncio.wrap_future(self._submit(functools.partial(self.engine.release, request_id)))

    def load(self) -> EngineLoad:
        """The load snapshot taken after the latest step."""
        return self._load

    @property
    def generation_defaults(self) -> SamplingParams:
        return self.engine.generation_defaults

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def shutdown(self) -> None:
        """Stops the loop thread; open streams end with EngineStoppedError."""
        self._stop.set()
        self._wake.set()
        self._thread.join()
        self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        for stream in list(self._streams.values()):
            stream.put(EngineStoppedError("engine shut down"))
        self.engine.close()

    # ---- engine thread ---------------------------------------------------------------------------

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stop.is_set():
            future.set_exception(EngineStoppedError("engine shut down"))
            return future
        self._commands.put((fn, future))
        self._wake.set()
        return future

    def _add(self, prepared, stream: _Stream) -> None:
        try:
            self.engine.add_prepared(prepared)
        except ValueError as exc:
            stream.put(exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._run_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                continue
            outputs = self.engine.step()
            self._load = self.engine.load()
            _deliver(outputs, self._streams)
        self._run_commands()

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting caller
                future.set_exception(exc)
