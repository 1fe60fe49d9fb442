"""Worker selection as pure functions of (request, worker snapshots): round robin, least loaded, KV aware.

No network and no clocks here; the router builds the snapshots (router.registry) and books the load.

kv_aware is Dynamo's cost (reference/router.md §1.4), in KV blocks of `block_size` tokens:

    prefill_blocks = (active_prefill_tokens + prompt_tokens) / block_size
    cost = prefill_load_scale * max(prefill_blocks - overlap_credit * cached_blocks, 0) + active_decode_blocks

where cached_blocks is how many leading blocks of the prompt the worker reports holding (chained block
hashes, `block_hashes`). The blocks of the request itself would add the same amount to every worker's
decode term, so they are left out: the choice is unchanged, with or without temperature.

Worked example (Dynamo's): a prompt of 8 blocks, overlap_credit 1, prefill_load_scale 1, no active prefill:

    worker   cached  prefill blocks  decode blocks  cost
    A        0       8               10             18
    B        3       5               5              10   <- chosen
    C        6       2               9              11

C holds the most of the prompt, but B's lighter decode load makes it cheaper. With temperature T > 0 the
pick is sampled with p_i ~ exp(-(c_i - c_min) / ((c_max - c_min) * T)) instead (uniform if all are equal).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.config import PolicyConfig


@dataclass(frozen=True)
class WorkerSnapshot:
    """What the router knows about one eligible worker at the moment of the pick."""

    worker_id: str
    active_prefill_tokens: int = 0  # prompt tokens dispatched to it and not yet prefilled
    active_decode_blocks: int = 0   # KV blocks its running requests hold (or will hold)
    inflight: int = 0               # requests it is serving for this router
    cached_block_hashes: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True)
class RouteRequest:
    """The request as the policies see it: its prefill size and (kv_aware) its prompt's block hashes."""

    prompt_tokens: int
    block_hashes: tuple[int, ...] = ()


def block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Chained 64-bit hashes of the prompt's full blocks: block i's hash covers blocks 0..i.

    Workers that report cached blocks (LoadReport.cached_block_hashes) must hash the same way.
    """
    out: list[int] = []
    previous = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids[start : start + block_size])
        previous = hashlib.blake2b(previous + block, digest_size=8).digest()
        out.append(int.from_bytes(previous, "little"))
    return tuple(out)


def cached_prefix_blocks(request_hashes: Sequence[int], cached: frozenset[int]) -> int:
    """How many leading blocks of the prompt the worker holds (chained hashes: a hit implies its prefix)."""
    count = 0
    for h in request_hashes:
        if h not in cached:
            break
        count += 1
    return count


def kv_aware_cost(request: RouteRequest, worker: WorkerSnapshot, config: PolicyConfig) -> float:
    prefill_blocks = (worker.active_prefill_tokens + request.prompt_tokens) / config.block_size
    cached = cached_prefix_blocks(request.block_hashes, worker.cached_block_hashes) if config.overlap_credit else 0
    adjusted = max(prefill_blocks - config.overlap_credit * cached, 0.0)
    return config.prefill_load_scale * adjusted + worker.active_decode_blocks


def predicted_load(request: RouteRequest, worker: WorkerSnapshot, config: PolicyConfig) -> float:
    """The token load the worker would carry with this request: kv_aware's cost with no cache credit."""
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
    return b if predicted_load(request, b, config) < predicted_load(request, a, config) else a


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
