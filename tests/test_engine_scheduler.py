"""Scheduler and block manager on their own (no model): token budget, chunked prefill, preemption,
prefix caching, and EngineConfig validation."""

from __future__ import annotations

import pydantic
import pytest

from contract.types import FinishReason, SamplingParams
from workers.block_manager import BlockManager
from workers.config import EngineConfig
from workers.scheduler import Scheduler, SchedulerLimits
from workers.sequence import Sequence

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


def test_next_prompts_are_the_unfinished_prefills_then_the_waiting_requests_the_budget_reaches():
    def second_step(long_prompt: int):
        sched, _ = make(budget=8)
        for rid, n in (("decoding", 3), ("long", long_prompt), ("fits", 4), ("beyond", 4), ("unreached", 4)):
            sched.add(seq(rid, n))
        step(sched)  # "decoding" whole, 5 tokens of "long"
        out = sched.schedule()  # a decode of "decoding", the next 7 tokens of "long"
        assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("decoding", 1), ("long", 7)]
        return [s.request_id for s in sched.next_prompts(out)]

    # "long" done: 1 token for each decode, 6 left for "fits" (4) and 2 of "beyond"; none reach "unreached".
    assert second_step(long_prompt=12) == ["fits", "beyond"]
    # 8 tokens of "long" left: with the decode they take the whole budget.
    assert second_step(long_prompt=20) == ["long"]


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
    ],
)
def test_bad_engine_config_names_the_key(settings, key):
    with pytest.raises(pydantic.ValidationError, match=key):
        EngineConfig(checkpoint="x", **settings)


def test_the_memory_profile_step_fills_the_budget_with_sequences_no_longer_than_max_model_len():
    from workers.decode_graphs import full_budget_batch

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
