"""Worker selection as pure functions of (request, worker snapshots): round robin, least loaded, KV aware.

No network and no clocks here; the router builds the snapshots (router.registry) and books the load.

kv_aware is Dynamo's KV-load cost (https://github.com/ai-dynamo/dynamo, docs/router: the KV router's cost) without
its prefix-overlap credit, in KV blocks of `block_size` tokens:

    prefill_blocks = (active_prefill_tokens + prompt_tokens) / block_size
    cost = prefill_load_scale * prefill_blocks + active_decode_blocks

The lowest cost wins (random among ties); with temperature T > 0 the pick is sampled with
p_i ~ exp(-(c_i - c_min) / ((c_max - c_min) * T)) instead (uniform if all are equal). The blocks of the request
itself would add the same amount to every worker's decode term, so they are left out.

Dynamo also credits the prompt blocks a worker already caches. That term is not here: MLPerf forbids cross-query
prefix caching (the engine's is off by default), so no worker of a submission has blocks to credit, and crediting
them for the OpenAI endpoint's other clients would need the workers to publish their block hashes and the router
to hash images as the block manager does (README, Router).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from router.config import PolicyConfig


@dataclass(frozen=True)
class WorkerSnapshot:
    """What the router knows about one eligible worker at the moment of the pick."""

    worker_id: str
    active_prefill_tokens: int = 0  # prompt tokens dispatched to it and not yet prefilled
    active_decode_blocks: int = 0   # KV blocks its running requests hold (or will hold)
    inflight: int = 0               # requests it is serving for this router


@dataclass(frozen=True)
class RouteRequest:
    """The request as the policies see it: its prefill size."""

    prompt_tokens: int


def kv_aware_cost(request: RouteRequest, worker: WorkerSnapshot, config: PolicyConfig) -> float:
    """The token load the worker would carry with this request, in KV blocks."""
    prefill_blocks = (worker.active_prefill_tokens + request.prompt_tokens) / config.block_size
    return config.prefill_load_scale * prefill_blocks + worker.active_decode_blocks


def round_robin(workers: Sequence[WorkerSnapshot], turn: int) -> WorkerSnapshot:
    """The `turn`-th worker, cycling (the caller keeps the counter)."""
    return workers[turn % len(workers)]


def least_loaded(
    request: RouteRequest, workers: Sequence[WorkerSnapshot], config: PolicyConfig, rng: random.Random
) -> WorkerSnapshot:
    """Power of two choices: sample two workers, keep the one with the lower predicted load."""
    if len(workers) == 1:
        return workers[0]
    a, b = rng.sample(list(workers), 2)
    return b if kv_aware_cost(request, b, config) < kv_aware_cost(request, a, config) else a


def kv_aware(
    request: RouteRequest, workers: Sequence[WorkerSnapshot], config: PolicyConfig, rng: random.Random
) -> WorkerSnapshot:
    """Lowest Dynamo cost (random among ties), or softmax sampling over costs when temperature > 0."""
    costs = [kv_aware_cost(request, w, config) for w in workers]
    low, high = min(costs), max(costs)
    if config.temperature > 0 and high > low:
        weights = [math.exp(-(c - low) / ((high - low) * config.temperature)) for c in costs]
        return rng.choices(list(workers), weights=weights, k=1)[0]
    return rng.choice([w for w, c in zip(workers, costs) if c == low])


class Selector:
    """Applies the configured policy; holds the only state a policy needs (round-robin turn, rng)."""

    def __init__(self, config: PolicyConfig, rng: random.Random | None = None):
        self.config = config
        self.rng = rng if rng is not None else random.Random(config.seed)
        self._turn = 0

    def choose(self, request: RouteRequest, workers: Sequence[WorkerSnapshot]) -> WorkerSnapshot:
        if not workers:
            raise ValueError("no eligible worker to choose from")
        name = self.config.name
        if name == "round_robin":
            self._turn += 1
            return round_robin(workers, self._turn - 1)
        if name == "least_loaded":
            return least_loaded(request, workers, self.config, self.rng)
        return kv_aware(request, workers, self.config, self.rng)
