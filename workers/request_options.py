"""RequestOptions: what a request asks of an engine beyond its prompt and sampling. One value along the request path:
WorkerServer -> ServingEngine.generate -> EngineCore.prepare_request / add_request -> RequestInputs.make_sequence."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.kv_cache import KvExport


@dataclass(frozen=True)
class RequestOptions:
    """resume_token_ids: tokens generated elsewhere (a replayed request's); they extend the context and are not
    streamed. prefill_only: compute the context, sample one token, finish (LENGTH, or STOP on EOS) and keep the KV
    blocks until export_kv() + release(). kv_import: another engine's export for this same prompt (+ resume tokens);
    its KV is copied in and decoding continues after its first token, which is context here (not streamed again).
    latency_bound_s: the caller's bound from its hand-over (0: none), which the scheduler weighs (Sequence.deadline).
    stream_interval: how often the engine hands out the request's tokens: 0, every step that gave it any (or the
    engine's own interval, if it was built with one); n >= 1, at its first token, at its end and whenever n are
    pending (ONLY_AT_END: at its first token and its end). A caller that sends chunks of n tokens anyway (the
    worker server's GenerateRequest.stream_interval) spares the engine's thread an output a token: with 256
    requests streaming through one asyncio loop, the engine's host time a decode step was 1.7-2.9 ms with an output
    a token and 1.0-1.1 ms with one every 16 (benchmarks/README.md, forty-third pass)."""

    resume_token_ids: Seq[int] = ()
    prefill_only: bool = False
    kv_import: KvExport | None = None
    latency_bound_s: float = 0.0
    stream_interval: int = 0


NO_OPTIONS = RequestOptions()  # a plain request
ONLY_AT_END = 2**62  # RequestOptions.stream_interval for a caller that reads the tokens only at the request's end
