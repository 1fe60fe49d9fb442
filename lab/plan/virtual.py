"""Virtual-clock simulation of a few simulated engines (workers.sim.engine.simulated) behind a routing policy:
Poisson arrivals in, per-request latencies out, no sleeping. The planner and the model's validation use it; the
real-time path does not."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Literal

from contract.stats import percentile
from contract.tokenizer import IMAGE_PAD_ID
from contract.types import PromptInput, SamplingParams
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.request_options import RequestOptions
from workers.sim.config import SimulationConfig
from workers.sim.engine import SimulatedExecutor, simulated
from workers.sim.step_model import StepModel

Policy = Literal["round_robin", "least_loaded"]


@dataclass(frozen=True)
class Workload:
    """The requests' prompts: one shape (the bench_engine catalogue workload by default: 1,024-token image + 700 text
    tokens), or `prompts`, a mix the arrivals take in turn (a catalogue's size distribution, large images included)."""

    prompt_tokens: int = 1734
    image_tokens: int = 1024
    max_tokens: int = 150
    prompts: tuple[PromptInput, ...] = ()
    # Host preparation before a request reaches an engine (image decode and patching), per visual token: a request
    # joins its engine this much after it arrives, and its latency counts from the arrival.
    prepare_s_per_visual_token: float = 0.0

    def prompt(self) -> PromptInput:
        """The one shape's prompt."""
        text = self.prompt_tokens - self.image_tokens
        head = [1000] * (text // 2)
        return PromptInput(head + [IMAGE_PAD_ID] * self.image_tokens + [1001] * (text - len(head)))

    def prompt_for(self, request: int) -> PromptInput:
        """Request number `request`'s prompt."""
        return self.prompts[request % len(self.prompts)] if self.prompts else self.prompt()

    def prepare_s(self, prompt: PromptInput) -> float:
        """Seconds between a request's arrival and its joining an engine."""
        if not self.prepare_s_per_visual_token:
            return 0.0
        return self.prepare_s_per_visual_token * prompt.token_ids.count(IMAGE_PAD_ID)


@dataclass
class Result:
    latencies_s: list[float] = field(default_factory=list)
    issued_s: list[float] = field(default_factory=list)  # each finished request's arrival, in latencies_s order
    first_token_s: list[float] = field(default_factory=list)
    makespan_s: float = 0.0
    busy_s: float = 0.0

    def percentile(self, q: float, values: list[float] | None = None) -> float:
        return percentile(self.latencies_s if values is None else values, q, empty=float("inf"))

    @property
    def throughput(self) -> float:
        return len(self.latencies_s) / self.makespan_s if self.makespan_s else 0.0


class _Engine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.executor: SimulatedExecutor = engine.executor  # its steps' lengths are the virtual clock's
        self.clock = 0.0
        engine.scheduler.clock = lambda: self.clock  # deadlines and slack on the virtual clock


def remaining_bound(deadline: float, now: float) -> float:
    """The latency bound a request handed to an engine now carries to meet `deadline` (at least a microsecond, so
    that a request already past its deadline still carries one: RequestOptions' 0 means none)."""
    return max(deadline - now, 1e-6)


class VirtualCluster:
    """`aggregated` engines, or `prefill` + `decode` pools (KV handed over after the prefill's first token)."""

    def __init__(self, engine_config: EngineConfig, sim: SimulationConfig, models: dict[str, StepModel],
                 counts: dict[str, int], policy: Policy = "least_loaded"):
        self.pools = {role: [_Engine(simulated(engine_config, sim, models[role], realtime=False)) for _ in range(n)]
                      for role, n in counts.items() if n}
        self.policy = policy
        self._rr = {role: itertools.count() for role in self.pools}
        self.disaggregated = "prefill" in self.pools
        self.latency_bound_s = 0.0

    def _pick(self, role: str) -> _Engine:
        engines = self.pools[role]
        if self.policy == "round_robin":
            return engines[next(self._rr[role]) % len(engines)]
        block = engines[0].engine.config.block_size

        def cost(e: _Engine) -> float:
            load = e.engine.load()
            return load.queued_prompt_tokens / block + (load.total_kv_blocks - load.free_kv_blocks)
        return min(engines, key=cost)

    def run(self, arrivals: list[float], workload: Workload, latency_bound_s: float = 0.0) -> Result:
        """The arrivals served; latency_bound_s: each request's bound from its arrival (the scenario's, which the
        engines' schedulers weigh as the real ones do; 0: none)."""
        self.latency_bound_s = latency_bound_s
        prompts = {f"r{i}": workload.prompt_for(i) for i in range(len(arrivals))}
        sampling = SamplingParams(max_tokens=workload.max_tokens)
        events: list[tuple[float, int, str, str]] = [(t + workload.prepare_s(prompts[f"r{i}"]), i, "arrive", f"r{i}")
                                                     for i, t in enumerate(arrivals)]
        heapq.heapify(events)
        issued = {f"r{i}": t for i, t in enumerate(arrivals)}
        result = Result()
        owners: dict[str, _Engine] = {}
        seq_no = itertools.count(len(arrivals))
        first_role = "prefill" if self.disaggregated else "aggregated"
        while events:
            self._drain_events(events, result, issued, seq_no, owners, prompts, sampling, first_role)
            self._advance(float("inf"), result, issued, events, seq_no, owners)
        engines = [e for pool in self.pools.values() for e in pool]
        result.makespan_s = max(e.clock for e in engines) - (arrivals[0] if arrivals else 0.0)
        result.busy_s = sum(e.executor.busy_s for e in engines)
        return result

    def _drain_events(self, events, result, issued, seq_no, owners, prompts, sampling, first_role) -> None:
        while events:
            t, _, kind, rid = heapq.heappop(events)
            self._advance(t, result, issued, events, seq_no, owners)
            if kind == "arrive":
                target = self._pick(first_role)
                target.clock = max(target.clock, t)
                target.engine.add_request(rid, prompts[rid], sampling, RequestOptions(
                    prefill_only=self.disaggregated, latency_bound_s=self._bound_left(t, issued[rid])))
                owners[rid] = target
            else:  # a prefilled request's KV reaches a decode worker
                source = owners[rid]
                kv = source.engine.export_kv(rid)
                source.engine.release(rid)
                target = self._pick("decode")
                target.clock = max(target.clock, t)
                target.engine.add_request(rid, prompts[rid], sampling, RequestOptions(
                    kv_import=kv, latency_bound_s=self._bound_left(t, issued[rid])))
                owners[rid] = target

    def _bound_left(self, now: float, issued: float) -> float:
        """What is left of the run's latency bound for a request issued at `issued` and handed over now; 0 without
        a bound."""
        return remaining_bound(issued + self.latency_bound_s, now) if self.latency_bound_s else 0.0

    def _advance(self, until: float, result: Result, issued: dict[str, float], events, seq_no, owners) -> None:
        """Steps every engine whose clock is behind `until` (a new event may follow from a finished prefill)."""
        for role, engines in self.pools.items():
            for e in engines:
                while e.engine.has_unfinished() and e.clock < until:
                    outputs = e.engine.step()
                    if e.executor.last_step_s == 0.0 and not outputs:
                        break  # nothing schedulable (waiting on KV blocks that only a release frees)
                    e.clock += e.executor.last_step_s
                    for out in outputs:
                        if role != "decode" and out.num_generated_tokens == 1 and out.new_token_ids:
                            result.first_token_s.append(e.clock - issued[out.request_id])
                        if not out.finished:
                            continue
                        if role == "prefill":
                            xfer = e.executor.kv_transfer_s(out.num_prompt_tokens)
                            heapq.heappush(events, (e.clock + xfer, next(seq_no), "kv", out.request_id))
                        else:
                            result.latencies_s.append(e.clock - issued[out.request_id])
                            result.issued_s.append(issued[out.request_id])
