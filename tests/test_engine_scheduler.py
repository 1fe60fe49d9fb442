"""Scheduler and block manager on their own (no model): token budget, chunked prefill, preemption,
prefix caching, and EngineConfig validation."""

from __future__ import annotations

import pydantic
import pytest

from contract.types import FinishReason, SamplingParams
from workers.core.block_manager import BlockManager
from workers.core.encoder_cache import VisionCost
from workers.config import EngineConfig
from workers.core import scheduler as scheduler_module
from workers.core.scheduler import Scheduler, SchedulerLimits, SchedulerOutput
from workers.core.slack import StepClock
from workers.core.sequence import PENDING_TOKEN, Sequence

EOS = 99


def make(num_blocks=16, block_size=4, budget=8, max_seqs=8, caching=False):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(SchedulerLimits(max_seqs, budget, 1000), bm, frozenset({EOS})), bm


def seq(rid: str, n: int, max_tokens: int = 10, first: int = 1) -> Sequence:
    return Sequence(rid, list(range(first, first + n)), n, SamplingParams(max_tokens=max_tokens), arrival=0)


def step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sched.update(out, {c.seq.request_id: token for c in out.chunks if c.samples})
    return out


def test_budget_mixes_decodes_with_a_chunk_of_a_new_prompt():
    sched, _ = make(budget=8)
    sched.add(seq("a", 3))
    step(sched)  # a prefilled, now decoding
    sched.add(seq("b", 20))
    out = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 7)]
    assert out.num_batched_tokens == 8 and not out.chunks[1].samples


def test_decodes_are_scheduled_before_the_prefill_of_a_prompt_admitted_earlier():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerLimits(8, 16, 1000, max_num_encoder_tokens=8), bm, frozenset({EOS}))
    sched.add(image_seq("first", 10, [(0, 8)]))
    sched.add(image_seq("early", 30, [(2, 8)]))  # its image waits for the next step's encoder budget
    sched.add(seq("short", 2))
    out = step(sched)
    assert chunks(out) == [("first", 0, 10), ("early", 0, 2), ("short", 0, 2)]
    out = sched.schedule()
    # both decodes, though "early" (running since the same step) has 28 prompt tokens left
    assert chunks(out) == [("first", 10, 1), ("short", 2, 1), ("early", 2, 14)]


def test_running_prefills_are_served_oldest_first():
    sched, _ = make(budget=8, num_blocks=32)
    old, new = seq("old", 20), seq("new", 20)
    old.arrival, new.arrival = 1, 2
    sched.add(old)
    sched.add(new)
    step(sched)  # old: 8
    sched.running.reverse()  # as after a preemption: a recomputed sequence rejoins the running list at its end
    out = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("old", 8)]


def test_prefill_cap_limits_prompt_tokens_per_step_but_not_decodes():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerLimits(8, 64, 1000, max_num_prefill_tokens=10), bm, frozenset({EOS}))
    sched.add(seq("a", 3))
    step(sched)
    sched.add(seq("b", 30))
    sched.add(seq("c", 30))
    out = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 10)]


# ---- the vision encoder's budget and cache -----------------------------------------------------------------------

def image_seq(rid: str, n: int, images: list[tuple[int, int]], max_tokens: int = 3) -> Sequence:
    """A prompt of n tokens whose images' rows are [start, start + rows) for each (start, rows)."""
    return Sequence(rid, list(range(1, n + 1)), n, SamplingParams(max_tokens=max_tokens), arrival=0,
                    image_spans=[(start, rows, b"") for start, rows in images])


def encodes(out) -> dict[str, list[tuple[str, int]]]:
    return {"now": [e.key for e in out.encode_now], "ahead": [e.key for e in out.encode_ahead],
            "drop": list(out.encoder_drop), "free": list(out.encoder_free)}


def chunks(out) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks]


def encoder_scheduler(budget=64, encoder=None, cache=None, ahead=True, num_blocks=64):
    bm = BlockManager(num_blocks, 4)
    limits = SchedulerLimits(8, budget, 1000, max_num_encoder_tokens=encoder, encoder_cache_tokens=cache,
                             encode_ahead=ahead)
    return Scheduler(limits, bm, frozenset({EOS}))


def test_an_image_is_encoded_in_the_step_its_first_rows_are_computed_and_freed_with_its_last():
    sched = encoder_scheduler(budget=8, ahead=False)
    sched.add(image_seq("a", 20, [(4, 8)]))  # image rows 4-11
    first = sched.schedule()
    assert chunks(first) == [("a", 0, 8)]
    assert encodes(first) == {"now": [("a", 0)], "ahead": [], "drop": [], "free": []}
    sched.update(first, {})
    second = sched.schedule()  # rows 8-15: the image's last rows, from the cache
    assert encodes(second) == {"now": [], "ahead": [], "drop": [], "free": [("a", 0)]}
    assert len(sched.encoder_cache) == 0


def test_a_chunk_stops_before_an_image_the_steps_encoder_budget_cannot_take():
    sched = encoder_scheduler(budget=64, encoder=8, ahead=False)
    sched.add(image_seq("a", 20, [(2, 8)]))
    sched.add(image_seq("b", 20, [(5, 8)]))
    out = sched.schedule()
    # a's image takes the budget: b computes only the text before its image
    assert chunks(out) == [("a", 0, 20), ("b", 0, 5)]
    assert encodes(out)["now"] == [("a", 0)]
    sched.update(out, {"a": 7})
    out = sched.schedule()
    assert chunks(out) == [("a", 20, 1), ("b", 5, 15)] and encodes(out)["now"] == [("b", 0)]


def test_an_image_larger_than_the_encoder_budget_is_encoded_alone():
    sched = encoder_scheduler(budget=64, encoder=8, cache=8, ahead=False)
    sched.add(image_seq("big", 30, [(2, 20)]))
    sched.add(image_seq("small", 10, [(2, 4)]))
    out = sched.schedule()
    assert chunks(out) == [("big", 0, 30), ("small", 0, 2)] and encodes(out)["now"] == [("big", 0)]


def test_unused_encoder_budget_encodes_the_next_steps_images_ahead_in_scheduling_order():
    sched = encoder_scheduler(budget=24, encoder=16)
    for rid in ("a", "b", "c", "d"):
        sched.add(image_seq(rid, 12, [(2, 6)]))
    out = sched.schedule()  # a and b whole; c and d next step, whose images fit what is left of the budget: c's
    assert chunks(out) == [("a", 0, 12), ("b", 0, 12)]
    assert encodes(out) == {"now": [("a", 0), ("b", 0)], "ahead": [], "drop": [], "free": [("a", 0), ("b", 0)]}
    sched = encoder_scheduler(budget=24, encoder=18)
    for rid in ("a", "b", "c", "d"):
        sched.add(image_seq(rid, 12, [(2, 6)]))
    out = sched.schedule()
    assert encodes(out)["ahead"] == [("c", 0)]  # 6 rows left: c's image, not d's
    sched.update(out, {"a": 7, "b": 7})
    out = sched.schedule()  # c from the cache, d encoded now
    assert chunks(out)[2:] == [("c", 0, 12), ("d", 0, 10)]
    assert encodes(out)["now"] == [("d", 0)]


