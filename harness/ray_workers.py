"""Model workers as Ray actors: one actor per model instance on a STRICT_PACK placement group holding its
GPUs/CPUs, restarted by Ray when it dies (it rebuilds its engine and re-registers with the router).
A prefill/decode pair with a KV link connects it (workers/serve/kv_transfer.py) before serving."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ipaddress
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from contract import event_loop
from harness.interrupts import deferred
from harness.ray_log import RayLogFile
from harness.ray_network import LOCAL_MODE_ENV, make_temp_dir, remove_temp_dir
from harness.system_config import PoolSection, RaySection
from workers.serve.worker_build import ServedEngine, WorkerSettings, serve_llm_engine

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 1800.0  # a large cluster may take long to free GPUs


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What one actor needs to serve a worker: the worker's settings (harness.system_config.worker_settings; in the
    fleet's template its id, role, router and KV link's host and role are placeholders the fleet fills in per worker)
    and how to build its engine."""

    settings: WorkerSettings
    engine_factory: Callable[[], ServedEngine]


def build_engine(engine_config) -> ServedEngine:
    """The product engine (workers.serve.worker_build.serve_llm_engine)."""
    return serve_llm_engine(engine_config)


class ModelWorker:
    """The actor body. Everything happens in __init__ so that a Ray restart brings the worker back.

    `colocated` specs are served by the same process on their own ports (simulated workers: many per process)."""

    def __init__(self, spec: WorkerSpec, *colocated: WorkerSpec) -> None:
        from workers.serve.server import build_worker

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._loop = event_loop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="worker-server", daemon=True)
        self._thread.start()
        self._engines = []
        self._servers: dict[str, Any] = {}
        for one in (spec, *colocated):
            served = one.engine_factory()
            self._engines.append(served.async_engine)
            server = build_worker(served, one.settings)
            asyncio.run_coroutine_threadsafe(server.start(), self._loop).result()
            self._servers[one.settings.worker_id] = server
            logger.info("worker %s (%s) serving on %s", one.settings.worker_id, one.settings.role, server.address)
        self._server = self._servers[spec.settings.worker_id]

    def address(self) -> str:
        return self._server.address

    def addresses(self) -> dict[str, str]:
        """worker_id -> address of every worker this process serves."""
        return {worker_id: server.address for worker_id, server in self._servers.items()}

    def kv_link_transfers(self) -> dict[str, int]:
        """worker_id -> KV transfers its link has sent (prefill) or received (decode), for workers with a link."""
        return {wid: s.kv_link.transfers for wid, s in self._servers.items() if s.kv_link is not None}

    def stop(self) -> None:
        """Stops serving (deregisters by going silent) and shuts the engines down."""
        for server in self._servers.values():
            asyncio.run_coroutine_threadsafe(server.stop(), self._loop).result()
        for engine in self._engines:
            engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)


@dataclasses.dataclass
class _Instance:
    worker_id: str
    actor: Any
    group: PlacementGroup
    colocated: tuple[str, ...] = ()  # further workers served by the same actor


@dataclasses.dataclass
class RaySession:
    """This process's Ray. `close()` (idempotent) disconnects from a joined cluster, or stops an embedded one and
    removes its session files, then gives Ray's log lines back to the console; a session that found Ray already
    initialised owns nothing and closes nothing."""

    owned: bool
    temp_dir: Path | None = None  # an embedded Ray's session files (Ray's _temp_dir), the harness's to remove
    log: RayLogFile | None = None  # where Ray's own log lines go meanwhile

    def close(self) -> None:
        try:
            if self.owned and ray.is_initialized():
                ray.shutdown()
            self.owned = False
            if self.temp_dir is not None:
                temp_dir, self.temp_dir = self.temp_dir, None
                remove_temp_dir(temp_dir)
        finally:
            if self.log is not None:
                self.log.close()


def init_ray(settings: RaySection, address: str | None, log_file: Path | None = None) -> RaySession:
    """Joins `address`, or starts an embedded local Ray on loopback with its session files in a fresh temp dir.
    Ray's own log lines go to `log_file` (appended) until the session closes, when one is given.

    SIGINT and SIGTERM are held until Ray is up (or has failed and been shut down); if one came meanwhile, Ray is
    shut down again and the signal then delivered. Raised inside ray.init, an interrupt was caught and logged by
    Ray's start-up (the run went on), or left a half-built core worker that crashed the process on shutdown with
    the temp dir left behind. ray.init would also make SIGTERM exit the process at once (`sys.exit`, mid-start);
    while it runs SIGTERM stays the caller's.
    """
    if ray.is_initialized():
        return RaySession(owned=False)
    session = RaySession(owned=True, log=RayLogFile(log_file) if log_file is not None else None)
    if session.log is not None:
        session.log.open()
    with deferred("Ray has started") as held, _ray_keeps_the_sigterm_handler():
        try:
            if address is not None:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
            else:
                session.temp_dir = make_temp_dir()
                _start_embedded(settings, session.temp_dir)
                logger.info("embedded Ray on loopback, its session files in %s", session.temp_dir)
        except BaseException:
            session.close()
            raise
        if held:  # interrupted while starting: nothing of it is left when the signal is delivered
            session.close()
    return session


