"""The simulated engine makes the real engine's scheduling decisions: for the same requests arriving at the same
steps, the same chunks every step and the same images encoded in the same steps (now or ahead), so that what the
step model charges for vision is what the real runner runs; with engine.overlap_decode_steps (each step scheduled
while the one before runs) too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.arrival_trace import ARRIVALS, LIMITS, run
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sim.config import SimulationConfig
from workers.sim.engine import simulated
from workers.sim.step_model import StepModel


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


def test_a_simulated_pass_beside_the_steps_slows_them_as_measured_and_its_rows_wait_for_its_end():
    """engine.vision_green_sms on the step model: a 4,000 px image's pass starts whole beside the steps, takes
    132 / 64 times its time alone; the decoding request's steps beside it take (132 / 68)^0.6 times theirs; the
    image's rows are computed only once the pass has ended on the executor's clock."""
    from contract.tokenizer import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID
    from contract.types import PromptInput, SamplingParams
    from tests.helpers.scheduler_spies import record_encodes
    from workers.sim.engine import BESIDE_STEP_EXPONENT

    model = StepModel.build("h200", "qwen3-vl-30b-a3b")
    config = EngineConfig(checkpoint=Path("simulated"), device="cuda", vision_green_sms=64)
    sim = simulated(config, SimulationConfig(model="qwen3-vl-30b-a3b", output_tokens=1000), model, realtime=False)
    executor = sim.executor
    sim.add_request("text", PromptInput(list(range(1, 101))), SamplingParams(max_tokens=900))  # past the pass
    sim.step()  # its prompt: it decodes from now on
    image = [1, 2, VISION_START_ID] + [IMAGE_PAD_ID] * 15_625 + [VISION_END_ID, 3]
    sim.add_request("big", PromptInput(image), SamplingParams(max_tokens=2))
    encoded = record_encodes(sim)
    steps, run = [], executor._run

    def spy(work, passes=()):
        started = executor.now_s
        run(work, passes)
        steps.append((started, work, executor.last_step_s))
    executor._run = spy
    first_image_rows = None
    while first_image_rows is None:
        before = executor.now_s
        sim.step()
        if any(work.visual_prefill_tokens for _, work, _ in steps[-1:]) and steps[-1][0] == before:
            first_image_rows = before
    assert [kind for _, rid, kind in encoded if rid == "big"] == ["blocks 0-26"]  # whole, in one step
    start = steps[0][0]
    end = start + model.vision_ms(62_500) * model.correction.vision_scale / 1e3 * 132 / 64
    assert first_image_rows >= end - 1e-9  # the rows wait for the pass
    beside = [(s, work, length) for s, work, length in steps if s + length <= end and work.num_seqs == 1]
    assert len(beside) > 10  # the decodes went on beside the pass
    factor = (132 / 68) ** BESIDE_STEP_EXPONENT
    for _, work, length in beside:
        assert length == pytest.approx(model.step_ms(work) / 1e3 * factor)
