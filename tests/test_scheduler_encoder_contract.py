"""Whatever happens to requests (arrivals, preemption, aborts, failed steps), the scheduler's encoder lists are
something the model runner can carry out: every pass continues from the block the runner's state is at, and every
chunk's image rows are encoded when the chunk runs. Checked on random traces against a tensor-free copy of the
runner's bookkeeping (ModelRunner.execute: drop, encode now, read, free, encode ahead)."""

from __future__ import annotations

import random

import pytest

from workers.core.block_manager import BlockManager
from workers.core.encoder_cache import VisionCost
from workers.core.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from workers.core.sequence import Sequence
from contract.types import SamplingParams


class RunnerBookkeeping:
    """What the runner holds after each step, per the scheduler's lists; asserts it can do what they ask."""

    def __init__(self, depth: int):
        self.depth = depth
        self.passes: dict[tuple[str, int], int] = {}  # next block of each pass spread over steps
        self.encoded: set[tuple[str, int]] = set()

    def execute(self, out: SchedulerOutput) -> None:
        for key in out.encoder_drop:
            self.passes.pop(key, None)
            self.encoded.discard(key)
        for e in out.encode_now:
            if not e.num_blocks:
                self.encoded.add(e.key)
                continue
            if e.first_block == 0:
                self.passes[e.key] = 0
            assert self.passes.get(e.key) == e.first_block, f"{e.key}: blocks from {e.first_block} listed"
            self.passes[e.key] += e.num_blocks
            if self.passes[e.key] == self.depth:
                del self.passes[e.key]
                self.encoded.add(e.key)
        for c in out.chunks:
            for image in c.seq.images:
                if image.end > c.start and image.start < c.start + c.num_tokens:
                    assert (c.seq.request_id, image.index) in self.encoded, f"{c.seq.request_id} reads {image}"
        for key in out.encoder_free:
            self.encoded.discard(key)
        self.encoded.update(e.key for e in out.encode_ahead)

    def release(self, request_id: str) -> None:
        self.passes = {k: v for k, v in self.passes.items() if k[0] != request_id}
        self.encoded = {k for k in self.encoded if k[0] != request_id}


def random_prompt(rnd: random.Random, rid: str, arrival: int) -> Sequence:
    length, images, pos = rnd.randint(5, 60), [], 1
    while rnd.random() < 0.5 and pos < length - 2:
        rows = rnd.randint(1, min(40, length - pos - 1))
        images.append((pos, rows, b""))
        pos += rows + 1
    return Sequence(rid, list(range(length)), length, SamplingParams(max_tokens=rnd.randint(1, 6)), arrival=arrival,
                    image_spans=images)


@pytest.mark.parametrize("seed", range(300))
def test_the_runner_can_always_carry_out_the_schedulers_encoder_lists(seed):
    rnd = random.Random(seed)
    depth = rnd.choice([3, 27])
    limits = SchedulerLimits(
        rnd.choice([4, 16]), rnd.choice([32, 64, 128]), 4000, max_num_prefill_tokens=rnd.choice([None, 16]),
        max_num_encoder_tokens=rnd.choice([8, 24, 64]), encode_ahead=rnd.random() < 0.5,
        vision=VisionCost(depth, rnd.choice([None, 16])),
    )
    sched = Scheduler(limits, BlockManager(rnd.choice([12, 24, 64]), 4), frozenset({-1}))  # small pools: preemption
    runner, arrivals = RunnerBookkeeping(depth), 0
    for _ in range(300):
        if rnd.random() < 0.3 and arrivals < 40:
            sched.add(random_prompt(rnd, f"r{arrivals}", arrivals))
            arrivals += 1
        if rnd.random() < 0.05 and sched.running:
            victim = rnd.choice(sched.running).request_id
            sched.abort(victim)
            runner.release(victim)
        out = sched.schedule()
        for seq in out.rejected:
            runner.release(seq.request_id)
        if out.is_empty:
            continue
        runner.execute(out)
        if rnd.random() < 0.03:  # the step fails after the runner did its part
            finished = sched.fail(out, "step failed")
        else:
            finished = [s for s in sched.update(out, {c.seq.request_id: 7 for c in out.chunks if c.samples})
                        if s.is_finished]
        for seq in finished:
            runner.release(seq.request_id)
    assert arrivals > 10


def test_the_random_traces_spread_passes_over_steps():
    """The traces above reach the case they are for (a guard on the generator, not on the scheduler)."""
    rnd = random.Random(1)
    sched = Scheduler(SchedulerLimits(16, 64, 4000, max_num_encoder_tokens=8, vision=VisionCost(3, 16)),
                      BlockManager(64, 4), frozenset({-1}))
    for i in range(20):
        sched.add(random_prompt(rnd, f"r{i}", i))
    parts = 0
    for _ in range(200):
        out = sched.schedule()
        parts += sum(1 for e in out.encode_now if e.num_blocks)
        sched.update(out, {c.seq.request_id: 7 for c in out.chunks if c.samples})
    assert parts > 10
