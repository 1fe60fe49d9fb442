"""GPU-to-GPU hand-off of a request's KV cache from a prefill worker to a decode worker: one point-to-point
torch.distributed pair (NCCL between GPUs, gloo on CPU), so the KV never visits the host.

Protocol: the prefill side (rank 0, host of the pair's TCPStore) numbers its transfers 0, 1, 2, ...; for each
it writes a header (JSON: shape, dtype, an FP8 export's per-layer scales, MRoPE delta, send time) under the store key `kv/<n>`, then posts the
send. The decode side's receiver thread takes the headers in order and posts the matching receives, so NCCL's
in-order pairing always holds, and no receive waits while the link is idle (an idle receive would trip NCCL's
watchdog). The header is also the KvHandle's `transport_hint`; a decode Generate carrying it claims transfer n
from the received ones (receive()). workers/serve/server.py PullKv stays the portable path.

Setup is explicit: both workers are given the same host:port (`--kv-link`, or the harness's `workers.kv_link`
system setting); the prefill side listens there, and there alone: it binds the store's socket itself and hands it
to the store (TCPStore's master_listen_fd), since a TCPStore's own server listens on every interface.
One link joins one prefill and one decode worker; a pool with several of either needs one link per pair and
the router naming the decode worker before the prefill (see workers/serve/server.py).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.config import KvLinkConfig
from workers.kv_cache import KvExport

log = logging.getLogger(__name__)

TRANSPORT = "torch-p2p"
_BACKEND_KEY = "kv/backend"
_IDLE_WAIT = datetime.timedelta(hours=1)  # an idle receiver's store wait (it is woken by a header or by close())
_STOP = b'{"stop": true}'


class KvLinkError(RuntimeError):
    """The link cannot deliver a transfer (peer gone, timeout, mismatched setup, unknown transfer)."""


@dataclass
class _Arrival:
    kv: torch.Tensor  # [layers, 2, tokens, kv heads, head_dim] on this link's device
    meta: dict
    arrived_at: float


class KvLink:
    """One direction of KV hand-off between two worker processes. Construction blocks until the peer connects
    (at most config.timeout_s)."""

    def __init__(self, config: KvLinkConfig):
        if config.role not in ("prefill", "decode"):
            raise ValueError(f"KvLinkConfig.role: expected 'prefill' or 'decode', got {config.role!r}")
        self.config = config
        self.device = torch.device(config.device)
        self.rank = 0 if config.role == "prefill" else 1
        self._peer = 1 - self.rank
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=config.timeout_s)
        try:
            self.store = _prefill_store(config, timeout) if self.rank == 0 else dist.TCPStore(
                config.host, config.port, 2, is_master=False, timeout=timeout)
        except (RuntimeError, dist.DistError) as exc:
            raise KvLinkError(f"kv link {config.address} ({config.role}): peer did not connect within "
                              f"{config.timeout_s:.0f} s: {exc}") from exc
        if self.rank == 0:
            self.store.set(_BACKEND_KEY, backend)
        elif (peer := self.store.get(_BACKEND_KEY).decode()) != backend:
            raise KvLinkError(f"kv link {config.address}: the prefill side uses {peer}, this decode side {backend} "
                              f"(device {config.device}); both ends must be on CUDA (nccl) or both on the CPU (gloo)")
        if backend == "nccl":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast: it can take shared GPUs down
            torch.cuda.set_device(self.device)
            self.group = dist.ProcessGroupNCCL(self.store, self.rank, 2, dist.ProcessGroupNCCL.Options())
            self._stream = torch.cuda.Stream(self.device)  # receives run here, beside the engine's stream
        else:
            self.group = dist.ProcessGroupGloo(self.store, self.rank, 2, timeout)
            self._stream = None
        self._lock = threading.Lock()
        self._next = 0
        self._in_flight: list[tuple[object, torch.Tensor]] = []  # sends not yet known complete, with their buffers
        self._arrived: dict[int, _Arrival] = {}
        self._arrival = threading.Condition()
        self._closing = threading.Event()
        self._failure: str | None = None
        self._receiver = None
        if self.rank == 1:
            self._waiting_store = self.store.clone()  # own connection: a waiting client blocks its socket
            self._receiver = threading.Thread(target=self._receive_loop, name=f"kv-link-{config.port}", daemon=True)
            self._receiver.start()

    @property
    def transfers(self) -> int:
        """Transfers sent (prefill side) or received (decode side) so far."""
        return self._next

    # ---- prefill side ----------------------------------------------------------------------------------------

    def send(self, kv: KvExport) -> bytes:
        """Queues the export (from engine.export_kv(rid, on_device=True)) for the decode side and returns its
        KvHandle.transport_hint. Returns once the send is posted: the copy runs on NCCL's stream, after the work
        already queued on this thread's stream, and the request's blocks may be released at once (the buffer is
        a copy, kept until the send completes). Thread-safe; transfers go out in the order of their numbers."""
        if self.rank != 0:
            raise KvLinkError(f"kv link {self.config.address}: send() on the decode side")
        tensor = kv.stacked().to(self.device).contiguous()
        with self._lock:
            meta = {"transport": TRANSPORT, "address": self.config.address, "transfer": self._next,
                    "shape": list(tensor.shape), "dtype": kv.dtype_name, "scales": kv.scales,
                    "mrope_position_delta": kv.mrope_position_delta, "sent_at": time.monotonic()}
            hint = json.dumps(meta).encode()
            self.store.set(f"kv/{self._next}", hint)
            self._next += 1
            self._in_flight = [(w, t) for w, t in self._in_flight if not w.is_completed()]
            self._in_flight.append((self.group.send([_wire(tensor)], self._peer, 0), tensor))
        return hint

    def flush(self) -> None:
        """Blocks until every queued send has been received."""
        with self._lock:
            for work, _ in self._in_flight:
                work.wait()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._in_flight = []

    # ---- decode side -----------------------------------------------------------------------------------------

    def serves(self, hint: bytes) -> bool:
        """Whether `hint` announces a transfer over this link (else the KV must come another way)."""
        meta = _parse(hint)
        return meta.get("transport") == TRANSPORT and meta.get("address") == self.config.address

    def receive(self, hint: bytes, num_tokens: int, first_token_id: int, timeout_s: float | None = None) -> KvExport:
        """Decode side: the KV announced by `hint`, on this device, as an export engine.add_request takes.
        Waits for it to arrive (at most timeout_s, default the link's timeout)."""
        meta = _parse(hint)
        if not self.serves(hint):
            raise KvLinkError(f"transport_hint names {meta.get('transport')!r} at {meta.get('address')!r}; "
                              f"this worker's kv link is {TRANSPORT!r} at {self.config.address!r}")
        if meta["shape"][2] != num_tokens:
            raise KvLinkError(f"transport_hint shape {meta['shape']} does not cover {num_tokens} tokens")
        n = meta["transfer"]
        deadline = time.monotonic() + (self.config.timeout_s if timeout_s is None else timeout_s)
        with self._arrival:
            while n not in self._arrived:
                left = deadline - time.monotonic()
                if self._failure is not None:
                    raise KvLinkError(self._failure)
                if left <= 0:
                    raise KvLinkError(f"kv link {self.config.address}: transfer {n} did not arrive in time")
                self._arrival.wait(left)
            kv = self._arrived.pop(n).kv
        scales = meta.get("scales")
        return KvExport(num_tokens, first_token_id, meta["mrope_position_delta"], list(kv[:, 0]), list(kv[:, 1]),
                        None if scales is None else [tuple(pair) for pair in scales])

    def expire(self, older_than_s: float) -> int:
        """Drops received transfers nobody claimed within older_than_s (their decode request went elsewhere)."""
        cutoff = time.monotonic() - older_than_s
        with self._arrival:
            stale = [n for n, a in self._arrived.items() if a.arrived_at < cutoff]
            for n in stale:
                del self._arrived[n]
        if stale:
            log.warning("kv link %s: dropped %d unclaimed transfers", self.config.address, len(stale))
        return len(stale)

    def _receive_loop(self) -> None:
        try:
            while not self._closing.is_set():
                key = f"kv/{self._next}"
                try:
                    self._waiting_store.wait([key], _IDLE_WAIT)
                except dist.DistStoreError as exc:
                    if "timeout" in str(exc):
                        continue
                    raise
                header = self._waiting_store.get(key)
                self._waiting_store.delete_key(key)
                if header == _STOP:
                    break
                meta = _parse(header)
                arrival = _Arrival(self._recv(meta), meta, time.monotonic())
                with self._arrival:
                    self._arrived[self._next] = arrival
                    self._next += 1
                    self._arrival.notify_all()
        except Exception as exc:  # noqa: BLE001 - the peer went away or the link broke: fail the waiters
            if not self._closing.is_set():
                log.exception("kv link %s: receiver stopped", self.config.address)
            with self._arrival:
                self._failure = f"kv link {self.config.address}: receiver stopped: {exc}"
                self._arrival.notify_all()

    def _recv(self, meta: dict) -> torch.Tensor:
        dtype = getattr(torch, meta["dtype"])
        if self._stream is None:
            tensor = torch.empty(meta["shape"], dtype=dtype, device=self.device)
            self.group.recv([_wire(tensor)], self._peer, 0).wait()
            return tensor
        with torch.cuda.stream(self._stream):
            tensor = torch.empty(meta["shape"], dtype=dtype, device=self.device)
            self.group.recv([_wire(tensor)], self._peer, 0).wait()
        self._stream.synchronize()  # complete before any stream reads it
        tensor.record_stream(torch.cuda.current_stream(self.device))  # the engine's stream frees it later
        return tensor

    def close(self) -> None:
        """Stops the receiver thread (decode side); sends still queued are left to complete or fail."""
        self._closing.set()
        if self._receiver is not None and self._receiver.is_alive():
            with contextlib.suppress(RuntimeError, dist.DistError):  # the store's host (the peer) may be gone
                self.store.set(f"kv/{self._next}", _STOP)
            self._receiver.join(timeout=5)


def _prefill_store(config: KvLinkConfig, timeout: datetime.timedelta) -> dist.TCPStore:
    """The pair's store, served from a socket bound to config.host:config.port alone; returns once the decode side
    has connected."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    try:
        listener = socket.create_server((config.host, config.port), family=family)
    except OSError as exc:
        raise KvLinkError(f"kv link {config.address} (prefill): cannot listen there: {exc.strerror or exc}") from exc
    fd = listener.detach()  # the store's from here on: it closes the socket when it goes, or fails to start
    return dist.TCPStore(config.host, config.port, 2, is_master=True, timeout=timeout, master_listen_fd=fd,
                         use_libuv=False)  # the backend that takes a bound socket


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """What goes over the pair: FP8 KV as its bytes (a uint8 view of the same memory), so neither backend needs
    a float8 type; other dtypes as they are."""
    return tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 else tensor


def _parse(hint: bytes) -> dict:
    try:
        meta = json.loads(hint)
    except ValueError as exc:
        raise KvLinkError(f"transport_hint is not JSON: {hint[:80]!r}") from exc
    if not isinstance(meta, dict):
        raise KvLinkError(f"transport_hint is not a JSON object: {hint[:80]!r}")
    return meta