def test_an_image_needed_now_evicts_images_encoded_ahead_for_sequences_not_started_on_them():
    sched = encoder_scheduler(budget=10, encoder=16, cache=12)
    sched.add(image_seq("a", 10, [(2, 6)]))
    sched.add(image_seq("b", 10, [(2, 6)]))
    out = sched.schedule()  # a whole (its image now), b's image ahead: the cache holds b's 6 rows
    assert encodes(out)["ahead"] == [("b", 0)] and sched.encoder_cache.keys() == [("b", 0)]
    # a newcomer ahead of b in the queue (a recomputed, preempted sequence goes back to the front)
    sched.update(out, {"a": 7})
    front = image_seq("front", 14, [(1, 12)])
    sched.waiting.appendleft(front)
    out = sched.schedule()
    assert ("b", 0) in out.encoder_drop and ("front", 0) in encodes(out)["now"]
    assert sched.encoder_cache.used_tokens <= 12


def test_an_image_needed_now_counts_on_the_room_only_unread_entries_of_other_sequences_free():
    sched = encoder_scheduler(budget=64, encoder=16, cache=16, ahead=False)
    cache = sched.encoder_cache
    cache.add(("read", 0), 4)  # a step has read it: it stays
    cache.mark_started(("read", 0))
    cache.add(("ahead", 0), 6)  # encoded ahead for a sequence that has not reached it: evictable
    sched.add(image_seq("new", 12, [(1, 10)]))
    out = sched.schedule()  # 6 rows free, 12 once the unread entry goes: enough for new's 10
    assert chunks(out) == [("new", 0, 12)] and encodes(out)["now"] == [("new", 0)]
    assert ("ahead", 0) in out.encoder_drop and ("read", 0) in cache

    sched = encoder_scheduler(budget=64, encoder=16, cache=16, ahead=False)
    sched.encoder_cache.add(("read", 0), 8)
    sched.encoder_cache.mark_started(("read", 0))
    sched.add(image_seq("new", 12, [(1, 10)]))
    out = sched.schedule()  # 8 rows free and nothing to evict: new computes its text before the image
    assert chunks(out) == [("new", 0, 1)] and encodes(out)["now"] == []


def test_an_image_needed_now_never_evicts_an_unread_image_of_its_own_sequence():
    """Room for a sequence's second image is not made by evicting its first, encoded ahead and not read yet: the same
    chunk needs it. The chunk stops before the second image instead."""
    sched = encoder_scheduler(budget=64, encoder=16, cache=10, ahead=False)
    sched.encoder_cache.add(("two", 0), 6)  # encoded ahead: unread, so evictable for another sequence's image
    sched.add(image_seq("two", 16, [(1, 6), (8, 6)]))
    out = sched.schedule()  # 4 rows free; the only unread entry is two's own
    assert chunks(out) == [("two", 0, 8)] and encodes(out)["now"] == []
    assert encodes(out)["drop"] == [] and encodes(out)["free"] == [("two", 0)]  # read by this step, not dropped


def test_preempting_a_sequence_drops_its_encoder_outputs():
    sched = encoder_scheduler(budget=8, encoder=8, ahead=False, num_blocks=6)  # 24 tokens of KV
    sched.add(image_seq("old", 12, [(0, 8)], max_tokens=20))
    step(sched)
    step(sched)  # old's prompt done, its first token sampled
    sched.add(image_seq("young", 12, [(4, 8)], max_tokens=20))
    out = step(sched)  # old's decode, young's rows 0-6 with its image: the pool is full
    assert chunks(out) == [("old", 12, 1), ("young", 0, 7)] and encodes(out)["now"] == [("young", 0)]
    out = sched.schedule()  # young's next rows need blocks only preempting young itself frees
    assert out.preempted == ["young"]
    assert out.encoder_drop == [("young", 0)] and ("young", 0) not in sched.encoder_cache


def test_an_image_costlier_than_a_steps_budget_is_encoded_over_steps_while_other_prompts_go_on():
    bm = BlockManager(64, 4)
    limits = SchedulerLimits(8, 16, 1000, max_num_encoder_tokens=8, vision=VisionCost(depth=4))
    sched = Scheduler(limits, bm, frozenset({EOS}))
    sched.add(image_seq("big", 30, [(2, 20)]))  # 20 rows: 5 a block, 8 a step
    sched.add(seq("text", 12, max_tokens=5))
    parts, big_chunks = [], []
    for _ in range(5):
        out = step(sched)
        parts += [(e.first_block, e.num_blocks) for e in out.encode_now if e.seq.request_id == "big"]
        big_chunks.append(next(((c.start, c.num_tokens) for c in out.chunks if c.seq.request_id == "big"), None))
    assert parts == [(0, 1), (1, 1), (2, 1), (3, 1)]  # a block a step
    # big computes its text before the image, then waits for the pass; its image rows come with the last block
    # (beside text's decode)
    assert big_chunks[:4] == [(0, 2), None, None, (2, 15)]
    assert ("big", 0) not in sched.encoder_cache  # freed once its last rows are in the KV cache


def test_beside_the_steps_a_pass_is_listed_whole_and_its_rows_wait_until_the_executor_reports_it_done():
    """engine.vision_green_sms: a pass too large for a step's budget runs whole beside the steps (its blocks in no
    step's time: the step clock learns none), its request's image rows wait until the executor says the pass is
    done, and the other requests' steps go on meanwhile."""
    bm = BlockManager(64, 4)
    limits = SchedulerLimits(8, 16, 1000, max_num_encoder_tokens=8, vision=VisionCost(depth=4), passes_beside=True)
    sched = Scheduler(limits, bm, frozenset({EOS}))
    sched.add(image_seq("big", 30, [(2, 20)]))  # 20 rows: more than a step's 8
    sched.add(seq("text", 12, max_tokens=5))
    costs = []
    sched.step_clock.observe_step = lambda seconds, cost, prompt, context: costs.append(cost)
    steps = []
    for _ in range(3):
        out = sched.schedule()
        sched.observe_step(0.01, out)
        sched.update(out, {c.seq.request_id: 7 for c in out.chunks if c.samples})
        steps.append(([(e.key, e.first_block, e.num_blocks) for e in out.encode_now], chunks(out)))
    assert steps[0] == ([(("big", 0), 0, 4)], [("big", 0, 2), ("text", 0, 12)])  # every block, in the first step
    assert steps[1] == ([], [("text", 12, 1)]) and steps[2] == ([], [("text", 13, 1)])  # big waits; text decodes
    assert costs == [0, 0, 0] and sched.passes_in_flight
    sched.passes_done([("big", 0), ("gone", 0)])  # (a pass of a request dropped meanwhile is ignored)
    assert not sched.passes_in_flight
    assert ("big", 2, 15) in chunks(sched.schedule())  # its image rows, once the pass is done


