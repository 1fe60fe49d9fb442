"""The simulated engine makes the real engine's scheduling decisions: for the same requests arriving at the same
steps, the same chunks every step and the same images encoded in the same steps (now or ahead), so that what the
step model charges for vision is what the real runner runs; with engine.overlap_decode_steps (each step scheduled
while the one before runs) too."""

from __future__ import annotations

from pathlib import Path

import pytest

from image_fixtures import png
from scheduler_spies import record_encodes
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sim.config import SimulationConfig
from workers.sim.engine import simulated
from workers.sim.step_model import StepModel
from contract.tokenizer import IM_END_ID, IM_START_ID, IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID
from contract.types import FinishReason, PromptInput, SamplingParams
from contract.vision_geometry import image_geometry

MIN_PIXELS, MAX_PIXELS = 4096, 65536
LIMITS = dict(num_kv_blocks=48, block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=24,
              max_num_encoder_tokens=24, encoder_cache_tokens=32, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
MAX_TOKENS = 4


def prompt(images: list[bytes], text: int) -> PromptInput:
    ids = [IM_START_ID, 872, 198]
    for data in images:
        ids += [VISION_START_ID] + [IMAGE_PAD_ID] * image_geometry(data, MIN_PIXELS, MAX_PIXELS).num_tokens
        ids += [VISION_END_ID]
    return PromptInput(ids + list(range(1000, 1000 + text)) + [IM_END_ID, 198], images)


# (arrival step, request id, prompt): images of 4, 12 and 20 rows (the last beyond the encoder budget), a prompt
# with two images, text alone, and arrivals while others prefill and decode.
ARRIVALS = [
    (0, "small", prompt([png(64, 64, seed=1)], 6)),
    (0, "two", prompt([png(128, 96, seed=2), png(64, 64, seed=3)], 3)),
    (0, "big", prompt([png(160, 128, seed=4)], 2)),
    (1, "text", prompt([], 9)),
    (2, "late", prompt([png(128, 96, seed=5)], 5)),
    (3, "later", prompt([png(64, 64, seed=6)], 30)),
]


def run(engine) -> tuple[list, list]:
    """Every step's chunks (request, start, tokens) and every encode (step, request, now/ahead)."""
    encodes = record_encodes(engine)
    steps, finished = [], {}
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        steps.append([(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks])
        return out

    engine.scheduler.schedule = spy
    step = 0
    while engine.has_unfinished() or any(s >= step for s, _, _ in ARRIVALS):
        for s, rid, p in ARRIVALS:
            if s == step:
                engine.add_request(rid, p, SamplingParams(max_tokens=MAX_TOKENS))
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
        step += 1
    assert finished == {rid: FinishReason.LENGTH for _, rid, _ in ARRIVALS}
    return steps, encodes


@pytest.mark.parametrize("overlap", [False, True], ids=["one-step-at-a-time", "overlapped-steps"])
@pytest.mark.parametrize("encode_ahead", [True, False])
def test_the_simulated_engine_schedules_and_encodes_as_the_real_engine_does(tiny_moe_checkpoint, encode_ahead, overlap):
    settings = dict(encode_ahead=encode_ahead, overlap_decode_steps=overlap, **LIMITS)
    real = LLMEngine.from_config(EngineConfig(checkpoint=tiny_moe_checkpoint, **settings))
    sim = simulated(
        EngineConfig(checkpoint=Path("simulated"), **settings),
        SimulationConfig(model="qwen3-vl-30b-a3b", output_tokens=1000),
        StepModel.build("h200", "qwen3-vl-30b-a3b"), realtime=False, vision=real.scheduler.limits.vision,
    )
    real_steps, real_encodes = run(real)
    sim_steps, sim_encodes = run(sim)
    assert sim_steps == real_steps
    assert sim_encodes == real_encodes
    # the trace exercises what it is for: every image encoded once, some ahead (when on), and the 20-row image,
    # costlier than a step's budget, in a pass spread over two steps while other prompts go on
    whole = [(rid, kind) for _, rid, kind in real_encodes if kind in ("now", "ahead")]
    assert len(whole) + 1 == sum(len(p.images) for _, _, p in ARRIVALS)
    assert any(kind == "ahead" for _, kind in whole) == encode_ahead
    assert [kind for _, rid, kind in real_encodes if rid == "big"] == ["blocks 0-1", "blocks 2-2"]