@contextlib.contextmanager
def _ray_keeps_the_sigterm_handler() -> Iterator[None]:
    """ray.init installs a SIGTERM handler of its own through ray._private.utils.set_sigterm_handler (a private
    function: if a Ray release drops it, nothing is changed and SIGTERM during ray.init exits at once, as before)."""
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    original = getattr(utils, "set_sigterm_handler", None)
    if original is None:
        yield
        return
    utils.set_sigterm_handler = lambda _handler: None
    try:
        yield
    finally:
        utils.set_sigterm_handler = original


# How long the embedded Ray's start waits for its GCS server's port file (Ray's default 30 s; a loaded 2-core machine
# has taken longer, and the start then failed with nothing to retry). RAY_GCS_WAIT_ENV set by the operator wins.
GCS_PORT_WAIT_S = 120
RAY_GCS_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"


@contextlib.contextmanager
def _gcs_port_wait(seconds: int) -> Iterator[None]:
    """RAY_GCS_WAIT_ENV at `seconds` while Ray starts (ray._private.node reads it then), unless it is set already."""
    if RAY_GCS_WAIT_ENV in os.environ:
        yield
        return
    os.environ[RAY_GCS_WAIT_ENV] = str(seconds)
    try:
        yield
    finally:
        os.environ.pop(RAY_GCS_WAIT_ENV, None)


def _start_embedded(settings: RaySection, temp_dir: Path) -> None:
    with _gcs_port_wait(GCS_PORT_WAIT_S):
        _start_embedded_ray(settings, temp_dir)


def _start_embedded_ray(settings: RaySection, temp_dir: Path) -> None:
    store = settings.object_store_memory_mb * 1024 * 1024 if settings.object_store_memory_mb else None
    # address "local": always a Ray of our own. Without an address ray.init joins whatever cluster RAY_ADDRESS
    # or /tmp/ray/ray_current_cluster names (another run's, a stray one) and then refuses num_cpus.
    start = functools.partial(
        ray.init, address="local", num_cpus=settings.num_cpus, num_gpus=settings.num_gpus,
        object_store_memory=store, include_dashboard=False, log_to_driver=False, _temp_dir=str(temp_dir),
    )
    try:
        start()
    except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception when its node does not come up in time
        if not start_timed_out(exc):
            raise
        # A loaded host can be slow to start the raylet or the GCS server; a second start usually succeeds.
        logger.warning("embedded Ray did not start in time (%s); starting it once more%s", exc,
                       _gcs_server_log_tail(temp_dir))
        ray.shutdown()
        start()
    node_ip = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node_ip).is_loopback:
        raise RuntimeError(
            f"the embedded Ray came up on {node_ip}, not on loopback: {LOCAL_MODE_ENV} must not be 1, and harness "
            "must be imported before ray (it sets the switch Ray reads at import)")


def start_timed_out(exc: Exception) -> bool:
    """Whether ray.init failed waiting for its own processes: the node's start (a bare Exception) or the GCS
    server's port file (a RuntimeError from ray._private.node's wait, RAY_GCS_WAIT_ENV seconds; CI, 2026-12-07: a
    2-core machine's test run once waited 120 s for it)."""
    text = str(exc)
    return "timed out during startup" in text or ("Timed out waiting for file" in text and "gcs_server_port" in text)


def _gcs_server_log_tail(temp_dir: Path, lines: int = 5) -> str:
    """The last lines of the GCS server's own logs in the embedded Ray's session files (its cause, where it wrote
    one), for the warning; '' when there are none."""
    tails = []
    for log in sorted(temp_dir.glob("session_*/logs/gcs_server.*")):
        try:
            text = log.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            continue
        if text:
            tails.append(f"{log.name}: " + " | ".join(text))
    return "; the GCS server's log: " + "; ".join(tails) if tails else ""


