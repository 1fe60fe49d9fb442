"""RouterConfig: every router setting as a typed, validated object (YAML on disk).

A bad file fails before anything starts, with the dotted key that is wrong in the message.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from contract.network import MIB, KeepaliveConfig, TlsConfig, is_loopback


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PolicyConfig(_Section):
    """How a worker is picked per request (router.policies)."""

    name: Literal["round_robin", "least_loaded", "kv_aware"] = "least_loaded"
    prefill_load_scale: float = Field(1.0, ge=0)
    temperature: float = Field(0.0, ge=0)  # 0: lowest cost wins; > 0: softmax sampling over costs
    block_size: int = Field(16, gt=0)      # tokens per KV block, for converting tokens to blocks
    seed: int | None = None                # fixes the tie-breaking / sampling rng (tests, benchmarks)


class DisaggregationConfig(_Section):
    """Prefill on a PREFILL worker and decode on a DECODE worker (KV pulled worker to worker)."""

    enabled: bool = False
    # Conditional disaggregation: prompts shorter than this prefill locally on the decode worker.
    min_remote_prefill_tokens: int = Field(0, ge=0)
    # A prefill worker with more prompt tokens than this waiting is saturated; when all are, prefill locally.
    prefill_busy_threshold: int = Field(65536, gt=0)


class LimitsConfig(_Section):
    """Admission: requests beyond the in-flight limits wait in a bounded queue; beyond it, RESOURCE_EXHAUSTED."""

    max_inflight_per_worker: int = Field(512, gt=0)
    max_inflight_total: int = Field(8192, gt=0)
    max_queue: int = Field(4096, ge=0)
    max_message_bytes: int = Field(64 * MIB, gt=0)  # images travel inside GenerateRequest


class HealthConfig(_Section):
    """Worker liveness: heartbeats, and an engine whose step counter stalls while it has work."""

    heartbeat_interval_s: float = Field(1.0, gt=0)
    down_after_s: float = Field(5.0, gt=0)
    poll_load: bool = False  # also poll WorkerService.GetLoad every heartbeat interval


class MigrationConfig(_Section):
    """Replay a request whose worker failed on another worker, with the tokens already streamed."""

    max_retries: int = Field(2, ge=0)
    # With no healthy worker to migrate to (the only one died and Ray is restarting it, or it was marked down
    # for a while), a migration waits this long for one to register (within the request's deadline).
    wait_for_worker_s: float = Field(60.0, ge=0)


class WorkerStreamConfig(_Section):
    """worker_transport stream: the requests to a worker share one stream (router.worker_stream)."""

    # A request larger than this (inline images) takes a call of its own: on the shared stream it would hold up every
    # other request to its worker while its bytes are written. 64 KiB is HTTP/2's initial flow-control window
    # (65,535 bytes, RFC 9113 6.9.2): a request within it is written without waiting for the worker to grant more.
    max_request_bytes: int = Field(64 * 1024, ge=0)


class RouterConfig(_Section):
    listen: str = "127.0.0.1:0"
    http_listen: str | None = None
    token: str | None = None  # shared secret: `authorization: Bearer <token>` on every call
    tls: TlsConfig | None = None
    served_model_name: str = "Qwen/Qwen3-VL-235B-A22B-Instruct"  # what /v1/models lists
    default_max_tokens: int = Field(150, gt=0)  # HTTP requests that name no max_tokens (MLPerf's limit)
    policy: PolicyConfig = PolicyConfig()
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    limits: LimitsConfig = LimitsConfig()
    health: HealthConfig = HealthConfig()
    migration: MigrationConfig = MigrationConfig()
    keepalive: KeepaliveConfig = KeepaliveConfig()  # of the router's channels to its workers
    # How the dispatcher reaches a worker: "stream", one bidirectional stream per worker carrying every request
    # (WorkerService.GenerateMultiplexed); "call", a gRPC call per request (Generate, GenerateWhole).
    worker_transport: Literal["call", "stream"] = "stream"
    worker_stream: WorkerStreamConfig = WorkerStreamConfig()

    @model_validator(mode="after")
    def _non_local_bind_needs_token(self) -> RouterConfig:
        for key in ("listen", "http_listen"):
            address = getattr(self, key)
            if address is not None and not is_loopback(address) and not self.token:
                raise ValueError(f"{key}={address!r} is not a loopback address: set 'token' (shared secret)")
        return self


def load_router_config(path: Path | str, **overrides: object) -> RouterConfig:
    """Read a YAML router config; `overrides` (top-level keys, None ignored) win over the file."""
    path = Path(path)
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"router config {path}: top level must be a mapping")
    data.update({k: v for k, v in overrides.items() if v is not None})
    return parse_router_config(data, source=str(path))


def parse_router_config(data: dict, source: str = "router config") -> RouterConfig:
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"key '{'.'.join(str(p) for p in err['loc']) or '<root>'}': {err['msg']}" for err in exc.errors()
        )
        raise ValueError(f"{source}: {problems}") from None
