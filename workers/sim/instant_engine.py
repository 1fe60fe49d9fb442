"""InstantEngine: an engine with no model that emits deterministic tokens, for measuring the router alone.

It speaks AsyncEngine's interface, so WorkerServer serves it like a real engine; the router benchmark and
the router tests use it on purpose. The next token is a function of the whole context (prompt, resumed
tokens, tokens so far), so a migrated or disaggregated request continues exactly where it left off, and
its exported "KV" is the prompt itself, so a decode worker really depends on the pulled cache.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import torch

from contract.types import EngineLoad, FinishReason, PromptInput, RequestOutput, SamplingParams
from workers.kv_cache import KvExport
from workers.request_options import NO_OPTIONS, RequestOptions

VOCAB = 150_000


def next_token(context: Sequence[int]) -> int:
    """Deterministic in the full context; never one of Qwen's special ids (>= 151643)."""
    return _next_token(sum(context), len(context))


def _next_token(context_sum: int, context_len: int) -> int:
    """next_token of a context with that sum and length (what generate keeps, instead of summing every step)."""
    return (context_sum * 7919 + context_len * 104_729) % VOCAB


class InstantEngine:
    def __init__(
        self,
        step_delay_s: float = 0.0,
        eos_token_id: int | None = None,
        total_kv_blocks: int = 65536,
        block_size: int = 16,
        kv_layers: int = 2,
        kv_heads: int = 2,
        head_dim: int = 4,
    ):
        self.step_delay_s = step_delay_s
        self.eos_token_id = eos_token_id
        self.total_kv_blocks = total_kv_blocks
        self.block_size = block_size
        self.kv_shape = (kv_layers, kv_heads, head_dim)
        self.generation_defaults = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_tokens=150)
        self.steps = 0
        self._frozen_load: EngineLoad | None = None  # set by stall(): a hung engine
        self.requests_seen: list[str] = []
        self.images_seen: dict[str, int] = {}  # request id -> how many images its request carried
        self.sampling_seen: dict[str, SamplingParams] = {}
        self.latency_bounds_seen: dict[str, float] = {}
        self.stream_intervals_seen: dict[str, int] = {}
        self.aborted: list[str] = []
        self._running: dict[str, int] = {}  # request id -> context length (for the load report)
        self._queued_prompt_tokens = 0
        self._abort: set[str] = set()
        self._held: dict[str, KvExport] = {}

    async def generate(self, request_id: str, prompt: PromptInput, sampling: SamplingParams,
                       options: RequestOptions = NO_OPTIONS) -> AsyncIterator[RequestOutput]:
        self.requests_seen.append(request_id)
        self.images_seen[request_id] = len(prompt.images)
        self.sampling_seen[request_id] = sampling
        self.latency_bounds_seen[request_id] = options.latency_bound_s
        self.stream_intervals_seen[request_id] = options.stream_interval
        kv_import, prefill_only = options.kv_import, options.prefill_only
        if kv_import is not None:  # the prompt comes from the pulled cache, not from the request
            context = [int(t) for t in kv_import.keys[0][:, 0, 0].tolist()] + [kv_import.first_token_id]
        else:
            context = list(prompt.token_ids)
        num_prompt = len(prompt.token_ids)
        context += list(options.resume_token_ids)
        context_sum, context_len = sum(context), len(context)
        max_new = 1 if prefill_only else sampling.max_tokens
        self._running[request_id] = context_len
        self._queued_prompt_tokens += num_prompt
        generated = 0
        prefilled = False
        try:
            while True:
                await asyncio.sleep(self.step_delay_s)
                while self._frozen_load is not None:
                    await asyncio.sleep(0.01)
                if not prefilled:
                    self._queued_prompt_tokens -= num_prompt
                    prefilled = True
                if request_id in self._abort:
                    self._abort.discard(request_id)
                    yield self._output(request_id, [], FinishReason.ABORT, num_prompt, generated)
                    return
                self.steps += 1
                token = _next_token(context_sum, context_len)
                context_sum, context_len = context_sum + token, context_len + 1
                generated += 1
                finish = None
                if token == self.eos_token_id or token in sampling.stop_token_ids:
                    finish = FinishReason.STOP
                elif generated >= max_new:
                    finish = FinishReason.LENGTH
                if finish is not None and prefill_only:
                    self._held[request_id] = self._export(prompt.token_ids, token)
                yield self._output(request_id, [token], finish, num_prompt, generated)
                if finish is not None:
                    return
        finally:
            if not prefilled:
                self._queued_prompt_tokens -= num_prompt
            self._running.pop(request_id, None)

    def _output(self, request_id, tokens, finish, num_prompt, generated) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            new_token_ids=tokens,
            finished=finish is not None,
            finish_reason=finish,
            num_prompt_tokens=num_prompt,
            num_generated_tokens=generated,
        )

    def _export(self, prompt_ids: Sequence[int], first_token: int) -> KvExport:
        layers, heads, dim = self.kv_shape
        keys = [torch.tensor(prompt_ids, dtype=torch.float32)[:, None, None].expand(-1, heads, dim).contiguous()
                for _ in range(layers)]
        values = [k.neg() for k in keys]
        return KvExport(num_tokens=len(prompt_ids), keys=keys, values=values, mrope_position_delta=0,
                        first_token_id=first_token)

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        if request_id in self._running:
            self._abort.add(request_id)
            return True
        return self._held.pop(request_id, None) is not None

    async def export_kv(self, request_id: str, on_device: bool = False) -> KvExport:
        return self._held[request_id]

    async def release(self, request_id: str) -> bool:
        return self._held.pop(request_id, None) is not None

    @property
    def held_kv(self) -> list[str]:
        return list(self._held)

    def stall(self) -> None:
        """Hang like a stuck engine: no more steps, and the load report stays frozen as it is now."""
        self._frozen_load = self.load()

    def load(self) -> EngineLoad:
        if self._frozen_load is not None:
            return self._frozen_load
        used = sum(-(-n // self.block_size) for n in self._running.values())
        return EngineLoad(
            waiting_requests=0,
            running_requests=len(self._running),
            queued_prompt_tokens=self._queued_prompt_tokens,
            free_kv_blocks=max(self.total_kv_blocks - used, 0),
            total_kv_blocks=self.total_kv_blocks,
            steps=self.steps,
        )

    def shutdown(self) -> None:
        self._abort.update(self._running)
