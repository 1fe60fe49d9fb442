"""Sequence: one request's state inside the engine (tokens, progress, KV block table, finish state).

Plain data shared by the scheduler and the model runner; the multimodal payload is opaque to the scheduler.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from contract.types import FinishReason, SamplingParams
from workers.core.block_table import BlockTable
from workers.core.encoder_cache import ImageSpan

# A token sampled by a step still running on the device, held in token_ids until the step's tokens are read back
# (EngineConfig.overlap_decode_steps: the next step is scheduled meanwhile, and reads it there on the device).
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """A request being served.

    token_ids holds the prompt, then any context tokens given with the request (resume tokens, or the
    first token of an imported KV cache), then the tokens this engine generates. Only the generated ones
    count against sampling.max_tokens and are streamed. Within an engine step the last one may be PENDING_TOKEN
    (Scheduler.apply to Scheduler.resolve); between steps never.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival: int
    prefill_only: bool = False
    # Positions of the prompt (3 x num_prompt_tokens, MRoPE) and images; opaque to the scheduler.
    mm: Any = None
    mrope_position_delta: int = 0
    # A KvExport to copy into this sequence's blocks before its first step; dropped once imported.
    kv_import: Any = None
    # (first prompt index, token count, content digest) per image: keys image content into prefix hashes.
    image_spans: list[tuple[int, int, bytes]] = field(default_factory=list)
    # A workers.grammar.GrammarState when sampling.json_schema is set: the sampler masks and advances it.
    grammar: Any = None
    # Per image its visual-token grid and digest (workers.kv_cache.ImageLayout): what a KV export hands on.
    image_layout: tuple = ()
    # False for a KV import whose prompt came without its images: preempted, it cannot be computed again here and
    # finishes PREEMPTED instead (its caller serves it elsewhere).
    recomputable: bool = True
    # When the caller's latency bound runs out, on the engine's clock (Scheduler.clock); None: no bound (Offline).
    deadline: float | None = None
    # The scheduler's first decision on a large image's pass (one that costs more than a step's encoder budget): its
    # estimate of the request's own tower and prompt work, its slack, in seconds, and whether it was past saving.
    tower_decision: dict | None = None

    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: BlockTable = field(default_factory=BlockTable)
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_streamed_tokens: int = 0  # generated tokens already handed out in a RequestOutput
    stream_interval: int = 0  # RequestOptions.stream_interval: when the engine hands out its tokens
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks (prefix caching)

    def __post_init__(self) -> None:
        if not isinstance(self.block_table, BlockTable):
            self.block_table = BlockTable(self.block_table)
        self.num_context_tokens = len(self.token_ids)
        # The prompt's images as the scheduler budgets them (from image_spans).
        self.images = [ImageSpan(i, start, n) for i, (start, n, _) in enumerate(self.image_spans)]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_context_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def take_new_tokens(self) -> list[int]:
        """Generated tokens not yet handed out; marks them handed out."""
        start = self.num_context_tokens + self.num_streamed_tokens
        new = self.token_ids[start:]
        self.num_streamed_tokens += len(new)
        return new
