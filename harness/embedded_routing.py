"""router.mode embedded (the system YAML): LoadGen's queries are routed inside the SUT's own process, as Dynamo's
frontend routes, and stream straight from the chosen worker: one network hop a query instead of two.

How a run fits together:
* harness.cluster.Cluster holds one loopback address for the whole run (ReservedAddress) and has every worker
  register with it as well as with the router process. The router process stays: it serves HTTP/OpenAI clients,
  gRPC health and the warm-up, and keeps the registry of record.
* Each LoadGen test process (`python -m harness run-test --embedded-router ADDRESS`) starts
  router.embedded.EmbeddedRouter there from the same `router` section, in the SUT's event loop
  (start_embedded_router), and waits for the workers to register with it. Registration, health, admission, the
  policies and migration are the router's own code; only the SUT's hop to the router is gone.
* The SUT sends through a RouterPath: the EmbeddedRouter here, a RouterClient in process mode.
* The embedded router logs to <scenario dir>/embedded-router.log, beside the router process's router.log.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from contract.wire import pb
from router.config import RouterConfig
from router.embedded import EmbeddedRouter
from router.registry import SERVING_ROLES

logger = logging.getLogger(__name__)

LOG_FILE = "embedded-router.log"
READY_TIMEOUT_S = 60.0  # every worker retries registration each heartbeat interval: normally they are in within one


class RouterPath(Protocol):
    """What the SUT streams a query's chunks through: router.client.RouterClient or ShardedRouterClient (gRPC to
    the router processes) or router.embedded.EmbeddedRouter (the router in this process). Either way a refusal or
    failure arrives as grpc.aio.AioRpcError with the router's status."""

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None
                 ) -> AsyncIterator[pb.GenerateChunk]: ...

    async def close(self) -> None: ...


class ReservedAddress:
    """A loopback port held for as long as a run lasts, so that the test processes started one after another can
    each listen there and the workers keep finding them at one address.

    The holding socket is bound with SO_REUSEPORT and never listens: a process binding the port without that option
    (anyone else) is refused, while gRPC's listener (which sets it) binds beside it, and connections go to the
    listener alone."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self._socket.bind((host, 0))
        self.address = f"{host}:{self._socket.getsockname()[1]}"

    def close(self) -> None:
        self._socket.close()

    def __enter__(self) -> ReservedAddress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass(frozen=True)
class EmbeddedRouting:
    """What a test process needs to route in itself."""

    config: RouterConfig  # the system's router section, listening at the run's reserved address, without HTTP
    workers: int  # how many workers (every role) to wait for before the first query
    ready_timeout_s: float = READY_TIMEOUT_S


def embedded_routing(router: RouterConfig, workers: int) -> EmbeddedRouting:
    """`router` (the system's, listening at the run's reserved address) as the SUT's process runs it: without the
    HTTP front end, whose clients go to the router process (the configured port has one listener)."""
    return EmbeddedRouting(router.model_copy(update={"http_listen": None}), workers)


async def start_embedded_router(routing: EmbeddedRouting) -> EmbeddedRouter:
    """The router started in the running event loop, once its workers have registered with it: all of them, or,
    when some have not within ready_timeout_s (one being restarted), those that have, if any can serve."""
    router = EmbeddedRouter(routing.config)
    await router.start()
    try:
        await router.wait_for_workers(routing.workers, timeout=routing.ready_timeout_s)
    except TimeoutError as exc:
        listing = await router.list_workers()
        if not any(ok and w.role in SERVING_ROLES for w, ok in zip(listing.workers, listing.healthy)):
            await router.close(0)
            raise
        logger.warning("%s; routing over the workers that did register", exc)
    except BaseException:
        await router.close(0)
        raise
    return router


def log_router_to(path: Path) -> logging.Handler:
    """The router package's log (INFO and up) goes to `path`, appended, instead of this process's stderr, as a
    router process's goes to its router.log. Returns the handler (remove it from logging.getLogger("router"))."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    router_logger = logging.getLogger("router")
    router_logger.addHandler(handler)
    router_logger.setLevel(logging.INFO)
    router_logger.propagate = False
    return handler
