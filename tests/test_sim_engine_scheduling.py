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
