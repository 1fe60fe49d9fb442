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
    latency_bound_s: the caller's bound from its hand-over (0: none), which the scheduler weighs (Sequence.deadline)."""

    resume_token_ids: Seq[int] = ()
    prefill_only: bool = False
    kv_import: KvExport | None = None
    latency_bound_s: float = 0.0


NO_OPTIONS = RequestOptions()  # a plain request
