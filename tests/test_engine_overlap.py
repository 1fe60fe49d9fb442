"""engine.overlap_decode_steps: while a decode-only step runs, the engine queues the next one (its input tokens read on
the device from the running step's samples) before applying the first. The tokens, finish reasons and outputs are
those of the engine that runs one step at a time; a sequence that stops has its look-ahead token dropped."""

from __future__ import annotations

import pytest

from contract.types import FinishReason, PromptInput, SamplingParams
from workers.config import EngineConfig
from workers.core.scheduler import ScheduledChunk, SchedulerOutput
from workers.engine import LLMEngine

LIMITS = dict(num_kv_blocks=96, block_size=4, max_model_len=96, max_num_seqs=8, max_num_batched_tokens=64)
PROMPTS = {f"r{i}": [1000 + 37 * i + j for j in range(5 + 3 * i)] for i in range(5)}
MAX_TOKENS = {"r0": 12, "r1": 20, "r2": 7, "r3": 16, "r4": 20}


def engine(checkpoint, overlap: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(checkpoint=checkpoint, overlap_decode_steps=overlap, **LIMITS))


def run(eng: LLMEngine, stops: dict[str, int] | None = None, abort_at: tuple[int, str] | None = None,
        late: int = 3) -> dict[str, tuple[list[int], FinishReason | None]]:
    """Three requests at once, two more after `late` steps; an abort of a request after some step."""
    stops = stops or {}

    def add(rid: str) -> None:
        sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[rid],
                                  stop_token_ids=frozenset({stops[rid]} if rid in stops else ()))
        eng.add_request(rid, PromptInput(PROMPTS[rid]), sampling)

    for rid in ("r0", "r1", "r2"):
        add(rid)
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    reasons: dict[str, FinishReason | None] = {}
    step = 0
    while eng.has_unfinished() or step <= late:
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.request_id not in reasons, f"{out.request_id} finished twice"
                reasons[out.request_id] = out.finish_reason
        step += 1
        if step == late:
            add("r3")
            add("r4")
        if abort_at and step == abort_at[0]:
            assert eng.abort(abort_at[1])
        assert step < 500
    return {rid: (tokens[rid], reasons.get(rid)) for rid in PROMPTS}


def launches(eng: LLMEngine) -> list[bool]:
    """Spies on the runner: for each launched decode step, whether it was queued behind a running one."""
    calls, launch = [], eng.runner.launch_decodes

    def spy(out, after=None):
        calls.append(after is not None)
        return launch(out, after)

    eng.runner.launch_decodes = spy
    return calls


def test_overlapped_decode_steps_give_the_tokens_of_steps_run_one_at_a_time(tiny_moe_checkpoint):
    one_at_a_time = run(engine(tiny_moe_checkpoint, overlap=False))
    overlapping = engine(tiny_moe_checkpoint, overlap=True)
    queued = launches(overlapping)
    assert run(overlapping) == one_at_a_time
    assert all(reason is FinishReason.LENGTH for _, reason in one_at_a_time.values())
    assert [len(tokens) for tokens, _ in one_at_a_time.values()] == list(MAX_TOKENS.values())
    # the decode-only stretches ran overlapped: most launches were queued behind a running step
    assert sum(queued) > len(queued) / 2 and not all(queued)
    assert not overlapping.has_unfinished() and overlapping.block_manager.num_free_blocks == LIMITS["num_kv_blocks"]


def test_a_stop_token_drops_the_token_sampled_ahead_and_an_abort_ends_the_request_once(tiny_moe_checkpoint):
    plain = run(engine(tiny_moe_checkpoint, overlap=False))
    # r1 and r4 stop on a token each samples mid-way (its first occurrence), r0 is aborted while decoding
    stops = {"r1": plain["r1"][0][6], "r4": plain["r4"][0][9]}
    one_at_a_time = run(engine(tiny_moe_checkpoint, overlap=False), stops, abort_at=(9, "r0"))
    overlapping = engine(tiny_moe_checkpoint, overlap=True)
    queued = launches(overlapping)
    got = run(overlapping, stops, abort_at=(9, "r0"))
    assert got == one_at_a_time
    assert got["r1"][1] is FinishReason.STOP and got["r1"][0][-1] == stops["r1"]
    assert got["r1"][0].index(stops["r1"]) == len(got["r1"][0]) - 1 < MAX_TOKENS["r1"] - 1
    assert got["r4"][1] is FinishReason.STOP
    assert got["r0"][1] is FinishReason.ABORT and len(got["r0"][0]) < MAX_TOKENS["r0"]
    assert any(queued)
    assert overlapping.block_manager.num_free_blocks == LIMITS["num_kv_blocks"]


