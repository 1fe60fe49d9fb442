"""In-process router + instant-engine workers for the router tests (one event loop, loopback ports).

`Cluster` starts a RouterServer and WorkerServers around InstantEngines and waits until all registered. Its
`client` reaches the router the way its `mode` says: "process", over gRPC (RouterClient), as a caller in another
process does; "embedded", by calling the dispatcher in this process (router.embedded.EmbeddedRouter), as the
harness SUT does with router.mode embedded. Tests of behaviour that must not depend on the mode run in both (MODES).
The router reaches its workers the way `transport` says (RouterConfig.worker_transport; None: its default), and
tests of behaviour that must not depend on it run on each (TRANSPORTS).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from contract.wire import pb
from router.client import RouterClient
from router.config import parse_router_config
from router.embedded import EmbeddedRouter
from router.server import RouterServer
from workers.serve.server import WorkerServer
from workers.serve.worker_build import WorkerSettings
from workers.sim.instant_engine import InstantEngine, next_token

# down_after_s leaves room for event-loop stalls on a loaded 2-core CI machine; detection tests wait for it.
FAST_HEALTH = {"heartbeat_interval_s": 0.1, "down_after_s": 2.0}
MODES = ("process", "embedded")
TRANSPORTS = ("call", "stream")


def run(coro, timeout: float = 30.0):
    """Run one test coroutine with a hard timeout (no pytest-asyncio here)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


def request(rid: str, prompt_len: int = 40, max_tokens: int = 8, **kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid,
        prompt_token_ids=[(i * 37 + len(rid)) % 5000 for i in range(prompt_len)],
        sampling=pb.SamplingParams(max_tokens=max_tokens),
        **kwargs,
    )


async def collect(stream) -> tuple[list[int], list[pb.GenerateChunk]]:
    chunks = [c async for c in stream]
    return [t for c in chunks for t in c.token_ids], chunks


def expected_tokens(req: pb.GenerateRequest) -> list[int]:
    """The tokens an InstantEngine worker generates for req."""
    context = list(req.prompt_token_ids)
    for _ in range(req.sampling.max_tokens):
        context.append(next_token(context))
    return context[len(req.prompt_token_ids):]


async def wait_until(predicate, timeout: float = 5.0, interval: float = 0.02) -> None:
    """Polls predicate every `interval` seconds until it holds; fails the test after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(interval)


@dataclass
class Cluster:
    config: dict = field(default_factory=dict)
    roles: tuple[str, ...] = ("aggregated", "aggregated")
    step_delay_s: float = 0.0
    token: str | None = None
    mode: str = "process"
    transport: str | None = None  # RouterConfig.worker_transport
    also_register_at: str | None = None  # another router's address the workers register with too
    router: RouterServer | None = None
    workers: list[WorkerServer] = field(default_factory=list)
    engines: list[InstantEngine] = field(default_factory=list)
    client: RouterClient | EmbeddedRouter | None = None

    async def __aenter__(self) -> Cluster:
        transport = {} if self.transport is None else {"worker_transport": self.transport}
        config = parse_router_config({"health": FAST_HEALTH, "policy": {"seed": 0}, "token": self.token} | transport
                                     | self.config)
        embedded = EmbeddedRouter(config) if self.mode == "embedded" else None
        self.router = RouterServer(config) if embedded is None else embedded.server
        await self.router.start()
        for i, role in enumerate(self.roles):
            await self.add_worker(f"w{i}", role)
        self.client = embedded or RouterClient(self.router.address, token=self.token)
        await self.client.wait_for_workers(len(self.roles), timeout=10)
        return self

    async def add_worker(
        self, worker_id: str, role: str = "aggregated", engine: InstantEngine | None = None, **worker_kwargs
    ) -> WorkerServer:
        """worker_kwargs: more WorkerSettings (max_model_len, kv_block_size, ...)."""
        engine = engine or InstantEngine(step_delay_s=self.step_delay_s)
        routers = ",".join(a for a in (self.router.address, self.also_register_at) if a)
        worker = WorkerServer(engine, WorkerSettings(worker_id, role, routers, token=self.token,
                                                     heartbeat_interval_s=0.1, **worker_kwargs))
        await worker.start()
        self.workers.append(worker)
        self.engines.append(engine)
        return worker

    async def __aexit__(self, *exc) -> None:
        if isinstance(self.client, RouterClient):
            await self.client.close()
        for worker in self.workers:
            await worker.stop(0)
        await self.router.stop(0)  # the embedded client's router too
