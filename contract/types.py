"""Plain data that crosses the engine's boundary: what a request is, what a step returns.

No torch here: the router and the harness import these types without loading the model stack.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    STOP = "stop"      # an EOS token was generated
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"    # cancelled by the caller
    ERROR = "error"    # the request could not be served (see RequestOutput.error)
    # its KV was dropped (preempted) and this engine cannot rebuild it: a decode worker holds no images of an imported
    # prompt; the request is served again elsewhere with its inputs (the worker ends the call with ABORTED)
    PREEMPTED = "preempted"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; top_k 0 disables top-k. stop_token_ids end generation like
    EOS does; json_schema (JSON text) constrains the output to that schema (workers/grammar.py)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 150
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    json_schema: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class PromptInput:
    """A tokenized prompt: every <|image_pad|> run already expanded to its image's token count,
    and the encoded image bytes (as stored, never re-encoded) in order of appearance."""

    token_ids: list[int]
    images: list[bytes] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0  # total so far, including new_token_ids


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of the engine's load, reported to the router."""

    waiting_requests: int
    running_requests: int
    queued_prompt_tokens: int
    free_kv_blocks: int
    total_kv_blocks: int
    steps: int
