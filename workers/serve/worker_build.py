"""What one served worker is made of, for both of its entry points, the command line (`python -m workers.serve.server`)
and the Ray actor (harness/ray_workers.ModelWorker): an engine with its checkpoint's sampling defaults
(ServedEngine, serve_llm_engine for the product engine) and the worker's settings (WorkerSettings);
workers.serve.server.build_worker puts them together."""

from __future__ import annotations

from dataclasses import dataclass
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
    from workers.serve.async_engine import AsyncEngine
    from workers.engine import LLMEngine

    engine = LLMEngine.from_config(config)
    return ServedEngine(AsyncEngine(engine), engine.generation_defaults)
