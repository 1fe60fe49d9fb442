"""Scheduler: decides which sequences compute how many tokens each step (continuous batching), and which images go
through the vision tower when.

A per-step token budget mixes decodes and prefill chunks (vLLM v1 style): decodes first, then prefill chunks in
arrival order (first come, first served), capped by an optional prefill-token limit per step. Image encoding has a
budget of its own (prompt rows of images encoded per step) and a cache of encoded images (workers/encoder_cache.py):
a chunk that reaches an image not encoded yet encodes it in its step, or stops before it when the budget or the
cache has no room. What budget is left encodes the images of the next step's likely prompts ahead, behind this
step's sampling. When KV blocks run out the youngest running sequence is preempted and later recomputed. Never
touches a tensor: SchedulerOutput lists what the model runner does.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workers.block_manager import BlockManager, block_hash, cdiv
from workers.encoder_cache import EncoderCache, ImageKey, ImageSpan
from workers.sequence import Sequence, SequenceStatus
from workers.types import FinishReason

if TYPE_CHECKING:
    from workers.config import EngineConfig

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


@dataclass(frozen=True)
class ImageEncode:
    """One image of seq through the vision tower."""

    seq: Sequence
    image: ImageSpan

    @property
    def key(self) -> ImageKey:
        return (self.seq.request_id, self.image.index)


@dataclass
class SchedulerOutput:
    """One step for the model runner, in the order it carries it out: drop `encoder_drop`, import `kv_imports`,
    encode `encode_now`, run `chunks` (their visual rows read the encoder cache), drop `encoder_free`, sample, then
    encode `encode_ahead` (for later steps)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Sequences whose imported KV cache must be written into their blocks before this step's forward.
    kv_imports: list[Sequence] = field(default_factory=list)
    encode_now: list[ImageEncode] = field(default_factory=list)
    encode_ahead: list[ImageEncode] = field(default_factory=list)
    # Encoder outputs no longer needed: before the step (of preempted sequences, or evicted for room) and after
    # its visual rows are built (images whose last rows this step computes).
    encoder_drop: list[ImageKey] = field(default_factory=list)
    encoder_free: list[ImageKey] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Sequences finished with an error while scheduling (e.g. too long for the whole KV pool).
    rejected: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_encoder_tokens(self) -> int:
        """Prompt rows of the images this step encodes (now and ahead)."""
        return sum(e.image.num_tokens for e in (*self.encode_now, *self.encode_ahead))

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class SchedulerLimits:
    """max_num_prefill_tokens: prompt tokens per step (None: the whole token budget), so that steps carrying
    decodes stay short. max_num_encoder_tokens: image rows encoded per step, now and ahead (None: the token budget);
    an image larger than it is encoded alone. encoder_cache_tokens: rows of encoded images held at once (None:
    twice the encoder budget). encode_ahead: spend the step's unused encoder budget on the next step's prompts."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_num_prefill_tokens: int | None = None
    max_num_encoder_tokens: int | None = None
    encoder_cache_tokens: int | None = None
    encode_ahead: bool = True

    @classmethod
    def of(cls, config: EngineConfig) -> SchedulerLimits:
        """The limits an engine's settings give (the real and the simulated engine schedule alike)."""
        return cls(config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
                   config.max_num_prefill_tokens, config.max_num_encoder_tokens, config.encoder_cache_tokens,
                   config.encode_ahead)

    @property
    def prefill_tokens(self) -> int:
        return min(self.max_num_prefill_tokens or self.max_num_batched_tokens, self.max_num_batched_tokens)

    @property
    def encoder_tokens(self) -> int:
        return self.max_num_encoder_tokens or self.max_num_batched_tokens

    @property
    def cache_tokens(self) -> int:
        return self.encoder_cache_tokens or 2 * self.encoder_tokens