def test_a_finished_or_failed_request_leaves_nothing_in_the_encoder_cache():
    sched = encoder_scheduler(budget=12, encoder=16)
    sched.add(image_seq("a", 12, [(2, 6)]))
    sched.add(image_seq("b", 12, [(2, 6)]))
    out = sched.schedule()
    assert encodes(out)["ahead"] == [("b", 0)]
    sched.fail(out, "boom")  # the step never ran: nothing it listed is held
    assert len(sched.encoder_cache) == 0
    sched.abort("b")
    assert not sched.has_unfinished()


def test_long_prompt_is_prefilled_over_several_steps_then_samples():
    sched, _ = make(budget=8)
    s = seq("long", 20)
    sched.add(s)
    sizes = [step(sched).chunks[0].num_tokens for _ in range(3)]
    assert sizes == [8, 8, 4]
    assert s.num_generated_tokens == 1 and s.num_computed_tokens == 20


def test_running_out_of_blocks_preempts_the_youngest_and_recomputes_it_later():
    sched, bm = make(num_blocks=4, block_size=4, budget=64)
    old, young = seq("old", 8), seq("young", 8)
    sched.add(old)
    sched.add(young)
    step(sched)  # 8 prompt tokens each -> 2 blocks each, pool full
    out = step(sched)
    assert out.preempted == ["young"]
    assert sched.num_preemptions == 1 and young.num_preemptions == 1  # the engine-wide count the benchmarks report
    assert young.num_computed_tokens == 0 and young.block_table == [] and sched.waiting[0] is young
    assert young.num_tokens == 9  # keeps its generated token; it is recomputed as context
    while young.num_computed_tokens == 0:
        step(sched)
    assert young.num_generated_tokens >= 2
    # every block is either free or in exactly one running sequence's table: preemption leaked none
    held = [b for s in sched.running for b in s.block_table]
    assert len(held) == len(set(held)) and bm.num_free_blocks + len(held) == bm.num_blocks


def test_eos_max_tokens_and_max_model_len_finish_and_free_blocks():
    sched, bm = make()
    eos, short = seq("eos", 3), seq("short", 3, max_tokens=2)
    sched.add(eos)
    sched.add(short)
    sched.update(sched.schedule(), {"eos": EOS, "short": 5})
    assert eos.finish_reason is FinishReason.STOP
    step(sched)
    assert short.finish_reason is FinishReason.LENGTH and short.num_generated_tokens == 2
    assert bm.num_free_blocks == bm.num_blocks and not sched.has_unfinished()
    capped = Scheduler(SchedulerLimits(8, 64, 5), bm, frozenset({EOS}))
    s = seq("cap", 3, max_tokens=100)
    capped.add(s)
    while capped.has_unfinished():
        step(capped)
    assert s.finish_reason is FinishReason.LENGTH and s.num_tokens == 5


def test_prefill_only_keeps_its_blocks_until_released():
    sched, bm = make()
    s = seq("p", 6)
    s.prefill_only = True
    sched.add(s)
    step(sched)
    assert s.finish_reason is FinishReason.LENGTH and sched.held["p"] is s
    assert bm.num_free_blocks == bm.num_blocks - 2
    assert sched.release("p") and bm.num_free_blocks == bm.num_blocks


def three_requests() -> tuple[Scheduler, BlockManager]:
    sched, bm = make(budget=8, num_blocks=16)
    sched.add(seq("last", 2, max_tokens=1))  # its first token is its last
    sched.add(seq("goes-on", 3))
    sched.add(seq("long", 12, first=50))  # over two steps
    return sched, bm


def test_a_step_applied_before_its_tokens_are_known_schedules_the_next_as_its_update_would():
    (updated, bm_u), (applied, bm_a) = three_requests(), three_requests()
    first_u, first_a = updated.schedule(), applied.schedule()
    updated.update(first_u, {"last": 5, "goes-on": 6})
    applied.apply(first_a)
    # the sampled tokens are pending, "last" has already ended by length and given its blocks back
    assert [(s.request_id, s.token_ids[-1] == PENDING_TOKEN) for s in applied.running] == [("goes-on", True),
                                                                                          ("long", False)]
    last = first_a.chunks[0].seq
    assert last.finish_reason is FinishReason.LENGTH and last.token_ids[-1] == PENDING_TOKEN
    assert bm_a.num_free_blocks == bm_u.num_free_blocks
    second_u, second_a = updated.schedule(), applied.schedule()
    assert chunks(second_a) == chunks(second_u) == [("goes-on", 3, 1), ("long", 3, 7)]
    assert [c.samples for c in second_a.chunks] == [c.samples for c in second_u.chunks] == [True, False]
    # the tokens put in place: the same sequences as the update, ended the same way
    changed = applied.resolve(first_a, {"last": 5, "goes-on": 6})
    assert [s.request_id for s in changed] == ["last", "goes-on"]
    assert [(s.token_ids, s.finish_reason) for s in changed] == [
        (c.seq.token_ids, c.seq.finish_reason) for c in first_u.chunks if c.samples]


def test_a_stop_token_resolved_after_the_next_step_was_scheduled_ends_the_sequence_and_drops_its_row_ahead():
    sched, bm = make()
    s = seq("s", 3)
    sched.add(s)
    first = sched.schedule()
    sched.apply(first)
    ahead = sched.schedule()  # decodes the pending token, which is not known yet
    assert chunks(ahead) == [("s", 3, 1)] and ahead.chunks[0].samples
    assert [(c.request_id, c.finish_reason) for c in sched.resolve(first, {"s": EOS})] == [("s", FinishReason.STOP)]
    assert s.token_ids == [1, 2, 3, EOS] and bm.num_free_blocks == bm.num_blocks
    assert sched.update(ahead, {"s": 5}) == [] and s.token_ids == [1, 2, 3, EOS]


def test_a_failed_step_drops_its_pending_tokens_and_what_it_ended_by_length_ends_with_the_error():
    sched, bm = make(budget=16)
    goes_on, last, held = seq("goes-on", 3), seq("last", 2, max_tokens=1), seq("held", 4)
    held.prefill_only = True
    for s in (goes_on, last, held):
        sched.add(s)
    out = sched.schedule()
    sched.apply(out)
    assert sched.held["held"] is held and last.is_finished
    failed = sched.fail(out, "device lost")
    assert {s.request_id for s in failed} == {"goes-on", "last", "held"}
    assert all(s.finish_reason is FinishReason.ERROR and s.error == "device lost" for s in failed)
    assert [s.num_tokens for s in (goes_on, last, held)] == [3, 2, 4] and not sched.held
    assert bm.num_free_blocks == bm.num_blocks and not sched.has_unfinished()