class WorkerFleet:
    """Every worker of every pool, started as restartable actors; `stop()` releases actors and GPUs."""

    def __init__(self, pools: list[PoolSection], template: WorkerSpec, *,
                 factory_for_pool: Callable[[PoolSection], Callable[[], ServedEngine]] | None = None,
                 workers_per_actor: int = 1, use_gpus: bool = True, cpus_per_actor: float | None = None,
                 router_addresses: Sequence[str] = ()) -> None:
        """`template` gives every worker's spec; its settings' worker_id, role and router are replaced per worker, and
        its engine factory by `factory_for_pool(pool)` when given. `workers_per_actor` > 1 and `use_gpus=False` are for
        simulated workers (many per process, no GPUs); `cpus_per_actor` then replaces the pools' cpus_per_worker.
        `router_addresses` (sharded routers): the n-th worker registers with router n mod len(router_addresses).
        A template with a kv_link joins the prefill and the decode worker (one of each): the prefill worker listens
        on its node's address."""
        self._pools = pools
        self._template = template
        self._factory_for_pool = factory_for_pool
        self._workers_per_actor = workers_per_actor
        self._use_gpus = use_gpus
        self._cpus_per_actor = cpus_per_actor
        self._router_turn = itertools.cycle(tuple(router_addresses) or (template.settings.router_address,))
        self.instances: list[_Instance] = []

    @property
    def worker_ids(self) -> list[str]:
        return [wid for instance in self.instances for wid in (instance.worker_id, *instance.colocated)]

    def start(self) -> None:
        """Places every instance, then starts its actor (once all are placed: a kv link needs the prefill's node)."""
        planned = []
        for pool in self._pools:
            gpus = pool.gpus_per_worker if self._use_gpus else 0
            cpus = self._cpus_per_actor or pool.cpus_per_worker
            for first in range(0, pool.count, self._workers_per_actor):
                ids = [f"{pool.role}-{i}" for i in range(first, min(first + self._workers_per_actor, pool.count))]
                bundle = {"CPU": cpus, **pool.resources}
                if gpus:
                    bundle["GPU"] = gpus
                group = placement_group([bundle], strategy="STRICT_PACK", name=f"q3vl-{ids[0]}")
                self.instances.append(_Instance(ids[0], None, group, tuple(ids[1:])))
                planned.append((self.instances[-1], pool, ids, cpus, gpus))
        for instance in self.instances:
            ray.get(instance.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        link = self._template.settings.kv_link
        if link is not None:
            prefill = next(instance for instance, pool, *_ in planned if pool.role == "prefill")
            link = dataclasses.replace(link, host=_node_address(prefill.group))
        actor_class = ray.remote(ModelWorker)
        for instance, pool, ids, cpus, gpus in planned:
            factory = self._template.engine_factory
            if self._factory_for_pool is not None:
                factory = self._factory_for_pool(pool)
            settings = self._template.settings
            if link is not None:
                settings = dataclasses.replace(
                    settings, kv_link=dataclasses.replace(link, role=pool.role) if pool.role != "aggregated" else None)
            specs = [WorkerSpec(dataclasses.replace(settings, worker_id=wid, role=pool.role,
                                                    router_address=next(self._router_turn)), factory)
                     for wid in ids]
            instance.actor = actor_class.options(
                name=f"q3vl-{ids[0]}",
                num_cpus=cpus,
                num_gpus=gpus,
                resources=dict(pool.resources),
                max_restarts=-1,
                max_concurrency=4,  # address() must answer while another call waits
                scheduling_strategy=PlacementGroupSchedulingStrategy(instance.group, placement_group_bundle_index=0),
            ).remote(*specs)

    def kv_link_transfers(self) -> dict[str, int]:
        """worker_id -> KV transfers over its link (sent by the prefill worker, received by the decode worker)."""
        counts = ray.get([instance.actor.kv_link_transfers.remote() for instance in self.instances])
        return {wid: n for one in counts for wid, n in one.items()}

    def addresses(self, timeout_s: float) -> dict[str, str]:
        """worker_id -> gRPC address, once every actor has (re)built its engine; waits out restarts."""
        deadline = time.monotonic() + timeout_s
        return {wid: address for instance in self.instances for wid, address in self._addresses(instance, deadline).items()}

    @staticmethod
    def _addresses(instance: _Instance, deadline: float) -> dict[str, str]:
        while True:
            try:
                return ray.get(instance.actor.addresses.remote(), timeout=max(deadline - time.monotonic(), 0.1))
            except ray.exceptions.ActorUnavailableError:  # restarting: its constructor is running again
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def kill(self, worker_id: str) -> None:
        """Kills one actor's process (and the workers colocated with it); Ray restarts it (used to test recovery)."""
        actor = next(i.actor for i in self.instances if worker_id in (i.worker_id, *i.colocated))
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


def _node_address(group: PlacementGroup) -> str:
    """The IP address of the node holding the group's (first) bundle."""
    node_id = ray.util.placement_group_table(group)["bundles_to_node_id"][0]
    return next(node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == node_id)


def engine_factory_for(engine_config) -> Callable[[], ServedEngine]:
    return functools.partial(build_engine, engine_config)


def build_simulated_engine(engine_config, simulation, hardware: str, tp: int) -> ServedEngine:
    """A model-free engine timed by the step model of `hardware` (workers.sim), in the same AsyncEngine loop."""
    from workers.serve.async_engine import AsyncEngine
    from workers.sim.engine import build_step_model, simulated

    step_model = build_step_model(hardware, simulation, tp, vision_split=engine_config.vision_tensor_parallel)
    engine = simulated(engine_config, simulation, step_model)
    return ServedEngine(AsyncEngine(engine), engine.generation_defaults)


def simulated_factory_for_pool(engine_config, simulation, hardware: str) -> Callable[[PoolSection], Callable[[], ServedEngine]]:
    """Per pool: simulated engines as wide (tp) as the pool's instances."""
    return lambda pool: functools.partial(build_simulated_engine, engine_config, simulation, hardware, pool.tp)