def test_the_next_decodes_are_scheduled_ahead_only_when_they_surely_follow(tiny_moe_checkpoint):
    eng = engine(tiny_moe_checkpoint, overlap=False)
    for rid, n in (("a", 3), ("b", 30)):
        eng.add_request(rid, PromptInput(PROMPTS["r1"]), SamplingParams(temperature=0.0, max_tokens=n))
    eng.step()  # both prompts
    eng.step()  # a's second token
    s = eng.scheduler
    out = s.schedule()
    assert out.is_decode_only and len(out.chunks) == 2
    a, b = (c.seq for c in out.chunks)
    bm = eng.block_manager
    free, need = bm.num_free_blocks, bm.blocks_needed(b, b.num_tokens + 1)
    ahead = s.schedule_next_decodes(out)
    # a's third token (this step's) is its last: only b goes on, one position further, its blocks taken now
    assert ahead is not None and [(c.seq.request_id, c.start, c.num_tokens) for c in ahead.chunks] == [("b", b.num_tokens, 1)]
    assert bm.num_free_blocks == free - need and len(b.block_table) * LIMITS["block_size"] >= b.num_tokens + 1
    # nothing is scheduled ahead while a request waits for admission, or for a step that is not decodes alone
    eng.add_request("c", PromptInput(PROMPTS["r2"]), SamplingParams(temperature=0.0, max_tokens=4))
    assert s.schedule_next_decodes(out) is None
    assert s.schedule_next_decodes(SchedulerOutput(chunks=[ScheduledChunk(a, 0, 2)])) is None


def test_an_engine_that_cannot_queue_steps_ahead_says_so_and_runs_them_one_at_a_time(caplog):
    from pathlib import Path

    from workers.sim.config import SimulationConfig
    from workers.sim.engine import SimulatedEngine
    from workers.sim.step_model import StepModel

    with caplog.at_level("WARNING"):
        sim = SimulatedEngine(EngineConfig(checkpoint=Path("simulated"), overlap_decode_steps=True, **LIMITS),
                              SimulationConfig(model="qwen3-vl-30b-a3b"), StepModel.build("h200", "qwen3-vl-30b-a3b"),
                              realtime=False)
    assert "cannot queue steps ahead" in caplog.text
    sim.add_request("x", PromptInput(PROMPTS["r0"]), SamplingParams(temperature=0.0, max_tokens=5))
    while sim.has_unfinished():
        sim.step()
    assert sim._launched is None


@pytest.mark.parametrize("overlap", [False, True])
def test_overlap_is_an_engine_setting_off_by_default(tiny_moe_checkpoint, overlap):
    assert EngineConfig(checkpoint=tiny_moe_checkpoint).overlap_decode_steps is False
    assert engine(tiny_moe_checkpoint, overlap)._overlap is overlap


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["cuda-graphs", "eager"])
def test_on_cuda_overlapped_steps_read_their_inputs_on_the_device_and_give_the_same_tokens(tiny_moe_checkpoint,
                                                                                           enforce_eager):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    def cuda_engine(overlap: bool) -> LLMEngine:
        return LLMEngine(EngineConfig(checkpoint=tiny_moe_checkpoint, device="cuda", dtype="bfloat16",
                                      enforce_eager=enforce_eager, warm_up=False, overlap_decode_steps=overlap, **LIMITS))

    # ends by length only: every step has the same sequences either way, so the same kernels see the same rows
    expected = run(cuda_engine(False))
    overlapping = cuda_engine(True)
    queued = launches(overlapping)
    assert run(overlapping) == expected
    assert sum(queued) > len(queued) / 2
    # a stop token: the stopped request ends on it, once; (the step after it carries one row more than one step at a
    # time would, so the other requests' bf16 tokens are not compared across the two)
    stop = expected["r1"][0][6]
    got = run(cuda_engine(True), {"r1": stop})
    assert got["r1"][1] is FinishReason.STOP and got["r1"][0][-1] == stop and got["r1"][0].count(stop) == 1
    for rid in ("r0", "r2", "r3", "r4"):
        tokens, reason = got[rid]
        assert reason in (FinishReason.LENGTH, FinishReason.STOP) and len(tokens) <= MAX_TOKENS[rid]
        assert reason is FinishReason.STOP or len(tokens) == MAX_TOKENS[rid]