def test_prefix_caching_shares_full_blocks_of_an_identical_prefix():
    sched, bm = make(budget=64, caching=True)
    a = seq("a", 10)
    sched.add(a)
    step(sched)
    b = seq("b", 10)
    sched.add(b)
    out = sched.schedule()
    assert b.block_table[:2] == a.block_table[:2]  # two full blocks of 4 shared
    assert out.chunks[-1].start == 8 and out.chunks[-1].num_tokens == 2


def test_prefix_caching_keys_blocks_by_image_content():
    sched, _ = make(budget=64, caching=True)
    a = seq("a", 10)
    a.image_spans = [(2, 4, b"image-one")]
    sched.add(a)
    step(sched)
    b = seq("b", 10)
    b.image_spans = [(2, 4, b"image-two")]
    sched.add(b)
    out = sched.schedule()
    assert out.chunks[-1].start == 0


def test_prefix_caching_is_off_by_default():
    assert EngineConfig(checkpoint="x").enable_prefix_caching is False
    sched, _ = make(budget=64)
    sched.add(seq("a", 10))
    step(sched)
    sched.add(seq("b", 10))
    assert sched.schedule().chunks[-1].start == 0


@pytest.mark.parametrize(
    "settings, key",
    [
        ({"block_size": 0}, "block_size"),
        ({"device": "tpu"}, "device"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"dtype": "int8"}, "dtype"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"min_pixels": 10, "max_pixels": 5}, "min_pixels"),
        ({"max_batch": 3}, "max_batch"),
        ({"vision_green_sms": -1}, "vision_green_sms"),
        ({"vision_green_sms": 64, "tensor_parallel_size": 2}, "vision_green_sms"),
    ],
)
def test_bad_engine_config_names_the_key(settings, key):
    with pytest.raises(pydantic.ValidationError, match=key):
        EngineConfig(checkpoint="x", **settings)


