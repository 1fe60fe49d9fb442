"""Scheduler: decides which sequences compute how many tokens each step (continuous batching), and which images go
through the vision tower when.

A per-step token budget mixes decodes and prefill chunks (vLLM v1 style): decodes first, then prefill chunks in
arrival order (first come, first served), capped by an optional prefill-token limit per step. Image encoding has a
budget of its own (prompt rows of images encoded per step) and a cache of encoded images (workers/core/encoder_cache.py):
a chunk that reaches an image not encoded yet encodes it in its step, or stops before it when the budget or the
cache has no room. What budget is left encodes the images of the next step's likely prompts ahead, behind this
step's sampling. An image costing more than a step's budget is encoded over several steps while other requests
are there, unless each of them has a latency bound with the slack to wait for its whole pass (workers/core/slack.py),
and also while alone when its own request's slack is shorter than the pass (past saving: others arriving meanwhile
should not wait for all of it); an image's tower work that would hold another request past its bound waits while
its own request has the slack to spare (Scheduler._defers); a request past saving yields its tower blocks and its
prompt's chunks to requests that can still meet their bounds, and its prompt goes in small chunks (Scheduler._yields,
Scheduler._prompt_chunk); waiting requests with a bound are admitted by deadline.
When KV blocks run out the youngest running sequence is preempted and later recomputed. Never touches a tensor:
SchedulerOutput lists what the model runner does.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from contract.types import FinishReason
from contract.vision_geometry import FACTOR
from workers.core.block_manager import BlockManager, block_hash, cdiv
from workers.core.encoder_cache import EncoderCache, ImageKey, ImageSpan, VisionCost
from workers.core.slack import StepClock
from workers.core.sequence import PENDING_TOKEN, Sequence, SequenceStatus

if TYPE_CHECKING:
    from workers.config import EngineConfig

log = logging.getLogger(__name__)

_ROOT_HASH = b"q3vl-prefix-root"
# A pass whose request is past saving yields its blocks to requests that can still meet their bounds, until that
# request is this many seconds past its own deadline (then it goes on whatever the others' slack). Its lateness
# beyond the bound costs nothing more, and its blocks beside others' steps cost them theirs: the product path's
# Interactive replay (2,000 queries at 1.95 QPS, seeds 1-4) gave 49 queries over 1.5 s at 3 s, 46 at 6 s and the
# same at 1,000 s (its passes end in steps without others), 58 at 1 s; Server's (10 QPS) did not move.
YIELD_OVERDUE_S = 6.0
# A request whose image's tower work would hold others past their bounds waits for them while it keeps at least this
# many steps of slack (StepClock.decode_s each) beyond its own work.
DEFER_STEPS = 2.0
# A request is past saving when its slack is shorter than its own remaining work (tower and prompt) times this: the
# step clock's estimate of a large image's tower runs low (Interactive on one H100, 2,000 queries: a 4,000 px query,
# 2.0 s alone, twice ran whole as if it could meet 1.5 s, and held the queries beside it 1.6-1.7 s).
PAST_SAVING_MARGIN = 1.25
# Prompt tokens a step for a request that can no longer meet its bound. Its prompt's chunks otherwise take the whole
# prefill budget, and a request arriving meanwhile waits for the step (Interactive on one H100, run117-118: a
# 4,000 px query's 8,192-token chunks took 222 and 339 ms, and a small query that arrived during them ended at
# 1.498 s, 0.51 s of it in its own two prompt steps beside them).
PAST_SAVING_CHUNK_TOKENS = 2048


@dataclass
class ScheduledChunk:
    """seq computes tokens [start, start + num_tokens) this step. samples: the chunk reaches the sequence's last
    token as it was scheduled (a pending one included), so a new token is sampled after it."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class ImageEncode:
    """One image of seq through the vision tower: the whole tower (num_blocks 0), or blocks [first_block,
    first_block + num_blocks) of a pass spread over several steps (an image too large for one step's budget; with
    SchedulerLimits.passes_beside every block at once, beside the steps), whose output is usable once its last
    block has run."""

    seq: Sequence
    image: ImageSpan
    first_block: int = 0
    num_blocks: int = 0

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
    # The step before's encode_ahead: queued behind that step's sampling, so the device runs it before this step's
    # kernels, and its time is in this step's (the scheduler's StepClock, the simulated engine and the step trace's
    # work count it here). Nothing for the runner to do.
    encoded_before: list[ImageEncode] = field(default_factory=list)
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

    def encodes_in_step_time(self, passes_beside: bool) -> list[ImageEncode]:
        """The tower work within this step's time: the step before's encode_ahead and this step's encode_now, less
        the passes that run beside the steps (SchedulerLimits.passes_beside: every pass, listed with its blocks)."""
        return [e for e in (*self.encoded_before, *self.encode_now) if not (passes_beside and e.num_blocks)]

    @property
    def is_decode_only(self) -> bool:
        """Single-row chunks that each sample, and nothing else: no vision-tower work, no encoder state to drop."""
        return bool(self.chunks) and all(c.num_tokens == 1 and c.samples for c in self.chunks) and not (
            self.encode_now or self.encode_ahead or self.encoder_drop or self.encoder_free or self.kv_imports)

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner to do: no chunks, and no vision-tower work or encoder state to drop (a step may
        run only the next blocks of a large image's pass while every prompt waits for it)."""
        return not (self.chunks or self.encode_now or self.encode_ahead or self.encoder_drop or self.encoder_free)


@dataclass(frozen=True)
class SchedulerLimits:
    """max_num_prefill_tokens: prompt tokens per step (None: the whole token budget), so that steps carrying
    decodes stay short. max_num_encoder_tokens: the vision tower's work per step, now and ahead, in image rows as
    `vision` costs them (None: the token budget); an image costing more is encoded over several steps a few tower
    blocks at a time (with a one-block cost model, alone in its step). encoder_pass_share: the share of a step's
    encoder budget those passes may take beyond the oldest one's one block a step. encoder_cache_tokens: rows of
    encoded images held at once (None: twice the encoder budget and the largest image's rows, max_image_tokens, so
    that while a pass over the largest image holds its rows the other prompts' images still find room: with twice
    the budget alone, 16,384 rows, a 4,000 px image's 15,625 left no room for a 1,024-row image, and the prompts
    behind it stalled for its whole pass, Interactive on one H200, run101). encode_ahead: spend the step's unused
    encoder budget on the next step's prompts. passes_beside (engine.vision_green_sms on CUDA): an image costing more
    than a step's budget is listed whole, as every block of a pass, which the executor runs beside the steps (in no
    step's time); its rows are usable once the executor reports the pass done (Scheduler.passes_done)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_num_prefill_tokens: int | None = None
    max_num_encoder_tokens: int | None = None
    encoder_cache_tokens: int | None = None
    encode_ahead: bool = True
    vision: VisionCost = VisionCost()
    encoder_pass_share: float = 0.5
    max_image_tokens: int = 0
    passes_beside: bool = False

    @classmethod
    def of(cls, config: EngineConfig, vision: VisionCost = VisionCost()) -> SchedulerLimits:
        """The limits an engine's settings and its vision tower give (the real and the simulated engine schedule
        alike). A tower split over n ranks (vision_tensor_parallel) does a unit of work in about 1/n of the time, so
        its default budget is n times the token budget: a step's tower work takes as long as one rank's would."""
        shares = config.tensor_parallel_size if config.vision_tensor_parallel else 1
        encoder = config.max_num_encoder_tokens or (config.max_num_batched_tokens * shares if shares > 1 else None)
        return cls(config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
                   config.max_num_prefill_tokens, encoder, config.encoder_cache_tokens,
                   config.encode_ahead, vision, config.encoder_pass_share, config.max_pixels // FACTOR**2,
                   bool(config.vision_green_sms) and config.is_cuda)

    @property
    def prefill_tokens(self) -> int:
        return min(self.max_num_prefill_tokens or self.max_num_batched_tokens, self.max_num_batched_tokens)

    @property
    def encoder_tokens(self) -> int:
        return self.max_num_encoder_tokens or self.max_num_batched_tokens

    @property
    def cache_tokens(self) -> int:
        return self.encoder_cache_tokens or 2 * self.encoder_tokens + self.max_image_tokens


class _EncoderBudget:
    """The vision-tower work (VisionCost units) one step may still do."""

    def __init__(self, cost: int):
        self.total = cost
        self.left: float = cost
        self.used = False

    def fits(self, cost: float) -> bool:
        return cost <= self.left

    def take(self, cost: float) -> None:
        self.left -= cost
        self.used = True


def _past_images(seq: Sequence, start: int) -> bool:
    """Whether every image of seq's prompt lies before row `start` (a prompt's spans are in order)."""
    return not seq.images or seq.images[-1].end <= start


class Scheduler:
    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager, eos_token_ids: frozenset[int],
                 clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        # The engine's clock (Sequence.deadline is on it; a virtual one in the simulation), and what its steps take
        self.clock = clock
        self.step_clock = StepClock()
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # prefill_only sequences that finished but keep their KV blocks until released.
        self.held: dict[str, Sequence] = {}
        self.num_preemptions = 0  # since start: each one recomputes a sequence's KV
        self.encoder_cache = EncoderCache(limits.cache_tokens)
        # Passes spread over steps, oldest first: the next block of each.
        self._passes: dict[ImageKey, tuple[Sequence, ImageSpan, int]] = {}
        self._logged: set[ImageKey] = set()  # images whose first whole-or-spread decision was logged
        self._waits_logged: set[ImageKey] = set()  # images whose first wait for others (_defers) was logged
        self._drop_next: list[ImageKey] = []  # encoder state a failed step left behind, dropped in the next
        self._ahead_last: list[ImageEncode] = []  # the last step's encode_ahead (the next one's encoded_before)
        # Sequences apply() finished by length whose last token resolve() has still to put in place.
        self._ending: dict[str, Sequence] = {}
        self._bounded = 0  # waiting and running sequences with a deadline (none: no slack is ever asked for)

    # ---- admission and removal ----------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queues seq for admission: by deadline among the waiting requests that have one, ahead of those that have
        none (arrival order among equal bounds, as their deadlines follow their arrivals)."""
        seq.status = SequenceStatus.WAITING
        if seq.deadline is None:
            self.waiting.append(seq)
            return
        self._bounded += 1
        later = next((n for n, s in enumerate(self.waiting) if s.deadline is None or s.deadline > seq.deadline), None)
        if later is None:
            self.waiting.append(seq)
        else:
            self.waiting.insert(later, seq)

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
        if seq.status in (SequenceStatus.WAITING, SequenceStatus.RUNNING):
            (self.waiting if seq.status is SequenceStatus.WAITING else self.running).remove(seq)
            self._bounded -= seq.deadline is not None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        if reason in (FinishReason.STOP, FinishReason.LENGTH) and not seq.prefill_only:
            self.step_clock.observe_output(seq.num_generated_tokens)
        self._forget_images(seq.request_id)  # the runner drops its outputs on release
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
        out.encoder_drop, self._drop_next = self._drop_next, []
        out.encoded_before = self._ahead_last
        # what the decode steps will read, for the slack of requests with a bound (Offline has none: not summed)
        self.step_clock.load_context_tokens = (sum(s.num_tokens for s in (*self.running, *self.waiting))
                                               if self._bounded else 0)
        self._continue_passes(encoder, out)

        # Decodes first (a step's decodes are cheap and each waits for the whole step), then the prefill chunks of
        # running sequences oldest first, so that a request admitted earlier is not starved behind newer prompts.
        for seq in sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.arrival)):
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted above for an older sequence's blocks
                continue
            uncomputed = seq.num_uncomputed_tokens
            prefill = uncomputed > 1
            start = seq.num_computed_tokens
            past = _past_images(seq, start)
            if uncomputed == 1 and past:  # a decode: one row, no image, no bound to weigh
                need, n = [], 1
            else:
                need, split, n = self._plan_images(seq, start, self._prompt_chunk(seq, budget, prefill_left), encoder)
                self._start_passes(seq, split, encoder, out)
                if n == 0:
                    continue
            new_blocks = bm.blocks_needed(seq, start + n)
            while not (fits := new_blocks <= bm.num_free_blocks):
                victim = next((s for s in reversed(self.running) if s is not seq and s.request_id not in scheduled), None)
                if victim is None:
                    break
                out.preempted.append(self._preempt(victim, out))
            if not fits:
                out.preempted.append(self._preempt(seq, out))
                continue
            if new_blocks:
                bm.allocate(seq, start + n)
            if need or not past:
                self._commit(ScheduledChunk(seq, start, n), need, encoder, out)
            else:  # all _commit does for a chunk past its prompt's images
                out.chunks.append(ScheduledChunk(seq, start, n))
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
            chunk = self._chunk_tokens(seq, budget, prefill_left)
            if prefill and self._cannot_meet(seq, self.clock()):
                chunk = min(chunk, PAST_SAVING_CHUNK_TOKENS)  # admitted in its turn, in small chunks
            need, split, n = self._plan_images(seq, start, chunk, encoder)
            self._start_passes(seq, split, encoder, out)
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
        self._ahead_last = out.encode_ahead
        return out

    @staticmethod
    def _chunk_tokens(seq: Sequence, budget: int, prefill_left: int) -> int:
        if seq.num_uncomputed_tokens == 1:  # a decode (or a prompt's last token): outside the prefill cap
            return min(1, budget)
        return max(min(seq.num_uncomputed_tokens, budget, prefill_left), 0)

    def _prompt_chunk(self, seq: Sequence, budget: int, prefill_left: int) -> int:
        """Prompt tokens for running seq in this step. A request that can no longer meet its bound takes none while
        another can still meet its own, up to YIELD_OVERDUE_S past its deadline (as its tower blocks yield: _yields),
        and at most PAST_SAVING_CHUNK_TOKENS otherwise, so that a request arriving during one of its steps is not
        held for a whole prefill budget's step."""
        n = self._chunk_tokens(seq, budget, prefill_left)
        if seq.num_uncomputed_tokens <= 1:
            return n
        now = self.clock()
        if not self._cannot_meet(seq, now):
            return n
        if now <= seq.deadline + YIELD_OVERDUE_S and self._another_can_meet(seq, now):
            return 0
        return min(n, PAST_SAVING_CHUNK_TOKENS)

    def _cannot_meet(self, seq: Sequence, now: float) -> bool:
        """Whether seq has a latency bound (and the step clock an estimate) but can no longer meet it."""
        return self.step_clock.slack(seq, now) is not None and not self._can_meet(seq, now)

    # ---- image encoding ---------------------------------------------------------------------------

    def _may_run_whole(self, seq: Sequence, cost: float, log_key: ImageKey | None = None) -> bool:
        """Whether `cost` of tower work for seq may run in one step rather than spread over steps: seq's own bound
        can still be met that way, and nobody else is there, or everybody else has a latency bound and a slack that
        outlasts that work (as this engine's steps measured it) or is already past saving. Requests without a bound
        (Offline) keep passes spread: a whole pass would stall their decodes for no bound of theirs. A request whose
        slack is shorter than its own pass and its prompt's prefill misses its bound even run whole: its pass is
        spread even while it is alone, so that requests arriving meanwhile are not held behind all of it, and its
        blocks then yield to them (_yields). (Interactive on one H200, run96-97: a 4,000 px image's 1.66 s step held
        three later queries past 1.5 s; the tower alone, about 1.1 s estimated, was within that image's ~1.2 s of
        slack, its 16k-token prefill not.)"""
        seconds = self.step_clock.tower_s(cost)
        now = self.clock()
        others = [s for s in (*self.running, *self.waiting) if s is not seq]
        past_saving = self._past_saving(seq, cost, now)
        if log_key is not None and log_key not in self._logged:  # what a large image's first decision weighs
            self._logged.add(log_key)
            own, own_work = self.step_clock.slack(seq, now), self._own_work_s(seq, cost)
            log.info("tower pass of %s (cost %.0f): %s s estimated with its prefill, its own slack %s s, "
                     "%d other request(s)", seq.request_id, cost, "?" if own_work is None else f"{own_work:.3f}",
                     "none" if own is None else f"{own:.3f}", len(others))
            if seq.tower_decision is None:  # the request's first large image (the step trace's request line)
                seq.tower_decision = {"estimated_s": None if own_work is None else round(own_work, 4),
                                      "slack_s": None if own is None else round(own, 4),
                                      "past_saving": past_saving, "others": len(others)}
        if past_saving:
            return False
        if not others:
            return True
        if seconds is None:
            return False
        for other in others:
            slack = self.step_clock.slack(other, now)
            if slack is None or (slack < seconds and self._can_meet(other, now)):
                return False
        return True

    def _own_work_s(self, seq: Sequence, cost: float) -> float | None:
        """Seconds of seq's own remaining work before its first token: `cost` of tower work and its prompt's
        uncomputed tokens (None before any step with tower work was seen)."""
        seconds = self.step_clock.tower_s(cost)
        return None if seconds is None else seconds + self.step_clock.prefill_s(seq.num_uncomputed_tokens)

    def _past_saving(self, seq: Sequence, cost: float, now: float) -> bool:
        """Whether seq misses its bound even if `cost` of its tower work and its prompt ran at once, with
        PAST_SAVING_MARGIN for the estimate's error (False without a bound or before the step clock has seen tower
        work)."""
        own, own_work = self.step_clock.slack(seq, now), self._own_work_s(seq, cost)
        return own is not None and own_work is not None and own < own_work * PAST_SAVING_MARGIN

    def _tower_left(self, seq: Sequence) -> float:
        """Tower work (VisionCost units) seq's prompt still needs: its images not yet encoded, and the blocks left of
        a pass spread over steps."""
        vision, cache, left = self.limits.vision, self.encoder_cache, 0.0
        for image in seq.images:
            key = (seq.request_id, image.index)
            if image.end <= seq.num_computed_tokens or cache.is_ready(key):
                continue
            running = self._passes.get(key)
            done = 0 if running is None else running[2]
            left += vision.cost(image.num_tokens) - done * vision.block_cost(image.num_tokens)
        return left

    def _can_meet(self, seq: Sequence, now: float) -> bool:
        """Whether seq can still meet its bound: it has one, its slack is not negative, and it is not past saving with
        the tower and prompt work it has left. Only such a request holds back another's tower work (_may_run_whole,
        _defers, _yields): one past saving yields to the others, so another waiting for it would leave the engine
        idle until one of their slacks ran out (two requests waiting for each other; in the product path's replay,
        a 4,000 px pass yielding to a 3,000 px image whose tower waited for it)."""
        slack = self.step_clock.slack(seq, now)
        return slack is not None and slack >= 0.0 and not self._past_saving(seq, self._tower_left(seq), now)

    def _defers(self, seq: Sequence, cost: float, log_key: ImageKey | None = None) -> bool:
        """Whether seq's tower work (`cost`, not yet started) waits for this step: run now, it and seq's prompt would
        hold another request that can still meet its bound past it, and seq has the slack to wait DEFER_STEPS more
        steps and still meet its own. The others then run their steps first, and seq's work starts once they are
        done or its own slack has run down to that margin. Spreading the pass would not spare them: they would wait
        for the same tower work, one share a step. (The product path's Interactive replay, 2,000 queries at 1.95
        QPS, four arrival seeds: 33 queries over 1.5 s beside the 31 4,000 px ones, 22 with this rule;
        benchmarks/README.md, twenty-ninth pass.) Waits never go round in a circle: seq waits only for a request
        with less slack than its own, so the one with the least slack among those waiting runs."""
        now = self.clock()
        own, own_work = self.step_clock.slack(seq, now), self._own_work_s(seq, cost)
        step = self.step_clock.decode_s
        if own is None or own_work is None or step is None or own - own_work < DEFER_STEPS * step:
            return False
        for other in (*self.running, *self.waiting):
            if other is seq:
                continue
            slack = self.step_clock.slack(other, now)
            if slack is not None and slack < own_work and self._can_meet(other, now):
                if log_key is not None and log_key not in self._waits_logged:  # its first wait, once
                    self._waits_logged.add(log_key)
                    log.info("tower work of %s (cost %.0f, %.3f s with its prefill) waits: %s has %.3f s of slack, "
                             "its own %.3f s", seq.request_id, cost, own_work, other.request_id, slack, own)
                return True
        return False

    def _yields(self, seq: Sequence, cost: float) -> bool:
        """Whether seq's pass (`cost` of tower work left) runs no block in this step: seq is past saving, less than
        YIELD_OVERDUE_S past its deadline, and another request can still meet its bound. Such a request's steps
        would otherwise each carry a block (a 4,000 px image's is ~46 ms on one H200, 27 of them) and it would miss
        its bound too; the pass goes on in the steps without one."""
        now = self.clock()
        if seq.deadline is None or now > seq.deadline + YIELD_OVERDUE_S or not self._past_saving(seq, cost, now):
            return False
        return self._another_can_meet(seq, now)

    def _another_can_meet(self, seq: Sequence, now: float) -> bool:
        """Whether a request other than seq, running or waiting, can still meet its bound."""
        return any(other is not seq and self._can_meet(other, now) for other in (*self.running, *self.waiting))

    def observe_step(self, seconds: float, out: SchedulerOutput) -> None:
        """The engine ran `out` in `seconds`: StepClock learns what its tower work and its other work take. The tower
        work in a step's time is its encode_now and the step before's encode_ahead (encoded_before), not its own
        encode_ahead: that runs behind its sampling, after the tokens whose arrival ends its time. With passes_beside
        a pass's blocks run beside the steps: in no step's time."""
        vision = self.limits.vision
        cost = sum(vision.cost(e.image.num_tokens) if not e.num_blocks else e.num_blocks *
                   vision.block_cost(e.image.num_tokens) for e in out.encodes_in_step_time(self.limits.passes_beside))
        if out.chunks or cost:
            prompt_tokens = sum(c.num_tokens for c in out.chunks if c.num_tokens > 1)
            context = sum(c.start + 1 for c in out.chunks if c.num_tokens == 1)
            self.step_clock.observe_step(seconds, cost, prompt_tokens, context)

    def _plan_images(self, seq: Sequence, start: int, n: int, encoder: _EncoderBudget
                     ) -> tuple[list[ImageSpan], list[tuple[ImageSpan, int]], int]:
        """What the chunk [start, start + n) of seq needs from the vision tower in this step: images to encode
        whole, passes to start over the next steps (an image costing more than a whole step's budget: its first
        blocks), and the chunk's length: n, or cut before the first image not usable in this step (no room in
        the budget or in the cache, after evicting what other sequences have not started on, or a pass still
        running)."""
        cache, rid, vision = self.encoder_cache, seq.request_id, self.limits.vision
        room = empty_after_evicting = None  # the cache's room after evicting: worked out once an image needs it
        whole: list[ImageSpan] = []
        split: list[tuple[ImageSpan, int]] = []
        cost = rows = 0.0
        for image in seq.images:
            key = (rid, image.index)
            if not image.overlaps(start, start + n) or cache.is_ready(key):
                continue
            cut = max(image.start - start, 0)
            if key in cache:  # its pass is still running
                return whole, split, cut
            first = not whole and not split
            if room is None:  # (a decode's chunk overlaps no image: most calls never get here)
                evictable = [k for k in cache.evictable() if k[0] != rid]
                room = cache.capacity_tokens - cache.used_tokens + sum(cache.size(k) for k in evictable)
                empty_after_evicting = len(cache) == len(evictable)
            if not (rows + image.num_tokens <= room or (first and empty_after_evicting)):
                return whole, split, cut
            image_cost = vision.cost(image.num_tokens)
            if first and self._defers(seq, image_cost, log_key=key):
                return whole, split, cut
            if image_cost + cost <= encoder.left or (first and not encoder.used and (
                    vision.depth == 1 or self._may_run_whole(seq, image_cost, log_key=key))):
                # (a one-block cost model cannot split: a large image goes alone; and where no other request needs
                # the steps to keep coming, spreading its pass would only add steps to its own latency)
                whole.append(image)
                cost, rows = cost + image_cost, rows + image.num_tokens
                continue
            if image_cost > encoder.total and vision.depth > 1:  # never fits one step: its first blocks now
                if self._yields(seq, image_cost):
                    return whole, split, cut
                if self.limits.passes_beside:  # every block at once, beside the steps (passes_done ends it)
                    split.append((image, vision.depth))
                    return whole, split, cut
                blocks = min(vision.depth - 1, int((encoder.left - cost) // vision.block_cost(image.num_tokens)))
                if blocks == 0 and first and not encoder.used:
                    blocks = 1
                if blocks > 0:
                    split.append((image, blocks))
            return whole, split, cut
        return whole, split, n

    def _start_passes(self, seq: Sequence, split: list[tuple[ImageSpan, int]], encoder: _EncoderBudget,
                      out: SchedulerOutput) -> None:
        vision = self.limits.vision
        for image, blocks in split:
            key = (seq.request_id, image.index)
            self.encoder_cache.add(key, image.num_tokens, ready=False)
            self._passes[key] = (seq, image, blocks)
            out.encode_now.append(ImageEncode(seq, image, 0, blocks))
            if not self.limits.passes_beside:  # beside the steps a pass takes none of a step's time
                encoder.take(blocks * vision.block_cost(image.num_tokens))

    def _continue_passes(self, encoder: _EncoderBudget, out: SchedulerOutput) -> None:
        """The next blocks of the passes spread over steps, oldest first; at least one block a step for the oldest,
        and at most encoder_pass_share of the step's budget while other work may want the rest."""
        if self.limits.passes_beside:  # each pass was listed whole when it started: passes_done ends it
            return
        vision = self.limits.vision
        reserved = encoder.total * (1 - self.limits.encoder_pass_share)  # for whole images
        for key, (seq, image, done) in list(self._passes.items()):
            per_block = vision.block_cost(image.num_tokens)
            if self._yields(seq, (vision.depth - done) * per_block):
                continue
            blocks = min(vision.depth - done, int((encoder.left - reserved) // per_block))
            if not encoder.used and self._may_run_whole(seq, (vision.depth - done) * per_block):
                blocks = vision.depth - done  # those it was spread for have gone, or can wait for the rest now
            if blocks <= 0 and not encoder.used:
                blocks = 1
            if blocks <= 0:
                break
            out.encode_now.append(ImageEncode(seq, image, done, blocks))
            encoder.take(blocks * per_block)
            if done + blocks == vision.depth:
                del self._passes[key]
                self.encoder_cache.mark_ready(key)  # its last blocks run before this step's chunks read it
                self.encoder_cache.mark_started(key)  # never evicted: a pass's work is not thrown away
            else:
                self._passes[key] = (seq, image, done + blocks)

    @property
    def passes_in_flight(self) -> bool:
        """Whether passes run beside the steps (passes_beside) that the executor has not reported done."""
        return self.limits.passes_beside and bool(self._passes)

    def passes_done(self, keys: list[ImageKey]) -> None:
        """The executor finished these passes beside the steps (passes_beside): their outputs are ready to read.
        Keys of passes dropped meanwhile (a preempted, aborted or failed request's) are ignored."""
        for key in keys:
            if self._passes.pop(key, None) is not None:
                self.encoder_cache.mark_ready(key)
                self.encoder_cache.mark_started(key)  # never evicted: a pass's work is not thrown away

    def _forget_images(self, request_id: str) -> list[ImageKey]:
        for key in [k for k in self._passes if k[0] == request_id]:
            del self._passes[key]
        self._logged -= {k for k in self._logged if k[0] == request_id}
        self._waits_logged -= {k for k in self._waits_logged if k[0] == request_id}
        return self.encoder_cache.free_request(request_id)

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
            encoder.take(self.limits.vision.cost(image.num_tokens))
        end = chunk.start + chunk.num_tokens
        for image in seq.images:
            if image.overlaps(chunk.start, end):
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
        prompts = []  # (seq, start, rows left) of running sequences with prompt rows left after this step
        for seq in self.running:  # the next step's decodes come first, a row each
            start = in_step.get(seq.request_id, seq.num_computed_tokens)
            left = seq.num_tokens - start
            if left <= 1:
                budget -= 1
            else:
                prompts.append((seq, start, left))
        prompts.sort(key=lambda p: p[0].arrival)  # then prompt chunks oldest first (a stable sort, as schedule()'s)
        for seq, start, left in prompts:
            take = min(left, budget, prefill_left)
            if take > 0:
                guesses.append((seq, start, take))
                budget, prefill_left = budget - take, prefill_left - take
        for seq in itertools.islice(self.waiting, max(0, limits.max_num_seqs - len(self.running))):
            take = min(seq.num_uncomputed_tokens, budget, prefill_left)
            if take <= 0:
                break
            start = seq.kv_import.num_tokens if seq.kv_import is not None else 0
            guesses.append((seq, start, take))
            budget, prefill_left = budget - take, prefill_left - take
        for seq, start, take in guesses:
            for image in seq.images:
                key = (seq.request_id, image.index)
                if not image.overlaps(start, start + take) or key in cache:
                    continue
                cost = self.limits.vision.cost(image.num_tokens)
                if not (encoder.fits(cost) and cache.fits(image.num_tokens)):
                    return
                cache.add(key, image.num_tokens)
                encoder.take(cost)
                out.encode_ahead.append(ImageEncode(seq, image))

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """Applies a finished step: advances progress, appends sampled tokens, finishes sequences.
        Returns the sequences that got a token or finished."""
        self.apply(out)
        return self.resolve(out, sampled)

    def apply(self, out: SchedulerOutput) -> None:
        """Applies a step launched on the device before its tokens are known, so that the next step can be scheduled
        while it runs (vLLM's async scheduling, whose requests carry output placeholders the same way:
        https://docs.vllm.ai/en/v0.15.0/api/vllm/v1/core/sched/async_scheduler/): progress advances, each chunk that samples appends PENDING_TOKEN,
        and a sequence that token surely ends (its length, or a prefill_only request) finishes now, by LENGTH
        until resolve() knows its token. The next schedule() then decides as after update(), except that a
        sequence about to sample a stop token is still running (its next token is dropped: see resolve)."""
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
            seq.append_token(PENDING_TOKEN)
            if self._ends_by_length(seq):
                self.finish(seq, FinishReason.LENGTH)
                self._ending[seq.request_id] = seq

    def resolve(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Sequence]:
        """Puts an applied step's sampled tokens in place of its pending ones and finishes the sequences they stop
        (STOP); returns the sequences that got a token. A sequence finished since apply() (aborted, failed) gets
        its token but no say; one preempted since, its token, and it waits to be recomputed with it. A look-ahead
        step scheduled meanwhile keeps its row for a sequence stopped here: update() skips finished sequences."""
        changed = []
        for chunk in out.chunks:
            seq, at = chunk.seq, chunk.start + chunk.num_tokens
            if not chunk.samples or at >= seq.num_tokens or seq.token_ids[at] != PENDING_TOKEN:
                continue
            token = seq.token_ids[at] = sampled[seq.request_id]
            ending = self._ending.pop(seq.request_id, None)
            if ending is not None:
                if self._stop_reason(seq, token) is FinishReason.STOP:
                    seq.finish_reason = FinishReason.STOP
                changed.append(seq)
            elif not seq.is_finished:
                reason = self._stop_reason(seq, token)
                if reason is not None:
                    self.finish(seq, reason)
                changed.append(seq)
        return changed

    def fail(self, out: SchedulerOutput, error: str) -> list[Sequence]:
        """Finishes every sequence of a step that could not be executed (applied or not: its pending tokens are
        dropped, and the sequences it had ended by length end with the error instead)."""
        failed = []
        for chunk in out.chunks:
            seq, at = chunk.seq, chunk.start + chunk.num_tokens
            if chunk.samples and at < seq.num_tokens and seq.token_ids[at] == PENDING_TOKEN:
                del seq.token_ids[at:]
            if self._ending.pop(seq.request_id, None) is not None:
                self.held.pop(seq.request_id, None)
                self.block_manager.free(seq)
                seq.finish_reason, seq.error = FinishReason.ERROR, error
                failed.append(seq)
            elif not seq.is_finished:
                failed.append(seq)
                self.finish(seq, FinishReason.ERROR, error)
        for encode in out.encode_ahead:  # never run
            self.encoder_cache.free(encode.key)
        for encode in out.encode_now:  # a pass spread over steps is in an unknown state: it starts again
            if encode.num_blocks and encode.key in self.encoder_cache:
                self._passes.pop(encode.key, None)
                self.encoder_cache.free(encode.key)
                self._drop_next.append(encode.key)
        return failed

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether seq finishes whatever its last token is (no stop token checked)."""
        return (seq.prefill_only or seq.num_generated_tokens >= seq.sampling.max_tokens
                or seq.num_tokens >= self.limits.max_model_len)

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        if token in self.eos_token_ids or token in seq.sampling.stop_token_ids:
            return FinishReason.STOP
        return FinishReason.LENGTH if self._ends_by_length(seq) else None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> str:
        """Frees seq's blocks; it waits to be computed again, or, when it cannot be (Sequence.recomputable), finishes
        PREEMPTED."""
        log.debug("preempting %s (%d tokens)", seq.request_id, seq.num_tokens)
        if not seq.recomputable:
            out.encode_now = [e for e in out.encode_now if e.seq is not seq]
            self.finish(seq, FinishReason.PREEMPTED, "preempted, and its prompt's images are not here to compute "
                        "it again")
            out.rejected.append(seq)
            self.num_preemptions += 1
            return seq.request_id
        self.running.remove(seq)
        self.block_manager.free(seq)
        out.encoder_drop.extend(self._forget_images(seq.request_id))
        # its pass's blocks listed earlier in this step (they would run on a dropped state): not run at all
        out.encode_now = [e for e in out.encode_now if e.seq is not seq]
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
