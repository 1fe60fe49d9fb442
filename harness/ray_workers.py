"""Model workers as Ray actors: one actor per model instance on a STRICT_PACK placement group holding its
GPUs/CPUs, restarted by Ray when it dies (it rebuilds its engine and re-registers with the router)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from harness.system_config import PoolSection, RaySection

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 1800.0  # a large cluster may take long to free GPUs


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What one actor needs to serve: its identity, where the router is, how to build its engine."""

    worker_id: str
    role: str  # aggregated | prefill | decode
    router_address: str
    router_token: str | None
    engine_factory: Callable[[], ServedEngine]
    model_name: str = ""
    kv_block_size: int = 16
    max_model_len: int = 0
    heartbeat_interval_s: float = 1.0
    listen_host: str = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class ServedEngine:
    """An engine with the AsyncEngine interface and the sampling defaults of its checkpoint."""

    async_engine: Any
    generation_defaults: Any  # workers.types.SamplingParams from generation_config.json


def build_engine(engine_config) -> ServedEngine:
    """The product engine: LLMEngine in its AsyncEngine step-loop wrapper."""
    from workers.async_engine import AsyncEngine
    from workers.engine import LLMEngine

    engine = LLMEngine(engine_config)
    return ServedEngine(AsyncEngine(engine), engine.generation_defaults)


class ModelWorker:
    """The actor body. Everything happens in __init__ so that a Ray restart brings the worker back."""

    def __init__(self, spec: WorkerSpec) -> None:
        from workers.server import WorkerServer

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="worker-server", daemon=True)
        self._thread.start()
        served = spec.engine_factory()
        self._engine = served.async_engine
        self._server = WorkerServer(
            self._engine,
            spec.worker_id,
            spec.role,
            router_address=spec.router_address,
            listen=f"{spec.listen_host}:0",
            token=spec.router_token,
            model_name=spec.model_name,
            kv_block_size=spec.kv_block_size,
            max_model_len=spec.max_model_len,
            heartbeat_interval_s=spec.heartbeat_interval_s,
            generation_defaults=served.generation_defaults,
        )
        asyncio.run_coroutine_threadsafe(self._server.start(), self._loop).result()
        logger.info("worker %s (%s) serving on %s", spec.worker_id, spec.role, self._server.address)

    def address(self) -> str:
        return self._server.address

    def stop(self) -> None:
        """Stops serving (deregisters by going silent) and shuts the engine down."""
        asyncio.run_coroutine_threadsafe(self._server.stop(), self._loop).result()
        self._engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)


@dataclasses.dataclass
class _Instance:
    worker_id: str
    actor: Any
    group: PlacementGroup


def init_ray(settings: RaySection, address: str | None) -> bool:
    """Joins `address`, or starts an embedded local Ray; returns whether this call connected (the caller
    then owns `ray.shutdown()`: it disconnects from a joined cluster, it stops an embedded one).

    ray.init installs its own SIGTERM handler (it aborts the process); the caller's handlers are put back
    so that SIGTERM still tears everything down in order.
    """
    if ray.is_initialized():
        return False
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    if address is not None:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    else:
        store = settings.object_store_memory_mb * 1024 * 1024 if settings.object_store_memory_mb else None
        ray.init(
            num_cpus=settings.num_cpus,
            num_gpus=settings.num_gpus,
            object_store_memory=store,
            include_dashboard=False,
            log_to_driver=False,
        )
    if threading.current_thread() is threading.main_thread():
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return True


class WorkerFleet:
    """Every worker of every pool, started as restartable actors; `stop()` releases actors and GPUs."""

    def __init__(self, pools: list[PoolSection], template: WorkerSpec) -> None:
        """`template` gives every worker's spec; its worker_id and role are replaced per worker."""
        self._pools = pools
        self._template = template
        self.instances: list[_Instance] = []

    @property
    def worker_ids(self) -> list[str]:
        return [instance.worker_id for instance in self.instances]

    def start(self) -> None:
        actor_class = ray.remote(ModelWorker)
        for pool in self._pools:
            for i in range(pool.count):
                worker_id = f"{pool.role}-{i}"
                bundle = {"CPU": pool.cpus_per_worker}
                if pool.gpus_per_worker:
                    bundle["GPU"] = pool.gpus_per_worker
                group = placement_group([bundle], strategy="STRICT_PACK", name=f"q3vl-{worker_id}")
                self.instances.append(_Instance(worker_id, None, group))
                spec = dataclasses.replace(self._template, worker_id=worker_id, role=pool.role)
                self.instances[-1].actor = actor_class.options(
                    name=f"q3vl-{worker_id}",
                    num_cpus=pool.cpus_per_worker,
                    num_gpus=pool.gpus_per_worker,
                    max_restarts=-1,
                    max_concurrency=4,  # address() must answer while another call waits
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
                ).remote(spec)
        for instance in self.instances:
            ray.get(instance.group.ready(), timeout=PLACEMENT_TIMEOUT_S)

    def addresses(self, timeout_s: float) -> dict[str, str]:
        """worker_id -> gRPC address, once every actor has (re)built its engine; waits out restarts."""
        deadline = time.monotonic() + timeout_s
        return {instance.worker_id: self._address(instance, deadline) for instance in self.instances}

    @staticmethod
    def _address(instance: _Instance, deadline: float) -> str:
        while True:
            try:
                return ray.get(instance.actor.address.remote(), timeout=max(deadline - time.monotonic(), 0.1))
            except ray.exceptions.ActorUnavailableError:  # restarting: its constructor is running again
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def kill(self, worker_id: str) -> None:
        """Kills one actor's process; Ray restarts it (used to test recovery)."""
        actor = next(i.actor for i in self.instances if i.worker_id == worker_id)
        ray.kill(actor, no_restart=False)

    def stop(self) -> None:
        for instance in self.instances:
            try:
                ray.get(instance.actor.stop.remote(), timeout=30)
            except Exception as exc:  # a dead or wedged actor is killed below either way
                logger.warning("worker %s did not stop cleanly: %s", instance.worker_id, exc)
            ray.kill(instance.actor, no_restart=True)
            remove_placement_group(instance.group)
        self.instances.clear()


def engine_factory_for(engine_config) -> Callable[[], ServedEngine]:
    return functools.partial(build_engine, engine_config)
