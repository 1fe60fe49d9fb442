"""One way to build a served worker, for both of its entry points: the command line (`python -m workers.server`)
and the Ray actor (harness/ray_workers.ModelWorker). An engine with its checkpoint's sampling defaults, served by a
WorkerServer with the worker's settings (and, for a prefill/decode pair, its GPU-to-GPU KV link)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from contract.types import SamplingParams
from workers.config import EngineConfig, KvLinkConfig
from workers.engine_api import ServingEngine

if TYPE_CHECKING:
    from workers.server import WorkerServer


@dataclass(frozen=True)
class ServedEngine:
    """A serving engine and the sampling defaults of its checkpoint (generation_config.json)."""

    async_engine: ServingEngine
    generation_defaults: SamplingParams


@dataclass(frozen=True)
class WorkerSettings:
    """How one worker serves, registers and hands KV over (everything but its engine)."""

    worker_id: str
    role: str = "aggregated"
    router_address: str | None = None
    listen: str = "127.0.0.1:0"
    token: str | None = None
    model_name: str = ""
    kv_block_size: int = 16
    max_model_len: int = 0
    heartbeat_interval_s: float = 1.0
    kv_link: KvLinkConfig | None = None


def serve_llm_engine(config: EngineConfig) -> ServedEngine:
    """The product engine: LLMEngine in its AsyncEngine step-loop wrapper."""
    from workers.async_engine import AsyncEngine
    from workers.engine import LLMEngine

    engine = LLMEngine(config)
    return ServedEngine(AsyncEngine(engine), engine.generation_defaults)


def build_worker(served: ServedEngine, settings: WorkerSettings) -> WorkerServer:
    """The WorkerServer for `served` (not started). With a KV link this waits for the peer to connect."""
    from workers.kv_transfer import KvLink
    from workers.server import WorkerServer

    link = None if settings.kv_link is None else KvLink(settings.kv_link)
    return WorkerServer(
        served.async_engine, settings.worker_id, settings.role, router_address=settings.router_address,
        listen=settings.listen, token=settings.token, model_name=settings.model_name,
        kv_block_size=settings.kv_block_size, max_model_len=settings.max_model_len,
        heartbeat_interval_s=settings.heartbeat_interval_s, generation_defaults=served.generation_defaults,
        kv_link=link,
    )
