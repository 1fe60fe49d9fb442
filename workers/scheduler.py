"""Scheduler: decides which sequences compute how many tokens each step (continuous batching).

A per-step token budget mixes decodes and prefill chunks (vLLM v1 style); when KV blocks run out the
youngest running sequence is preempted and later recomputed. Never touches a tensor.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

from contract.types import FinishReason
from workers.block_manager import BlockManager, block_hash, cdiv
from workers.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)

_ROOT_HASH = b"q3vl-prefix-root"


@dataclass
class ScheduledChunk:
    """seq computes tokens [start, start + num_tokens) this step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last known token, so a new token is sampled after it."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Sequences whose imported KV cache must be written into their blocks before this step's forward.
    kv_imports: list[Sequence] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Sequences finished with an error while scheduling (e.g. too long for the whole KV pool).
    rejected: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


class Scheduler:
    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager, eos_token_ids: frozenset[int]):
        self.limits = limits
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # prefill_only sequences that finished but keep their KV blocks until released.
        self.held: dict[str, Sequence] = {}
        self.num_preemptions = 0  # since start: each one recomputes a sequence's KV

    # ---- admission and removal ----------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.waiting, *self.running):
            if seq.request_id == request_id:
                return seq
        return self.held.get(request_id)

    def abort(self, request_id: str) -> Sequence | None:
        """Removes the request wherever it is and frees its blocks; returns it (None if unknown)."""
        seq = self.find(request_id)
        if seq is None:
            return None
        if seq.request_id in self.held:
            self.release(request_id)
        elif not seq.is_finished:
            self.finish(seq, FinishReason.ABORT)
        return seq

    def release(self, request_id: str) -> bool:
        """Frees the KV blocks a finished prefill_only request was holding."""
        seq = self.held.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq)
        return True

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        if seq.prefill_only and reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.held[seq.request_id] = seq
        else:
            self.block_manager.free(seq)

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.limits.max_num_batched_tokens
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            target = seq.num_computed_tokens + n
            while not bm.can_allocate(seq, target) and self.running[-1] is not seq:
                out.preempted.append(self._preempt(self.running[-1]))
            if not bm.can_allocate(seq, target):
                out.preempted.append(self._preempt(seq))
                continue
            bm.allocate(seq, target)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
            i += 1

        # Admit waiting requests only when nothing had to be preempted (vLLM v1 policy).
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting[0]
            if cdiv(seq.num_tokens, bm.block_size) > bm.num_blocks:
                self.finish(seq, FinishReason.ERROR, f"context of {seq.num_tokens} tokens needs more KV blocks "
                            f"than the pool holds ({bm.num_blocks} x {bm.block_size} tokens)")
                out.rejected.append(seq)
                continue
            if seq.kv_import is not None:
                seq.num_computed_tokens = seq.kv_import.num_tokens
            else:
                bm.share(seq, bm.match_prefix(self._prefix_hashes(seq)))
                seq.num_computed_tokens = len(seq.block_table) * bm.block_size
            n = min(seq.num_uncomputed_tokens, budget)
            if not bm.can_allocate(seq, seq.num_computed_tokens + n):
                bm.free(seq)
                seq.num_computed_tokens = 0
                break
            bm.allocate(seq, seq.num_computed_tokens + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.kv_import is not None:
                out.kv_imports.append(seq)
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n))
            budget -= n
        return out

    def next_prompts(self, out: SchedulerOutput) -> list[Sequence]:
        """The sequences likely to compute prompt tokens in the step after `out`, in scheduling order: running
        prefills not finished by `out`, then waiting requests, as far as the token budget goes once every
        running sequence has its next token (a guess: it assumes no preemption and no sequence finishing)."""
        budget = self.limits.max_num_batched_tokens
        in_step = {c.seq.request_id: c.num_tokens for c in out.chunks}
        picked = []
        for seq in self.running:
            left = seq.num_uncomputed_tokens - in_step.get(seq.request_id, 0)
            if left > 0 and budget > 0:
                picked.append(seq)
            budget -= max(left, 1)
        for seq in itertools.islice(self.waiting, max(0, self.limits.max_num_seqs - len(self.running))):
            if budget <= 0:
                break
            picked.append(seq)
            budget -= seq.num_uncomputed_tokens
        return picked

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """Applies a finished step: advances progress, appends sampled tokens, finishes sequences.
        Returns the sequences that got a token or finished."""
        changed = []
        for seq in out.kv_imports:
            seq.kv_import = None
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.is_finished:
                continue
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            self._register_prefix(seq)
            if not chunk.samples:
                continue
            token = sampled[seq.request_id]
            seq.append_token(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
            changed.append(seq)
        return changed

    def fail(self, out: SchedulerOutput, error: str) -> list[Sequence]:
        """Finishes every sequence of a step that could not be executed."""
        failed = [c.seq for c in out.chunks if not c.seq.is_finished]
        for seq in failed:
            self.finish(seq, FinishReason.ERROR, error)
        return failed

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        if token in self.eos_token_ids or token in seq.sampling.stop_token_ids:
            return FinishReason.STOP
        if seq.prefill_only or seq.num_generated_tokens >= seq.sampling.max_tokens:
            return FinishReason.LENGTH
        if seq.num_tokens >= self.limits.max_model_len:
            return FinishReason.LENGTH
        return None

    def _preempt(self, seq: Sequence) -> str:
        log.debug("preempting %s (%d tokens)", seq.request_id, seq.num_tokens)
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        return seq.request_id

    # ---- prefix caching ---------------------------------------------------------------------------

    def _prefix_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of the full blocks before the last token (which is always recomputed)."""
        if not self.block_manager.enable_prefix_caching:
            return []
        self._extend_hashes(seq, (seq.num_tokens - 1) // self.block_manager.block_size)
        return seq.block_hashes

    def _register_prefix(self, seq: Sequence) -> None:
        if not self.block_manager.enable_prefix_caching:
            return
        self._extend_hashes(seq, seq.num_computed_tokens // self.block_manager.block_size)
        self.block_manager.register(seq, seq.block_hashes)

    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        bs = self.block_manager.block_size
        while len(seq.block_hashes) < num_full_blocks:
            b = len(seq.block_hashes)
            lo, hi = b * bs, (b + 1) * bs
            extra = b"".join(
                digest + (max(lo, start) - start).to_bytes(8, "little")
                for start, length, digest in seq.image_spans
                if start < hi and start + length > lo
            )
            parent = seq.block_hashes[-1] if seq.block_hashes else _ROOT_HASH
            seq.block_hashes.append(block_hash(parent, seq.token_ids[lo:hi], extra))