class _EncoderBudget:
    """The image rows one step may still encode; the first image of a step is taken whatever its size."""

    def __init__(self, tokens: int):
        self.left = tokens
        self.used = False

    def fits(self, num_tokens: int) -> bool:
        return not self.used or num_tokens <= self.left

    def take(self, num_tokens: int) -> None:
        self.left -= num_tokens
        self.used = True


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
        self.encoder_cache = EncoderCache(limits.cache_tokens)

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
        self.encoder_cache.free_request(seq.request_id)  # the runner drops its outputs on release
        if seq.prefill_only and reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.held[seq.request_id] = seq
        else:
            self.block_manager.free(seq)

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        limits, bm = self.limits, self.block_manager
        budget, prefill_left = limits.max_num_batched_tokens, limits.prefill_tokens
        encoder = _EncoderBudget(limits.encoder_tokens)
        scheduled: set[str] = set()

        # Decodes first (a step's decodes are cheap and each waits for the whole step), then the prefill chunks of
        # running sequences oldest first, so that a request admitted earlier is not starved behind newer prompts.
        for seq in sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.arrival)):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted above for an older sequence's blocks
                continue
            prefill = seq.num_uncomputed_tokens > 1
            start = seq.num_computed_tokens
            need, n = self._plan_images(seq, start, self._chunk_tokens(seq, budget, prefill_left), encoder)
            if n == 0:
                continue
            while not bm.can_allocate(seq, start + n):
                victim = next((s for s in reversed(self.running) if s is not seq and s.request_id not in scheduled), None)
                if victim is None:
                    break
                out.preempted.append(self._preempt(victim, out))
            if not bm.can_allocate(seq, start + n):
                out.preempted.append(self._preempt(seq, out))
                continue
            bm.allocate(seq, start + n)
            self._commit(ScheduledChunk(seq, start, n), need, encoder, out)
            scheduled.add(seq.request_id)
            budget -= n
            prefill_left -= n if prefill else 0

        # Admit waiting requests, first come first served, only when nothing had to be preempted (vLLM v1 policy).
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < limits.max_num_seqs:
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
            prefill = seq.num_uncomputed_tokens > 1
            start = seq.num_computed_tokens
            need, n = self._plan_images(seq, start, self._chunk_tokens(seq, budget, prefill_left), encoder)
            if n == 0 or not bm.can_allocate(seq, start + n):
                bm.free(seq)
                seq.num_computed_tokens = 0
                break
            bm.allocate(seq, start + n)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.kv_import is not None:
                out.kv_imports.append(seq)
            self._commit(ScheduledChunk(seq, start, n), need, encoder, out)
            budget -= n
            prefill_left -= n if prefill else 0

        for key in out.encoder_free:  # read by this step for the last time
            self.encoder_cache.free(key)
        if limits.encode_ahead and out.chunks:  # a step that runs nothing encodes nothing
            self._encode_ahead(out, encoder)
        return out

    @staticmethod
    def _chunk_tokens(seq: Sequence, budget: int, prefill_left: int) -> int:
        if seq.num_uncomputed_tokens == 1:  # a decode (or a prompt's last token): outside the prefill cap
            return min(1, budget)
        return max(min(seq.num_uncomputed_tokens, budget, prefill_left), 0)

    # ---- image encoding ---------------------------------------------------------------------------

    def _plan_images(self, seq: Sequence, start: int, n: int, encoder: _EncoderBudget) -> tuple[list[ImageSpan], int]:
        """The images the chunk [start, start + n) of seq must have encoded in this step, and the chunk's length:
        n, or cut before the first image for which the step's encoder budget or the cache (after evicting what
        other sequences have not started on) has no room."""
        cache, rid = self.encoder_cache, seq.request_id
        evictable = [k for k in cache.evictable() if k[0] != rid]
        room = cache.capacity_tokens - cache.used_tokens + sum(cache.size(k) for k in evictable)
        empty_after_evicting = len(cache) == len(evictable)
        need: list[ImageSpan] = []
        tokens = 0
        for image in seq.images:
            if image.end <= start or image.start >= start + n or (rid, image.index) in cache:
                continue
            total = tokens + image.num_tokens
            alone = not need and not encoder.used  # the step's first image, whatever its size
            fits_budget = total <= encoder.left or alone
            fits_cache = total <= room or (not need and empty_after_evicting)
            if not (fits_budget and fits_cache):
                return need, max(image.start - start, 0)
            need.append(image)
            tokens = total
        return need, n

    def _commit(self, chunk: ScheduledChunk, need: list[ImageSpan], encoder: _EncoderBudget,
                out: SchedulerOutput) -> None:
        """Adds the chunk and its images (evicting for room as _plan_images allowed) to the step."""
        cache, seq = self.encoder_cache, chunk.seq
        tokens = sum(image.num_tokens for image in need)
        while need and not cache.fits(tokens):
            key = next((k for k in cache.evictable() if k[0] != seq.request_id), None)
            if key is None:
                break
            cache.free(key)
            out.encoder_drop.append(key)
        for image in need:
            cache.add((seq.request_id, image.index), image.num_tokens)
            out.encode_now.append(ImageEncode(seq, image))
        if need:
            encoder.take(tokens)
        end = chunk.start + chunk.num_tokens
        for image in seq.images:
            if image.end > chunk.start and image.start < end:
                key = (seq.request_id, image.index)
                cache.mark_started(key)
                if image.end <= end:
                    out.encoder_free.append(key)
        out.chunks.append(chunk)

    def _encode_ahead(self, out: SchedulerOutput, encoder: _EncoderBudget) -> None:
        """Spends what is left of the encoder budget on the images the next step's prompt chunks will probably
        reach, in the order that step would schedule them (a guess: it assumes no preemption and no sequence
        finishing), stopping at the first image without room so that what is encoded ahead is always the head
        of that order. Encoded behind this step's sampling, they are in the cache when their chunk comes."""
        limits, cache = self.limits, self.encoder_cache
        in_step = {c.seq.request_id: c.start + c.num_tokens for c in out.chunks}
        budget, prefill_left = limits.max_num_batched_tokens, limits.prefill_tokens
        guesses = []
        running = sorted(self.running, key=lambda s: (s.num_tokens - in_step.get(s.request_id, s.num_computed_tokens) > 1,
                                                      s.arrival))
        for seq in running:
            start = in_step.get(seq.request_id, seq.num_computed_tokens)
            left = seq.num_tokens - start
            if left <= 1:
                budget -= 1
                continue
            take = min(left, budget, prefill_left)
            if take > 0:
                guesses.append((seq, start, take))
                budget, prefill_left = budget - take, prefill_left - take
        for seq in list(self.waiting)[: max(0, limits.max_num_seqs - len(self.running))]:
            take = min(seq.num_uncomputed_tokens, budget, prefill_left)
            if take <= 0:
                break
            start = seq.kv_import.num_tokens if seq.kv_import is not None else 0
            guesses.append((seq, start, take))
            budget, prefill_left = budget - take, prefill_left - take
        for seq, start, take in guesses:
            for image in seq.images:
                key = (seq.request_id, image.index)
                if image.end <= start or image.start >= start + take or key in cache:
                    continue
                if not (encoder.fits(image.num_tokens) and cache.fits(image.num_tokens)):
                    return
                cache.add(key, image.num_tokens)
                encoder.take(image.num_tokens)
                out.encode_ahead.append(ImageEncode(seq, image))

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
        for encode in out.encode_ahead:  # never run
            self.encoder_cache.free(encode.key)
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

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> str:
        log.debug("preempting %s (%d tokens)", seq.request_id, seq.num_tokens)
        self.running.remove(seq)
        self.block_manager.free(seq)
        out.encoder_drop.extend(self.encoder_cache.free_request(seq.request_id))
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
