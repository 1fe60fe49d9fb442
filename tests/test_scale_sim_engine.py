"""The simulated engine (workers.sim.engine.simulated): the real scheduler's semantics (budget, max_num_seqs, KV
blocks), token counts, KV hand-off."""

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from contract.stats import poisson_arrivals
from contract.tokenizer import IM_END_ID as EOS_ID, IMAGE_PAD_ID
from contract.types import FinishReason, PromptInput, SamplingParams
from lab.plan.virtual import VirtualCluster, Workload
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.request_options import RequestOptions
from workers.sim.config import SimulationConfig
from workers.sim.engine import simulated
from workers.sim.step_model import Calibration, StepModel

PROMPT = PromptInput([1] * 100 + [IMAGE_PAD_ID] * 64 + [2] * 36)
RUN9 = Path(__file__).resolve().parent.parent / "benchmarks" / "2026-11-30-run9-30b-a3b.json"


def engine(realtime: bool = False, **kw) -> LLMEngine:
    config = EngineConfig(checkpoint=Path("simulated"), max_num_seqs=kw.pop("max_num_seqs", 8),
                          max_num_batched_tokens=kw.pop("budget", 256), num_kv_blocks=kw.pop("blocks", 256))
    sim = SimulationConfig(model="qwen3-vl-30b-a3b", output_tokens=kw.pop("output_tokens", 5), **kw)
    return simulated(config, sim, StepModel.build("h200", "qwen3-vl-30b-a3b"), realtime=realtime)


