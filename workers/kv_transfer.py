"""GPU-to-GPU hand-off of a request's KV cache between a prefill worker and a decode worker: one
point-to-point torch.distributed pair (NCCL between GPUs, gloo on CPU), so the KV never visits the host.

Wire: the prefill worker's KvHandle carries `transport_hint` = KvLink.hint(): JSON naming the transport
("torch-p2p"), the link's rendezvous address and the tensor's shape/dtype. A decode worker whose KvLink
has the same address calls receive() instead of pulling KvChunks over gRPC (workers/server.py PullKv
stays the portable path). The pair is a private process group (no default group is touched), so an
engine may also be a multi-GPU instance with its own group.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workers.kv_cache import KvExport

TRANSPORT = "torch-p2p"


@dataclass(frozen=True)
class KvLinkConfig:
    """Both ends use the same host/port; the prefill side is rank 0 (it hosts the rendezvous store)."""

    host: str
    port: int
    role: str  # "prefill" (sender) | "decode" (receiver)
    device: str = "cuda:0"
    timeout_s: float = 600.0


class KvLink:
    """One direction of KV hand-off between two worker processes."""

    def __init__(self, config: KvLinkConfig):
        if config.role not in ("prefill", "decode"):
            raise ValueError(f"KvLinkConfig.role: expected 'prefill' or 'decode', got {config.role!r}")
        self.config = config
        self.device = torch.device(config.device)
        self.rank = 0 if config.role == "prefill" else 1
        timeout = datetime.timedelta(seconds=config.timeout_s)
        store = dist.TCPStore(config.host, config.port, 2, is_master=self.rank == 0, timeout=timeout)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            self.group = dist.ProcessGroupNCCL(store, self.rank, 2, opts)
        else:
            self.group = dist.ProcessGroupGloo(store, self.rank, 2, timeout)
        self._peer = 1 - self.rank
        self._in_flight: list[tuple[object, torch.Tensor]] = []  # sends not yet known complete, with their buffers

    def hint(self, kv: KvExport) -> bytes:
        """KvHandle.transport_hint for this export."""
        shape = [kv.num_layers, 2, kv.num_tokens, kv.num_kv_heads, kv.head_dim]
        return json.dumps({"transport": TRANSPORT, "address": f"{self.config.host}:{self.config.port}",
                           "shape": shape, "dtype": kv.dtype_name}).encode()

    def send(self, kv: KvExport) -> None:
        """Prefill side: the export (from engine.export_kv(rid, on_device=True)) to the decode side. Returns once
        the send is queued: the copy runs on the transport's own stream while this engine computes on, and the
        request's blocks may be released at once (the buffer is a copy, kept until the send completes)."""
        tensor = kv.stacked().to(self.device).contiguous()
        self._in_flight = [(w, t) for w, t in self._in_flight if not w.is_completed()]
        self._in_flight.append((self.group.send([tensor], self._peer, 0), tensor))

    def flush(self) -> None:
        """Blocks until every queued send has been received."""
        for work, _ in self._in_flight:
            work.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._in_flight = []

    def receive(self, hint: bytes, num_tokens: int, first_token_id: int, mrope_position_delta: int) -> KvExport:
        """Decode side: the KV announced by `hint`, on this device, as an export engine.add_request takes."""
        meta = json.loads(hint)
        if meta.get("transport") != TRANSPORT:
            raise ValueError(f"transport_hint names transport {meta.get('transport')!r}, this link is {TRANSPORT!r}")
        if meta["shape"][2] != num_tokens:
            raise ValueError(f"transport_hint shape {meta['shape']} does not cover {num_tokens} tokens")
        tensor = torch.empty(meta["shape"], dtype=getattr(torch, meta["dtype"]), device=self.device)
        self.group.recv([tensor], self._peer, 0).wait()
        return KvExport(num_tokens, first_token_id, mrope_position_delta, list(tensor[:, 0]), list(tensor[:, 1]))