def test_the_memory_profile_step_fills_the_budget_with_sequences_no_longer_than_max_model_len():
    from workers.executor.decode_graphs import full_budget_batch

    batch, num_blocks = full_budget_batch(num_tokens=10, max_len=4, block_size=3)
    assert batch.context_lens == [4, 4, 2] and batch.query_starts == [0, 4, 8, 10] and batch.num_decodes == 0
    assert num_blocks == 2 + 2 + 1
    assert batch.positions[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    slots = batch.slot_mapping.tolist()
    assert sorted(slots) == sorted(set(slots)) and max(slots) < num_blocks * 3  # distinct slots inside the blocks
    for seq, (lo, hi) in enumerate(zip(batch.query_starts, batch.query_starts[1:])):
        for index, row in enumerate(range(lo, hi)):  # each row's slot is in its own sequence's block table
            assert slots[row] == int(batch.block_tables[seq, index // 3]) * 3 + index % 3
    assert batch.positions.shape == (3, 10) and batch.positions.is_contiguous()  # pinned for the copy on CUDA


def test_encoder_pass_share_bounds_what_passes_take_from_whole_images():
    def big_parts(share: float) -> list[int]:
        limits = SchedulerLimits(8, 64, 1000, max_num_encoder_tokens=16, vision=VisionCost(depth=8),
                                 encoder_pass_share=share)
        sched = Scheduler(limits, BlockManager(64, 4), frozenset({EOS}))
        sched.add(image_seq("big", 40, [(0, 32)]))  # 32 rows: 4 a block, its pass over several steps
        sched.add(seq("other", 4, max_tokens=50))  # another request: the pass is spread for it
        parts = []
        for _ in range(3):
            out = step(sched)
            parts.append(sum(e.num_blocks for e in out.encode_now if e.seq.request_id == "big"))
        return parts

    # the first step starts the pass with the whole budget; afterwards each step's share of 16 rows, at 4 a block
    assert big_parts(0.5) == [4, 2, 2]
    assert big_parts(1.0) == [4, 4, 0]  # (the pass ended: 8 blocks)
    assert big_parts(0.0) == [4, 1, 1]  # the oldest pass's guaranteed block


@pytest.mark.parametrize("max_image_tokens,encoded", [(0, False), (32, True)], ids=["cache-twice-the-budget", "default"])
def test_the_encoder_cache_keeps_room_for_other_images_beside_a_pass_over_the_largest_image(max_image_tokens, encoded):
    # the cache holds twice the 16-row budget and the largest image's rows: big's 32 rows leave 32 for the others;
    # without the largest image's share, big fills it and small's 4-row image waits for the whole pass
    limits = SchedulerLimits(8, 64, 1000, max_num_encoder_tokens=16, vision=VisionCost(depth=8),
                             max_image_tokens=max_image_tokens)
    assert limits.cache_tokens == 32 + max_image_tokens
    sched = Scheduler(limits, BlockManager(64, 4), frozenset({EOS}))
    sched.add(seq("other", 4, max_tokens=50))  # another request: big's pass is spread
    sched.add(image_seq("big", 40, [(4, 32)]))
    step(sched)
    sched.add(image_seq("small", 8, [(2, 4)]))
    out = step(sched)
    assert (("small", 0) in [e.key for e in out.encode_now]) is encoded
    assert (("small", 0, 8) in chunks(out)) is encoded


def test_the_only_requests_large_image_is_encoded_in_one_go_and_a_spread_pass_finishes_once_alone():
    limits = SchedulerLimits(8, 64, 1000, max_num_encoder_tokens=16, vision=VisionCost(depth=8))
    sched = Scheduler(limits, BlockManager(64, 4), frozenset({EOS}))
    sched.add(image_seq("big", 40, [(0, 32)]))  # twice the step's encoder budget
    out = step(sched)
    # nobody else waits: the whole tower in this step, and the prompt in as few steps as the token budget allows
    assert [(e.seq.request_id, e.first_block, e.num_blocks) for e in out.encode_now] == [("big", 0, 0)]
    assert chunks(out) == [("big", 0, 40)]

    sched = Scheduler(limits, BlockManager(64, 4), frozenset({EOS}))
    sched.add(seq("short", 2, max_tokens=1))  # finishes after its first step
    sched.add(image_seq("big", 40, [(0, 32)]))
    first = step(sched)
    assert [(e.first_block, e.num_blocks) for e in first.encode_now] == [(0, 4)]  # spread while "short" is there
    second = step(sched)
    assert sched.find("short") is None
    assert [(e.first_block, e.num_blocks) for e in second.encode_now] == [(4, 4)]  # alone now: the rest at once
    assert ("big", 0, 40) in chunks(second)


# ---- latency slack (workers/core/slack.py) ------------------------------------------------------


def slack_scheduler(now: float = 100.0):
    """Encoder budget 16 rows, an 8-block tower; a clock stopped at `now`, and what its steps took: 10 ms a step
    without tower work, 1 ms per unit of tower cost, 5 tokens a request."""
    limits = SchedulerLimits(8, 64, 1000, max_num_encoder_tokens=16, vision=VisionCost(depth=8))
    sched = Scheduler(limits, BlockManager(64, 4), frozenset({EOS}), clock=lambda: now)
    sched.step_clock = StepClock(decode_s=0.010, tower_s_per_cost=0.001, output_tokens=5)
    return sched


def bounded(s: Sequence, deadline: float | None) -> Sequence:
    s.deadline = deadline
    return s


def big_pass(sched: Scheduler) -> list[tuple[int, int]]:
    """(first block, blocks) of the big image's tower work in the next step."""
    return [(e.first_block, e.num_blocks) for e in step(sched).encode_now if e.seq.request_id == "big"]


def test_a_large_pass_runs_whole_when_every_other_request_has_the_slack_to_wait_for_it():
    # the 32-row image's whole pass costs 32 units: 32 ms; "other" has ~100 s to spare
    sched = slack_scheduler()
    sched.add(bounded(seq("other", 4, max_tokens=50), deadline=200.0))
    sched.add(image_seq("big", 40, [(0, 32)]))
    assert big_pass(sched) == [(0, 0)]


@pytest.mark.parametrize("deadline", [100.06, None], ids=["slack-shorter-than-the-pass", "no-bound"])
def test_a_large_pass_is_spread_while_another_request_would_miss_its_bound_or_has_none(deadline):
    # 100.06 s: 60 ms, less its 5 expected decode steps (50 ms), leaves 10 ms, less than the pass's 32 ms
    sched = slack_scheduler()
    sched.add(bounded(seq("other", 4, max_tokens=50), deadline=deadline))
    sched.add(image_seq("big", 40, [(0, 32)]))
    assert big_pass(sched) == [(0, 4)]


def test_a_pass_that_would_hold_another_past_its_bound_waits_while_its_own_request_can_spare_the_time():
    # "other": 20 ms of slack after its 2 decode steps, less than the 32 ms pass; "big" can wait: 470 ms of slack
    # after its own 3 steps, 438 ms beyond its pass
    sched = slack_scheduler()
    sched.add(bounded(seq("other", 4, max_tokens=2), deadline=100.04))
    sched.add(bounded(image_seq("big", 40, [(4, 32)]), deadline=100.5))
    out = step(sched)
    assert not out.encode_now and sorted(chunks(out)) == [("big", 0, 4), ("other", 0, 4)]  # big stops before it
    assert not step(sched).encode_now  # other's last token
    assert sched.find("other") is None
    assert big_pass(sched) == [(0, 0)]  # alone now: its pass whole, at once


def test_a_pass_that_waits_for_others_says_so_once(caplog):
    sched = slack_scheduler()
    sched.add(bounded(seq("other", 4, max_tokens=2), deadline=100.04))
    sched.add(bounded(image_seq("big", 40, [(4, 32)]), deadline=100.5))
    with caplog.at_level("INFO", logger="workers.core.scheduler"):
        assert not step(sched).encode_now and not step(sched).encode_now  # waits in both steps
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "tower work of big (cost 32, 0.032 s with its prefill) waits"]


@pytest.mark.parametrize("deadline,expected", [(100.08, [(0, 4)]), (100.1, [])],
                         ids=["its-own-slack-within-two-steps-of-its-pass", "slack-to-spare"])
def test_a_pass_waits_for_others_only_while_its_own_request_keeps_two_steps_of_slack(deadline, expected):
    # "big" at 100.08 s: 50 ms of slack after its 3 decode steps, 18 ms beyond its 32 ms pass, under DEFER_STEPS
    # (2 x 10 ms): the pass starts, spread while "other" (10 ms of slack) cannot wait for all of it; at 100.1 s, 38 ms
    # beyond it: it waits
    sched = slack_scheduler()
    sched.add(bounded(seq("other", 4, max_tokens=50), deadline=100.06))
    sched.add(bounded(image_seq("big", 40, [(0, 32)]), deadline))
    assert big_pass(sched) == expected


@pytest.mark.parametrize("other_deadline", [None, 99.0], ids=["no-bound", "already-past-its-bound"])
def test_a_pass_does_not_wait_for_requests_without_a_bound_or_past_theirs(other_deadline):
    sched = slack_scheduler()
    sched.add(bounded(seq("other", 4, max_tokens=50), deadline=other_deadline))
    sched.add(bounded(image_seq("big", 40, [(0, 32)]), 100.5))
    assert big_pass(sched)  # started this step (spread beside a request without a bound, whole beside a late one)


def test_a_request_already_past_saving_does_not_hold_a_pass_back():
    sched = slack_scheduler()
    sched.add(bounded(seq("late", 4, max_tokens=50), deadline=99.0))  # its bound ran out a second ago
    sched.add(image_seq("big", 40, [(0, 32)]))
    assert big_pass(sched) == [(0, 0)]


@pytest.mark.parametrize("deadline,expected", [(100.06, [(0, 4)]), (100.5, [(0, 0)]), (None, [(0, 0)])],
                         ids=["past-saving-even-whole", "in-time-whole", "no-bound"])
def test_a_lone_request_that_would_miss_its_bound_even_run_whole_has_its_pass_spread(deadline, expected):
    # 100.06 s: its own slack (10 ms after its 5 expected decode steps) is shorter than its 32 ms pass, so running
    # it whole saves nothing of its own and would hold up whoever arrives during it; 100.5 s: whole, as it is alone
    sched = slack_scheduler()
    sched.add(bounded(image_seq("big", 40, [(0, 32)]), deadline))
    assert big_pass(sched) == expected


@pytest.mark.parametrize("deadline,past_saving", [(100.06, True), (100.5, False)], ids=["spread", "whole"])
def test_a_large_images_request_keeps_the_schedulers_first_decision_on_its_pass(deadline, past_saving):
    # its estimated own work (the 32 ms pass), its slack after 3 decode steps, whether it was past saving
    sched = slack_scheduler()
    big = bounded(image_seq("big", 40, [(0, 32)]), deadline)
    sched.add(big)
    step(sched)
    step(sched)  # decided once: later steps leave it as it was
    assert big.tower_decision == {"estimated_s": 0.032, "slack_s": pytest.approx(deadline - 100.03),
                                  "past_saving": past_saving, "others": 0}


@pytest.mark.parametrize("deadline,expected", [(100.066, [(0, 4)]), (100.072, [(0, 0)])],
                         ids=["slack-within-the-margin", "slack-beyond-it"])
def test_a_lone_request_whose_slack_barely_covers_its_estimated_pass_counts_as_past_saving(deadline, expected):
    # 100.066 s: 36 ms of slack after its 3 decode steps, above the 32 ms pass but under 1.25 x 32 = 40 ms (the
    # estimate's margin): spread, as past saving; at 100.072 s, 42 ms: whole
    sched = slack_scheduler()
    sched.add(bounded(image_seq("big", 40, [(0, 32)]), deadline))
    assert big_pass(sched) == expected


@pytest.mark.parametrize("prefill_s_per_token,expected", [(None, [(0, 0)]), (0.001, [(0, 4)])],
                         ids=["prefill-unknown", "prefill-counted"])
def test_a_lone_requests_own_prefill_counts_toward_past_saving(prefill_s_per_token, expected):
    # 100.1 s: 50 ms of slack after 5 decode steps; the 32 ms pass fits it, the pass and 40 prompt tokens at 1 ms
    # each (72 ms) do not
    sched = slack_scheduler()
    sched.step_clock.prefill_s_per_token = prefill_s_per_token
    sched.add(bounded(image_seq("big", 40, [(0, 32)]), 100.1))
    assert big_pass(sched) == expected


def test_a_pass_past_saving_yields_its_blocks_while_another_request_can_still_meet_its_bound():
    # "big" misses its bound whatever happens (10 ms of slack after its 3 decode steps, a 32 ms pass, 16 ms after
    # its first half); "small" has ~100 s to spare. Steps
    # that carry one of big's blocks would make small wait for all of them, one a step: none while small runs.
    sched = slack_scheduler()
    sched.add(bounded(image_seq("big", 40, [(4, 32)]), 100.04))
    assert big_pass(sched) == [(0, 4)]  # alone: spread, so that an arrival waits for one share of it
    sched.add(bounded(seq("small", 4, max_tokens=2), 200.0))
    out = step(sched)
    assert ("small", 0, 4) in chunks(out) and not [e for e in out.encode_now if e.seq.request_id == "big"]
    out = step(sched)  # small's decode, its last token
    assert sched.find("small") is None and not [e for e in out.encode_now if e.seq.request_id == "big"]
    assert big_pass(sched)[0][0] == 4  # small gone: the pass goes on where it stopped


def test_a_pass_past_saving_is_not_started_while_another_request_can_still_meet_its_bound():
    sched = slack_scheduler()
    sched.add(bounded(seq("small", 4, max_tokens=2), 200.0))
    sched.add(bounded(image_seq("big", 40, [(4, 32)]), 100.04))
    out = step(sched)
    assert not out.encode_now  # big's prompt stops before its image, small's runs
    assert sorted(chunks(out)) == [("big", 0, 4), ("small", 0, 4)]


def test_a_large_images_first_decision_is_logged_once_however_often_it_is_taken_again(caplog):
    sched = slack_scheduler()
    sched.add(bounded(seq("small", 4, max_tokens=5), 200.0))
    sched.add(bounded(image_seq("big", 40, [(4, 32)]), 100.04))
    with caplog.at_level("INFO", logger="workers.core.scheduler"):
        for _ in range(3):  # the pass is not started while small runs: the decision is taken each step
            assert not step(sched).encode_now
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["tower pass of big (cost 32)"]


@pytest.mark.parametrize("now,yields", [(106.0, True), (106.1, False)], ids=["overdue-5.96-s", "overdue-6.06-s"])
def test_a_pass_past_saving_yields_only_until_its_request_is_yield_overdue_s_past_its_deadline(now, yields):
    sched = slack_scheduler(now)
    sched.add(bounded(image_seq("big", 40, [(4, 32)]), 100.04))
    assert big_pass(sched) == [(0, 4)]
    sched.add(bounded(seq("small", 4, max_tokens=2), 200.0))
    assert bool(big_pass(sched)) is not yields


def test_a_pass_does_not_yield_to_requests_without_a_bound_or_already_past_theirs():
    for other_deadline in (None, 99.0):
        sched = slack_scheduler()
        sched.add(bounded(image_seq("big", 40, [(4, 32)]), 100.04))
        assert big_pass(sched) == [(0, 4)]
        sched.add(bounded(seq("other", 4, max_tokens=2), other_deadline))
        assert big_pass(sched)[0][0] == 4


def past_saving_prompt(monkeypatch, now: float = 100.0) -> Scheduler:
    """A scheduler whose "late" request (a 40-token prompt, 5 expected decode steps of 10 ms) can no longer meet its
    bound of 100.03 s, admitted with its first chunk; prompt chunks of at most 8 tokens for such a request."""
    monkeypatch.setattr(scheduler_module, "PAST_SAVING_CHUNK_TOKENS", 8)
    sched = slack_scheduler(now)
    sched.add(bounded(seq("late", 40), 100.03))
    assert chunks(step(sched)) == [("late", 0, 8)]  # admitted in its turn, in a small chunk
    return sched


def test_a_prompt_past_saving_yields_its_chunks_while_another_request_can_still_meet_its_bound(monkeypatch):
    # late's 8-token chunks beside small's steps would make small wait for each of them: none while small runs
    sched = past_saving_prompt(monkeypatch)
    sched.add(bounded(seq("small", 4, max_tokens=2), 200.0))
    assert chunks(step(sched)) == [("small", 0, 4)]
    assert chunks(step(sched)) == [("small", 4, 1)]  # small's decode, its last token
    assert sched.find("small") is None
    assert chunks(step(sched)) == [("late", 8, 8)]  # small gone: late's prompt goes on where it stopped


@pytest.mark.parametrize("now,yields", [(106.0, True), (106.1, False)], ids=["overdue-5.97-s", "overdue-6.07-s"])
def test_a_prompt_past_saving_yields_only_until_its_request_is_yield_overdue_s_past_its_deadline(monkeypatch, now,
                                                                                                yields):
    sched = past_saving_prompt(monkeypatch, now)
    sched.add(bounded(seq("small", 4, max_tokens=2), now + 100.0))
    assert (("late", 8, 8) in chunks(step(sched))) is not yields


def test_a_prompt_past_saving_runs_in_small_chunks_when_nobody_is_waiting_for_it(monkeypatch):
    sched = past_saving_prompt(monkeypatch)
    assert [chunks(step(sched)) for _ in range(4)] == [[("late", start, 8)] for start in (8, 16, 24, 32)]


def test_prompts_that_can_meet_their_bound_or_have_none_take_the_whole_budget(monkeypatch):
    monkeypatch.setattr(scheduler_module, "PAST_SAVING_CHUNK_TOKENS", 8)
    sched = slack_scheduler()
    sched.add(bounded(seq("in-time", 80), 200.0))
    sched.add(bounded(seq("offline", 80, first=100), None))
    assert [chunks(step(sched)) for _ in range(3)] == [  # the 64-token budget, oldest prompt first
        [("in-time", 0, 64)], [("in-time", 64, 16), ("offline", 0, 48)], [("in-time", 80, 1), ("offline", 48, 32)]]


def test_two_requests_past_saving_do_not_yield_to_each_other():
    # each misses its bound whatever happens (10 and 15 ms of slack after 3 decode steps, 32 ms passes): neither
    # is a request that can still meet its bound, so neither yields to the other; on a stopped clock, waiting for
    # each other would never end
    sched = slack_scheduler()
    sched.add(bounded(image_seq("big", 40, [(4, 32)]), 100.04))
    sched.add(bounded(image_seq("big2", 40, [(4, 32)]), 100.045))
    for _ in range(40):
        step(sched)
        if not sched.has_unfinished():
            break
    assert sched.find("big") is None and sched.find("big2") is None


def test_a_pass_does_not_wait_for_a_request_past_saving_that_yields_to_it():
    # "far" has 10 ms of slack, under the 12 ms of "mid"'s tower work, but misses its bound whatever happens (a
    # 32 ms pass): mid's image is encoded now rather than waiting for far, which yields its blocks to mid
    sched = slack_scheduler()
    sched.add(bounded(image_seq("far", 40, [(4, 32)]), 100.04))
    sched.add(bounded(image_seq("mid", 20, [(4, 12)]), 100.5))
    out = step(sched)
    assert [e.seq.request_id for e in out.encode_now] == ["mid"]
    assert sorted(chunks(out)) == [("far", 0, 4), ("mid", 0, 20)]


def test_a_request_past_saving_with_slack_left_does_not_keep_a_pass_from_running_whole():
    # "far" still has 10 ms of slack after its 3 decode steps, shorter than big's 32 ms pass, but its own 40-token
    # prompt (40 ms at 1 ms a token) makes it miss its bound whatever happens: big's pass runs whole
    sched = slack_scheduler()
    sched.step_clock.prefill_s_per_token = 0.001
    sched.add(image_seq("big", 40, [(0, 32)]))
    sched.add(bounded(seq("far", 40, max_tokens=3), 100.04))
    assert big_pass(sched) == [(0, 0)]


def test_before_any_step_with_tower_work_was_seen_a_pass_is_spread():
    sched = slack_scheduler()
    sched.step_clock = StepClock(decode_s=0.010)
    sched.add(bounded(seq("other", 4, max_tokens=50), deadline=200.0))
    sched.add(image_seq("big", 40, [(0, 32)]))
    assert big_pass(sched) == [(0, 4)]


def test_a_spread_pass_finishes_at_once_when_the_others_can_wait_for_the_rest():
    sched = slack_scheduler()
    other = bounded(seq("other", 4, max_tokens=50), deadline=100.06)
    sched.add(other)
    sched.add(image_seq("big", 40, [(0, 32)]))
    assert big_pass(sched) == [(0, 4)]
    other.deadline = 200.0  # (as if time had stood still for "other" while its bound grew)
    assert big_pass(sched) == [(4, 4)]  # the remaining 4 blocks in one step


def test_waiting_requests_with_a_bound_are_admitted_by_deadline_before_those_without():
    sched = slack_scheduler()
    for rid, deadline in [("offline", None), ("server", 112.0), ("interactive", 101.5), ("server-2", 112.5)]:
        sched.add(bounded(seq(rid, 4), deadline))
    assert [s.request_id for s in sched.waiting] == ["interactive", "server", "server-2", "offline"]


def test_the_step_clock_learns_the_engines_steps_and_outputs():
    clock = StepClock()
    clock.observe_step(0.5, tower_cost=100)  # tower work before any plain step: nothing to subtract it from yet
    assert clock.tower_s_per_cost is None
    for _ in range(30):
        clock.observe_step(0.020, tower_cost=0)
        clock.observe_step(0.120, tower_cost=100)
        clock.observe_output(40)
    assert clock.decode_s == pytest.approx(0.020) and clock.tower_s_per_cost == pytest.approx(0.001)
    assert clock.tower_s(500) == pytest.approx(0.5) and clock.output_tokens == pytest.approx(40)
    s = bounded(seq("r", 4, max_tokens=150), deadline=10.0)
    assert clock.slack(s, now=9.0) == pytest.approx(1.0 - 40 * 0.020)  # expected output, not max_tokens
    assert clock.slack(bounded(seq("x", 4), None), now=9.0) is None


def test_the_step_clocks_decode_steps_cost_more_as_the_engine_reads_more_context():
    # One H100's Interactive decode steps (run122): ~6 ms over 2k tokens of context, ~13 ms over 28k. A request's
    # slack counts its steps left at the context running and waiting now, not at the recent steps' mean
    clock = StepClock()
    for _ in range(10):
        for context in (2_000, 10_000, 28_000):
            clock.observe_step(0.0055 + 0.25e-6 * context, tower_cost=0, decode_context=context)
        clock.observe_output(40)
    assert clock.decode_step_s(28_000) == pytest.approx(0.0125, rel=0.02)
    assert clock.decode_step_s(2_000) == pytest.approx(0.006, rel=0.02)
    s = bounded(seq("r", 4, max_tokens=150), deadline=10.0)
    clock.load_context_tokens = 28_000
    assert clock.slack(s, now=9.0) == pytest.approx(1.0 - 40 * 0.0125, rel=0.02)
    clock.load_context_tokens = 2_000
    assert clock.slack(s, now=9.0) == pytest.approx(1.0 - 40 * 0.006, rel=0.02)


def test_a_decode_slope_fitted_on_long_contexts_never_makes_a_short_contexts_step_free():
    clock = StepClock()
    for context in (20_000, 30_000) * 10:  # 1 ms + 1 us a token: the line says 1 ms at no context
        clock.observe_step(0.001 + 1e-6 * context, tower_cost=0, decode_context=context)
    assert clock.decode_step_s(0) == pytest.approx(0.5 * clock.decode_s)


def test_a_step_with_tower_work_is_measured_beyond_a_decode_step_at_its_own_context():
    clock = StepClock()
    for context in (2_000, 30_000) * 10 + (2_000,) * 10:  # the recent decode steps read 2k tokens: ~5.5 ms
        clock.observe_step(0.005 + 0.25e-6 * context, tower_cost=0, decode_context=context)
    clock.observe_step(0.0125 + 0.100, tower_cost=100, decode_context=30_000)  # its decodes' share: 12.5 ms
    assert clock.tower_s(100) == pytest.approx(0.100, rel=0.01)


def test_the_scheduler_tells_its_step_clock_the_context_it_decodes_and_holds():
    sched = slack_scheduler()
    sched.step_clock = StepClock()
    sched.add(bounded(seq("a", 6), 101.5))
    sched.add(seq("b", 10))
    step(sched)  # both prompts
    out = step(sched)  # both decode: positions 6 and 10, so 7 + 11 tokens of context read
    assert sched.step_clock.load_context_tokens == 7 + 11  # as this step was scheduled
    sched.observe_step(0.010, out)
    assert sched.step_clock.decode_s == pytest.approx(0.010) and sched.step_clock.decode_context == 7 + 11


def test_the_held_context_is_summed_only_while_a_request_has_a_bound():
    sched = slack_scheduler()
    sched.add(seq("offline", 6))
    step(sched)
    assert sched.step_clock.load_context_tokens == 0  # no request asks for slack: the sum is skipped
    sched.add(bounded(seq("interactive", 10), 101.5))
    step(sched)
    assert sched.step_clock.load_context_tokens == 7 + 10
    sched.abort("interactive")
    step(sched)
    assert sched.step_clock.load_context_tokens == 0


def test_the_step_clock_learns_the_prompt_tokens_rate_from_steps_with_long_prompts():
    clock = StepClock()
    clock.observe_step(0.5, tower_cost=0, prompt_tokens=1000)  # no decode step yet to measure it beyond
    assert clock.prefill_s_per_token is None and clock.prefill_s(1000) == 0.0 and clock.decode_s is None
    clock.observe_step(0.020, tower_cost=0, prompt_tokens=100)  # a short prompt: a decode step's time
    assert clock.prefill_s_per_token is None and clock.decode_s == pytest.approx(0.020)
    clock.observe_step(0.070, tower_cost=0, prompt_tokens=1000)
    assert clock.prefill_s_per_token == pytest.approx(0.05 / 1000)
    assert clock.prefill_s(16000) == pytest.approx(0.8)
    assert clock.tower_s_per_cost is None  # no tower work seen yet


def test_the_step_clock_fits_the_tower_and_prompt_rates_jointly():
    # steps of 1 ms a unit of tower cost and 50 us a prompt token beyond a 20 ms decode step, mixed in varying parts
    clock = StepClock(decode_s=0.020)
    for cost, tokens in [(100, 1000), (10, 3000), (300, 500), (0, 2000), (50, 8000)] * 4:
        clock.observe_step(0.020 + 0.001 * cost + 0.00005 * tokens, cost, tokens)
    assert clock.tower_s(100) == pytest.approx(0.100) and clock.prefill_s(1000) == pytest.approx(0.050)


def test_slow_long_context_prompt_steps_do_not_take_the_tower_steps_time_from_their_towers():
    # As one H200 measured them (Interactive, run114): images' steps take 7 us a unit of tower cost and 18 us a
    # prompt token beyond a 5 ms decode step; the only steps with a long prompt and no tower work are second chunks
    # of long prompts over long context, at 39 us a token. Learnt from those alone, the prompt rate left the image
    # steps no tower time (0.1-2 us a unit); fitted over all steps, a 4,000 px image's tower stays within 10%.
    clock = StepClock(decode_s=0.005)
    for _ in range(2):
        clock.observe_step(0.005 + 39e-6 * 8192, 0, 8192)
    for _ in range(2):
        for cost, tokens in [(1520, 1750)] * 8 + [(56097, 8192)]:
            clock.observe_step(0.005 + 7e-6 * cost + 18e-6 * tokens, cost, tokens)
    assert clock.tower_s(163000) == pytest.approx(163000 * 7e-6, rel=0.1)
    rates = clock.tower_s_per_cost, clock.prefill_s_per_token
    clock.observe_step(0.005 + 39e-6 * 8192, 0, 8192)  # once images were seen, such a step is not fitted
    assert (clock.tower_s_per_cost, clock.prefill_s_per_token) == rates


def test_the_step_clocks_tower_rate_weighs_each_step_by_its_tower_work():
    # a small image's step is mostly fixed costs (10 ms beyond a decode step for 1 unit); a large one's 100 ms for
    # 100 units. The fit weighs each step by its size, so 100 units take ~0.1 s, where a running mean of the two
    # steps' rates (0.0082 s a unit) would say 0.82 s
    clock = StepClock(decode_s=0.010)
    clock.observe_step(0.020, tower_cost=1)
    clock.observe_step(0.110, tower_cost=100)
    assert clock.tower_s(100) == pytest.approx(0.100, rel=0.01)


def test_the_scheduler_learns_from_the_steps_the_engine_reports():
    sched = slack_scheduler()
    sched.step_clock = StepClock()
    sched.add(image_seq("big", 40, [(0, 32)]))
    out = step(sched)  # alone: the whole pass, 32 units
    sched.observe_step(0.010, SchedulerOutput(chunks=[]))  # an empty step teaches nothing
    assert sched.step_clock.decode_s is None
    sched.observe_step(0.010, step(sched))  # a decode step
    sched.observe_step(0.042, out)
    assert sched.step_clock.decode_s == pytest.approx(0.010)
    assert sched.step_clock.tower_s_per_cost == pytest.approx(0.032 / 32)


def test_work_encoded_ahead_counts_in_the_next_steps_time_not_in_the_step_that_queued_it():
    # The runner queues a step's encode_ahead behind its sampling: the step's time ends with its tokens, before that
    # work runs, and the next step's kernels follow it. "b"'s 8-row image is encoded ahead while "a" decodes.
    sched = encoder_scheduler(budget=8, encoder=8)
    sched.step_clock = StepClock(decode_s=0.010)
    sched.add(seq("a", 8))
    sched.add(image_seq("b", 16, [(0, 8)]))
    first = step(sched)  # a's prompt takes the budget; b's image is encoded ahead of b's first chunk
    assert encodes(first)["ahead"] == [("b", 0)] and not first.encoded_before
    second = step(sched)
    assert [e.key for e in second.encoded_before] == [("b", 0)] and not second.encode_now
    sched.observe_step(0.010, first)  # a plain step's time: the ahead work ran after it
    assert sched.step_clock.decode_s == pytest.approx(0.010) and sched.step_clock.tower_s_per_cost is None
    sched.observe_step(0.018, second)  # the 8 units of ahead work, 8 ms, are in this one's
    assert sched.step_clock.tower_s_per_cost == pytest.approx(0.008 / 8)
    assert not step(sched).encoded_before  # the second step encoded nothing ahead


def test_the_simulated_engine_charges_work_encoded_ahead_to_the_next_step():
    from workers.core.step_work import step_work

    sched = encoder_scheduler(budget=8, encoder=8)
    sched.add(seq("a", 8))
    sched.add(image_seq("b", 16, [(0, 8)]))
    first, second = step(sched), step(sched)
    assert step_work(first, 1).vision_patches == [] and step_work(second, 1).vision_patches == [8 * 4]


def test_a_tower_split_over_the_ranks_takes_their_share_of_work_a_step():
    from pathlib import Path

    base = dict(checkpoint=Path("simulated"), max_num_batched_tokens=8192, tensor_parallel_size=4)
    assert SchedulerLimits.of(EngineConfig(**base)).encoder_tokens == 8192  # rank 0 runs the whole tower
    split = SchedulerLimits.of(EngineConfig(**base, vision_tensor_parallel=True))
    assert split.encoder_tokens == 4 * 8192 and split.cache_tokens == 2 * 4 * 8192 + split.max_image_tokens
    chosen = EngineConfig(**base, vision_tensor_parallel=True, max_num_encoder_tokens=5000)
    assert SchedulerLimits.of(chosen).encoder_tokens == 5000  # a budget set in the config stays as set
