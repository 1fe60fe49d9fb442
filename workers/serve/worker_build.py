"""What one served worker is made of, for both of its entry points, the command line (`python -m workers.serve.server`)
and the Ray actor (harness/ray_workers.ModelWorker): an engine with its checkpoint's sampling defaults
(ServedEngine, serve_llm_engine for the product engine) and the worker's settings (WorkerSettings, built once: from
the system config by harness.system_config.worker_settings, or from the command line); workers.serve.server.build_worker
puts them together."""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.network import MIB, KeepaliveConfig
from contract.types import SamplingParams
from workers.config import EngineConfig, KvLinkConfig
from workers.engine_api import ServingEngine


@dataclass(frozen=True)
class ServedEngine:
    """A serving engine and the sampling defaults of its checkpoint (generation_config.json)."""

    async_engine: ServingEngine
    generation_defaults: SamplingParams


@dataclass(frozen=True)
class WorkerSettings:
    """How one worker serves, registers and hands KV over (everything but its engine), passed whole to WorkerServer.

    role: aggregated | prefill | decode. router_address: the router it registers with (None: it does not register).
    listen: its gRPC address; a non-loopback one needs `token`, the shared secret, which also authenticates its calls
    to the router and its peers. advertise_host: the host it tells the router (None: its listen host, or this
    machine's address when that is a wildcard). model_name, kv_block_size, max_model_len: what it registers as.
    kv_hold_s: how long a finished prefill's KV waits to be pulled. keepalive: of its channels (to the router, to
    prefill peers). kv_link: the GPU-to-GPU KV link to its one peer (a prefill and a decode worker), None: KV over
    gRPC (PullKv)."""

    worker_id: str
    role: str = "aggregated"
    router_address: str | None = None  # comma-separated: registers with each of those routers
    listen: str = "127.0.0.1:0"
    token: str | None = None
    advertise_host: str | None = None
    model_name: str = ""
    kv_block_size: int = 16
    max_model_len: int = 0
    max_message_bytes: int = 64 * MIB
    heartbeat_interval_s: float = 1.0
    kv_hold_s: float = 60.0
    keepalive: KeepaliveConfig = field(default_factory=KeepaliveConfig)
    kv_link: KvLinkConfig | None = None


def serve_llm_engine(config: EngineConfig) -> ServedEngine:
    """The product engine: LLMEngine in its AsyncEngine step-loop wrapper."""
    from workers.serve.async_engine import AsyncEngine
    from workers.engine import LLMEngine

    engine = LLMEngine.from_config(config)
    return ServedEngine(AsyncEngine(engine), engine.generation_defaults)
