"""engine.overlap_decode_steps: while a step runs on the device, the engine applies it, schedules the next step and
launches it behind it (its pending input tokens read there from the running step's samples), then reads the first
step's tokens back and puts them in place: vLLM's async scheduling, for every kind of step (prompt chunks, images,
decodes, preemption). The tokens, finish reasons and outputs are those of the engine that runs one step at a time;
with no stop token the steps themselves are too. A sequence that stops has its look-ahead row dropped."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from contract.types import FinishReason, PromptInput, SamplingParams
from contract.vision_geometry import image_geometry
from tests.helpers.image_fixtures import png
from workers.config import EngineConfig
from workers.core.sequence import PENDING_TOKEN
from workers.engine import LLMEngine
from workers.executor.model_runner import LaunchedTokens
from workers.request_options import RequestOptions

VISION_START, VISION_END, IMAGE_PAD = 151652, 151653, 151655
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 64
LIMITS = dict(num_kv_blocks=96, block_size=4, max_model_len=160, max_num_seqs=8, max_num_batched_tokens=64,
              min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


@dataclass(frozen=True)
class Request:
    prompt: PromptInput
    max_tokens: int
    arrival: int = 0  # the engine step after which it is added


def text(i: int, n: int) -> PromptInput:
    return PromptInput([1000 + 37 * i + j for j in range(n)])


def with_image(i: int, width: int, height: int, n_text: int) -> PromptInput:
    image = png(width, height, seed=i)
    visual = image_geometry(image, MIN_PIXELS, MAX_PIXELS).num_tokens
    ids = [151644, 872, 198, VISION_START] + [IMAGE_PAD] * visual + [VISION_END] + text(i, n_text).token_ids
    return PromptInput(ids, [image])


# Prompts of many lengths, some over several chunks of a step's budget, some arriving while others decode.
TEXT = {f"t{i}": Request(text(i, 5 + 9 * i), 6 + 3 * i, arrival=(0, 0, 2, 3, 7)[i]) for i in range(5)}
IMAGES = {
    "one": Request(with_image(1, 64, 64, 6), 8),
    "two": Request(PromptInput(with_image(2, 96, 64, 3).token_ids + with_image(3, 64, 96, 4).token_ids,
                               with_image(2, 96, 64, 3).images + with_image(3, 64, 96, 4).images), 7, arrival=1),
    "text": Request(text(4, 30), 9, arrival=2),
    "late": Request(with_image(5, 128, 64, 5), 6, arrival=6),
}
SCENARIOS = {
    "chunked text prompts": (TEXT, dict(max_num_batched_tokens=16)),
    "images over chunked prompts": (IMAGES, dict(max_num_batched_tokens=12)),
    "images encoded ahead, whole prompts": (IMAGES, {}),
    "a KV pool too small: preemption": ({rid: Request(r.prompt, 12) for rid, r in TEXT.items()},
                                        dict(num_kv_blocks=14, max_num_batched_tokens=24)),
}


def engine(checkpoint, overlap: bool, **limits) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(checkpoint=checkpoint, overlap_decode_steps=overlap, **{**LIMITS, **limits}))


def run(eng: LLMEngine, requests: dict[str, Request], stops: dict[str, int] | None = None,
        abort_at: tuple[int, str] | None = None) -> dict[str, tuple[list[int], FinishReason | None]]:
    """Adds each request after its arrival step, aborts a request after some step; steps until all have finished."""
    stops = stops or {}
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    reasons: dict[str, FinishReason | None] = {}
    step = 0
    while eng.has_unfinished() or any(r.arrival >= step for r in requests.values()):
        for rid, r in requests.items():
            if r.arrival == step:
                eng.add_request(rid, r.prompt, SamplingParams(
                    temperature=0.0, max_tokens=r.max_tokens,
                    stop_token_ids=frozenset({stops[rid]} if rid in stops else ())))
        for out in eng.step():
            assert PENDING_TOKEN not in out.new_token_ids
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.request_id not in reasons, f"{out.request_id} finished twice"
                reasons[out.request_id] = out.finish_reason
        step += 1
        if abort_at and step == abort_at[0]:
            assert eng.abort(abort_at[1])
        assert step < 500
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return {rid: (tokens[rid], reasons.get(rid)) for rid in requests}


def launches(eng: LLMEngine) -> list[tuple[bool, int, int]]:
    """Spies on the runner: per launched step, (queued behind a running step, prompt rows, images encoded)."""
    calls, launch = [], eng.executor.launch

    def spy(out, after=None):
        prompt = sum(c.num_tokens for c in out.chunks if c.start < c.seq.num_prompt_tokens)
        calls.append((after is not None, prompt, len(out.encode_now) + len(out.encode_ahead)))
        return launch(out, after)

    eng.executor.launch = spy
    return calls


def schedules(eng: LLMEngine) -> list[list[tuple[str, int, int]]]:
    """Spies on the scheduler: the chunks of every step it schedules, in order."""
    steps, schedule = [], eng.scheduler.schedule

    def spy():
        out = schedule()
        steps.append([(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks])
        return out

    eng.scheduler.schedule = spy
    return steps


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_overlapped_steps_give_the_tokens_of_steps_run_one_at_a_time(tiny_moe_checkpoint, scenario):
    requests, limits = SCENARIOS[scenario]
    plain = engine(tiny_moe_checkpoint, overlap=False, **limits)
    one_at_a_time = run(plain, requests)
    overlapping = engine(tiny_moe_checkpoint, overlap=True, **limits)
    queued = launches(overlapping)
    assert run(overlapping, requests) == one_at_a_time
    assert all(reason is FinishReason.LENGTH for _, reason in one_at_a_time.values())
    assert [len(tokens) for tokens, _ in one_at_a_time.values()] == [r.max_tokens for r in requests.values()]
    # steps carrying prompt rows were launched behind running steps, not only decode-only ones
    assert sum(behind for behind, _, _ in queued) > len(queued) / 2
    assert any(behind and prompt for behind, prompt, _ in queued)
    if requests is IMAGES:
        assert any(behind and images for behind, _, images in queued)
    if "preemption" in scenario:
        assert plain.scheduler.num_preemptions > 0 and overlapping.scheduler.num_preemptions > 0


@pytest.mark.parametrize("scenario", ["images over chunked prompts", "a KV pool too small: preemption"])
def test_with_every_request_there_from_the_start_and_no_stop_token_the_steps_are_those_of_one_at_a_time(
        tiny_moe_checkpoint, scenario):
    requests, limits = SCENARIOS[scenario]
    at_once = {rid: Request(r.prompt, r.max_tokens) for rid, r in requests.items()}
    plain, overlapping = engine(tiny_moe_checkpoint, False, **limits), engine(tiny_moe_checkpoint, True, **limits)
    expected, got = schedules(plain), schedules(overlapping)
    assert run(overlapping, at_once) == run(plain, at_once)
    # the overlapping engine schedules each step a call early, from the applied state: the same decisions (and, after
    # the last step, a look-ahead that finds nothing to run)
    assert [s for s in got if s] == [s for s in expected if s] and len(expected) > 10


def test_a_stop_token_drops_the_row_sampled_ahead_and_an_abort_ends_the_request_once(tiny_moe_checkpoint):
    requests, limits = SCENARIOS["chunked text prompts"]
    plain = run(engine(tiny_moe_checkpoint, False, **limits), requests)
    # t3 and t4 stop on a token each samples mid-way (its first occurrence), t1 is aborted while decoding (one that is
    # there from the start: a request added after a step is admitted a step later when the next step was scheduled
    # while that one ran)
    stops = {"t3": plain["t3"][0][5], "t4": plain["t4"][0][6]}
    one_at_a_time = run(engine(tiny_moe_checkpoint, False, **limits), requests, stops, abort_at=(5, "t1"))
    overlapping = engine(tiny_moe_checkpoint, True, **limits)
    queued = launches(overlapping)
    got = run(overlapping, requests, stops, abort_at=(5, "t1"))
    assert got == one_at_a_time
    for rid in stops:
        tokens, reason = got[rid]
        assert reason is FinishReason.STOP and tokens.index(stops[rid]) == len(tokens) - 1 < requests[rid].max_tokens - 1
    assert got["t1"][1] is FinishReason.ABORT and 0 < len(got["t1"][0]) < requests["t1"].max_tokens
    assert any(behind for behind, _, _ in queued)


def drain(eng: LLMEngine) -> dict[str, tuple[list[int], FinishReason | None]]:
    got: dict[str, tuple[list[int], FinishReason | None]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            tokens, _ = got.get(out.request_id, ([], None))
            got[out.request_id] = (tokens + out.new_token_ids, out.finish_reason)
    return got


def test_a_prefill_only_request_and_its_kv_imported_elsewhere_overlap_too(tiny_moe_checkpoint):
    prompt, greedy = IMAGES["one"].prompt, SamplingParams(temperature=0.0, max_tokens=8)
    whole = run(engine(tiny_moe_checkpoint, False), {"whole": Request(prompt, 8)})["whole"][0]
    prefill, decode = engine(tiny_moe_checkpoint, True), engine(tiny_moe_checkpoint, True)
    prefill.add_request("p", prompt, greedy, RequestOptions(prefill_only=True))
    prefill.add_request("beside", text(1, 20), greedy)  # keeps steps launching behind p's
    first, reason = drain(prefill)["p"]
    assert len(first) == 1 and reason in (FinishReason.LENGTH, FinishReason.STOP)
    export = prefill.export_kv("p")  # held until released: the step behind its last one did not touch its blocks
    assert prefill.release("p") and prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks
    decode.add_request("p", prompt, SamplingParams(temperature=0.0, max_tokens=7), RequestOptions(kv_import=export))
    decode.add_request("beside", text(2, 9), greedy)
    rest, _ = drain(decode)["p"]
    assert first + rest == whole


def test_a_step_that_fails_to_launch_behind_a_running_one_fails_its_requests_and_the_rest_go_on(tiny_moe_checkpoint):
    requests, limits = SCENARIOS["chunked text prompts"]
    eng = engine(tiny_moe_checkpoint, True, **limits)
    launch, failed = eng.executor.launch, []

    def fail_once_behind(out, after=None):
        if after is not None and not failed and any(c.seq.request_id == "t2" for c in out.chunks):
            failed.extend(c.seq.request_id for c in out.chunks)
            raise RuntimeError("injected")
        return launch(out, after)

    eng.executor.launch = fail_once_behind
    got = run(eng, requests)
    assert "t2" in failed
    assert {rid for rid, (_, reason) in got.items() if reason is FinishReason.ERROR} == set(failed)
    assert all(reason is FinishReason.LENGTH for rid, (_, reason) in got.items() if rid not in failed)


def test_a_step_whose_tokens_cannot_be_read_fails_with_the_step_queued_behind_it(tiny_moe_checkpoint, monkeypatch):
    requests, limits = SCENARIOS["chunked text prompts"]
    eng = engine(tiny_moe_checkpoint, True, **limits)
    steps, launch, waits, read = [], eng.executor.launch, [], LaunchedTokens.wait

    def recorded(out, after=None):
        steps.append({c.seq.request_id for c in out.chunks})
        return launch(out, after)

    def wait(self):
        waits.append(self)
        if len(waits) == 5:
            raise RuntimeError("injected")
        return read(self)

    eng.executor.launch = recorded
    monkeypatch.setattr(LaunchedTokens, "wait", wait)
    got = run(eng, requests)
    # the fifth step's wait failed: its requests, and those of the sixth, launched behind it, end with the error
    assert {rid for rid, (_, reason) in got.items() if reason is FinishReason.ERROR} == steps[4] | steps[5]
    assert all(reason is FinishReason.LENGTH for rid, (_, reason) in got.items() if rid not in steps[4] | steps[5])


def test_an_engine_that_cannot_queue_steps_ahead_says_so_and_runs_them_one_at_a_time(caplog, monkeypatch):
    from pathlib import Path

    from workers.sim.config import SimulationConfig
    from workers.sim.engine import SimulatedExecutor, simulated
    from workers.sim.step_model import StepModel

    # as a multi-GPU instance's executor: it cannot launch a step behind a running one
    monkeypatch.setattr(SimulatedExecutor, "can_overlap", property(lambda self: False))
    with caplog.at_level("INFO"):
        sim = simulated(EngineConfig(checkpoint=Path("simulated"), overlap_decode_steps=True, **LIMITS),
                        SimulationConfig(model="qwen3-vl-30b-a3b"), StepModel.build("h200", "qwen3-vl-30b-a3b"),
                        realtime=False)
    assert "cannot queue steps ahead" in caplog.text and not sim._overlap
    sim.add_request("x", text(0, 5), SamplingParams(temperature=0.0, max_tokens=5))
    while sim.has_unfinished():
        sim.step()
        assert not sim.step_in_flight
    assert sim._launched is None


def test_an_overlapping_engine_says_when_a_step_is_in_flight_behind_the_one_applied(tiny_moe_checkpoint):
    """What a profiled window counts: from an idle engine, n step() calls launch n + 1 steps, the last in flight."""
    eng = engine(tiny_moe_checkpoint, True)
    assert not eng.step_in_flight
    eng.add_request("x", text(0, 5), SamplingParams(temperature=0.0, max_tokens=4))
    eng.step()
    assert eng.step_in_flight
    while eng.has_unfinished():
        eng.step()
    assert not eng.step_in_flight


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
    requests, limits = SCENARIOS["images over chunked prompts"]
    at_once = {rid: Request(r.prompt, r.max_tokens) for rid, r in requests.items()}

    def cuda_engine(overlap: bool) -> LLMEngine:
        return engine(tiny_moe_checkpoint, overlap, device="cuda", dtype="bfloat16", enforce_eager=enforce_eager,
                      warm_up=False, **limits)

    # every request from the start, ends by length only: the same steps either way, so the same kernels see the same
    # rows and bf16 gives the same tokens
    expected = run(cuda_engine(False), at_once)
    overlapping = cuda_engine(True)
    queued = launches(overlapping)
    assert run(overlapping, at_once) == expected
    assert sum(behind for behind, _, _ in queued) > len(queued) / 2 and any(behind and p for behind, p, _ in queued)
    # a stop token: the stopped request ends on it, once; (the step after it carries one row more than one step at a
    # time would, so the other requests' bf16 tokens are not compared across the two)
    stop = expected["one"][0][3]
    got = run(cuda_engine(True), at_once, {"one": stop})
    assert got["one"][1] is FinishReason.STOP and got["one"][0][-1] == stop and got["one"][0].count(stop) == 1
    for rid, (tokens, reason) in got.items():
        assert reason in (FinishReason.LENGTH, FinishReason.STOP) and len(tokens) <= at_once[rid].max_tokens
        assert reason is FinishReason.STOP or len(tokens) == at_once[rid].max_tokens