def run_all(e: LLMEngine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while e.has_unfinished():
        for out in e.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_requests_generate_output_tokens_then_eos():
    e = engine(output_tokens=5)
    e.add_request("a", PROMPT, SamplingParams(max_tokens=150))
    e.add_request("b", PROMPT, SamplingParams(max_tokens=3))
    outs = run_all(e)
    a_tokens = [t for o in outs["a"] for t in o.new_token_ids]
    assert len(a_tokens) == 5 and a_tokens[-1] == EOS_ID and outs["a"][-1].finish_reason is FinishReason.STOP
    assert outs["b"][-1].num_generated_tokens == 3 and outs["b"][-1].finish_reason is FinishReason.LENGTH


def test_each_step_stays_within_the_token_budget_and_max_num_seqs():
    e = engine(budget=128, max_num_seqs=2)
    for i in range(4):
        e.add_request(f"r{i}", PROMPT, SamplingParams(max_tokens=150))
    while e.has_unfinished():
        out = e.scheduler.schedule()
        assert out.num_batched_tokens <= 128 and len(out.chunks) <= 2
        e.scheduler.update(out, e.executor.execute(out))


def test_step_time_charges_prefill_vision_and_decode():
    e = engine(budget=512)
    e.add_request("a", PROMPT, SamplingParams(max_tokens=150))
    e.step()  # the whole 200-token prompt with its 64-token image
    prefill = e.executor.last_step_s
    e.step()
    decode = e.executor.last_step_s
    m = e.executor.step_model
    c = m.calibration
    assert prefill * 1e3 == pytest.approx(  # the engine's first image of 256 patches: cuDNN builds its plan
        c.base_ms(201, m.model.expert_share) + c.visual_token_extra_ms * 64 + m.vision_ms(256) + c.vision_plan_ms,
        rel=1e-6)
    assert 0 < decode < prefill


def prefill_alone_s(e: LLMEngine, rid: str, prompt: PromptInput) -> float:
    """The step that prefills `prompt` on an otherwise idle engine; the request is then run to its end."""
    e.add_request(rid, prompt, SamplingParams(max_tokens=150))
    e.step()
    step_s = e.executor.last_step_s
    run_all(e)
    return step_s


def test_only_the_first_image_of_a_size_pays_the_cudnn_plan():
    e = engine(budget=512)
    plan_s = e.executor.step_model.calibration.vision_plan_ms / 1e3
    first, second = prefill_alone_s(e, "a", PROMPT), prefill_alone_s(e, "b", PROMPT)
    assert plan_s > 0 and first - second == pytest.approx(plan_s)
    other = PromptInput([1] * 100 + [IMAGE_PAD_ID] * 100)  # a new size: 400 patches
    assert prefill_alone_s(e, "c", other) - prefill_alone_s(e, "d", other) == pytest.approx(plan_s)
    assert e.executor.encoded_sizes == {256, 400}


def test_a_calibration_without_a_tower_bench_charges_no_plan():
    e = engine(budget=512)
    session2 = Calibration.from_bench(RUN9)  # session-2 code
    e.executor.step_model = dataclasses.replace(e.executor.step_model, calibration=session2)
    assert prefill_alone_s(e, "a", PROMPT) == pytest.approx(prefill_alone_s(e, "b", PROMPT))


def test_a_prompt_longer_than_the_kv_pool_fails_with_a_reason():
    e = engine(blocks=4)  # 64 tokens
    e.add_request("big", PROMPT, SamplingParams())
    (out,) = run_all(e)["big"]
    assert out.finish_reason is FinishReason.ERROR and "KV blocks" in out.error


def test_prefill_only_hands_its_kv_to_a_decode_engine():
    p, d = engine(), engine()
    p.add_request("x", PROMPT, SamplingParams(max_tokens=150), RequestOptions(prefill_only=True))
    (first,) = [o for outs in run_all(p).values() for o in outs]
    kv = p.export_kv("x")
    assert kv.num_tokens == len(PROMPT.token_ids) and kv.first_token_id == first.new_token_ids[0]
    assert p.release("x") and p.block_manager.num_free_blocks == p.block_manager.num_blocks
    d.add_request("x", PROMPT, SamplingParams(max_tokens=150), RequestOptions(kv_import=kv))
    tokens = [t for o in run_all(d)["x"] for t in o.new_token_ids]
    assert len(tokens) == 5
    # five batch-1 decode steps; no prefill charged on the decode side
    assert d.executor.busy_s < 5 * 0.013 < 5 * p.executor.busy_s


def test_async_engine_serves_the_simulated_engine_in_real_time():
    from workers.serve.async_engine import AsyncEngine

    e = engine(realtime=True)
    wrapped = AsyncEngine(e)

    async def go():
        return [o async for o in wrapped.generate("a", PROMPT, SamplingParams(max_tokens=150))]

    started = time.monotonic()
    try:
        outs = asyncio.run(go())
    finally:
        wrapped.shutdown()
    assert outs[-1].finished and outs[-1].num_generated_tokens == 5
    # its steps lasted what the step model says of them (slept out: time_scale 1), not the microseconds they compute
    assert time.monotonic() - started >= e.executor.busy_s > 0.05


def test_least_loaded_beats_round_robin_at_the_tail_or_ties():
    config = EngineConfig(checkpoint=Path("simulated"), max_num_seqs=256)
    sim = SimulationConfig(model="qwen3-vl-30b-a3b")
    model = StepModel.build("h200", "qwen3-vl-30b-a3b")
    arrivals = poisson_arrivals(20.0, 200, seed=1)
    p99 = {}
    for policy in ("round_robin", "least_loaded"):
        result = VirtualCluster(config, sim, {"aggregated": model}, {"aggregated": 4}, policy).run(arrivals, Workload())
        assert len(result.latencies_s) == 200
        p99[policy] = result.percentile(0.99)
    assert p99["least_loaded"] <= p99["round_robin"] * 1.05


def test_a_requests_latency_bound_becomes_its_deadline_on_the_engines_clock():
    e = engine()
    e.scheduler.clock = lambda: 50.0
    prepared = e.prepare_request("bounded", PROMPT, SamplingParams(max_tokens=5))
    prepared.submitted, prepared.latency_bound_s = prepared.prepare_ended - 0.25, 1.5  # it waited 0.25 s to be prepared
    e.add_prepared(prepared)
    e.add_prepared(e.prepare_request("unbounded", PROMPT, SamplingParams(max_tokens=5)))
    assert e.scheduler.find("bounded").deadline == pytest.approx(51.25)
    assert e.scheduler.find("unbounded").deadline is None
    run_all(e)
    assert e.scheduler.step_clock.decode_s is not None  # the steps it ran, as the step model timed them


def test_the_async_engine_hands_a_requests_latency_bound_to_the_engine():
    from workers.serve.async_engine import AsyncEngine

    e = engine(realtime=True, time_scale=0.01)
    deadlines, add = {}, e.add_prepared

    def recording_add(prepared):
        add(prepared)
        seq = e.scheduler.find(prepared.request_id)
        deadlines[prepared.request_id] = None if seq is None else seq.deadline - e.scheduler.clock()

    e.add_prepared = recording_add
    wrapped = AsyncEngine(e)

    async def go():
        return [o async for o in wrapped.generate("a", PROMPT, SamplingParams(max_tokens=5),
                                                    RequestOptions(latency_bound_s=12.0))]

    try:
        asyncio.run(go())
    finally:
        wrapped.shutdown()
    assert 11.0 < deadlines["a"] <= 12.0  # 12 s from its hand-over, less its wait to be prepared
