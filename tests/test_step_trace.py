"""The step trace (EngineConfig.step_trace_dir) and the step-model fit on it (issue 19, item 4): the real engine
writes one line per step with the work the simulated engine would charge for that step and its measured wall time;
plan_layout's fit finds the correction that maps the step model onto measured steps."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from contract.types import SamplingParams
from lab.plan.step_fit import fit_steps
from tests.helpers.arrival_trace import ARRIVALS, LIMITS, run
from workers.config import EngineConfig
from workers.core.step_trace import StepTrace, read_requests, read_steps
from workers.core.step_work import StepPhases, StepWork, median_phases_ms
from workers.engine import LLMEngine
from workers.sim.config import SimulationConfig
from workers.sim.engine import simulated
from workers.sim.step_model import StepCorrection, StepModel


def traced_work(directory: Path) -> list[dict]:
    return [dataclasses.asdict(work) for work, _ in read_steps(directory)]


def test_the_real_engine_traces_each_step_with_the_work_the_simulated_engine_charges(tiny_moe_checkpoint, tmp_path):
    one_at_a_time = dict(overlap_decode_steps=False, **LIMITS)  # run() counts the scheduler's calls as steps
    real = LLMEngine.from_config(EngineConfig(checkpoint=tiny_moe_checkpoint, step_trace_dir=str(tmp_path / "real"), **one_at_a_time))
    sim = simulated(
        EngineConfig(checkpoint=Path("simulated"), step_trace_dir=str(tmp_path / "sim"), **one_at_a_time),
        SimulationConfig(model="qwen3-vl-30b-a3b", output_tokens=1000),
        StepModel.build("h200", "qwen3-vl-30b-a3b"), realtime=False, vision=real.scheduler.limits.vision,
    )
    real_steps, _ = run(real)
    run(sim)
    real.close()
    sim.close()
    work = traced_work(tmp_path / "real")
    assert work == traced_work(tmp_path / "sim")
    assert len(work) == len(real_steps)  # every step did something on this trace: one line each
    # every prompt token is prefilled once, every image encoded (the 20-row one over two steps, half a tower each...)
    assert sum(w["prefill_tokens"] for w in work) == sum(len(p.token_ids) for _, _, p in ARRIVALS)
    assert sum(w["visual_prefill_tokens"] for w in work) == sum(p.token_ids.count(151655) for _, _, p in ARRIVALS)
    assert sum(sum(w["vision_shares"]) for w in work) == pytest.approx(sum(len(p.images) for _, _, p in ARRIVALS))
    # ... and each image size's first encode is a new cuDNN plan
    sizes = {patches for w in work for patches in w["vision_patches"]}
    assert sum(w["vision_plans"] for w in work) == len(sizes)
    assert all(ms > 0 for _, ms in read_steps(tmp_path / "real"))


def steps_of(model: StepModel) -> list[tuple[StepWork, float]]:
    """A spread of steps (decodes, prefill chunks, images whole and in part) timed by `model`."""
    works = []
    for i in range(40):
        works.append(StepWork(num_seqs=1 + i * 6, decode_context_tokens=(1 + i * 6) * 900))
        works.append(StepWork(num_seqs=4 + i % 5, prefill_tokens=500 + 190 * i, visual_prefill_tokens=100 * (i % 7),
                              decode_context_tokens=3 * 1200, vision_patches=[1024 * (1 + i % 4)] if i % 3 else [],
                              vision_shares=[1.0 if i % 2 else 0.25] if i % 3 else []))
    works.append(StepWork(vision_patches=[16384], vision_shares=[0.5]))  # a step of tower blocks alone
    return [(w, model.step_ms(w)) for w in works]


def test_the_fit_recovers_the_correction_that_timed_the_steps():
    model = StepModel.build("h200", "qwen3-vl-30b-a3b")
    truth = StepCorrection(text_scale=1.7, vision_scale=0.6, step_overhead_ms=3.5)
    report = fit_steps(model, steps_of(dataclasses.replace(model, correction=truth)))
    assert report["correction"] == pytest.approx({"text_scale": 1.7, "vision_scale": 0.6, "step_overhead_ms": 3.5},
                                                 rel=1e-3)
    assert report["after"]["window_rel_error_p90"] < 1e-3 < report["before"]["window_rel_error_p50"]
    assert report["after"]["predicted_busy_s"] == pytest.approx(report["measured_busy_s"], rel=1e-3)


def test_the_fit_reports_each_kind_of_step_against_the_fitted_model():
    """A kind of step the model does not price (here decode steps of 5 sequences at 1.25x) stands apart."""
    model = StepModel.build("h200", "qwen3-vl-30b-a3b")
    truth = dataclasses.replace(model, correction=StepCorrection(1.2, 0.8, 2.0))
    steps = steps_of(truth)
    odd = StepWork(num_seqs=5, decode_context_tokens=5 * 900)
    steps += [(odd, 1.25 * truth.step_ms(odd))] * 6
    kinds = fit_steps(model, steps)["after_by_kind"]
    assert kinds["decode, 5 sequences"]["steps"] == 6
    assert kinds["decode, 5 sequences"]["measured_over_model"] == pytest.approx(1.25, rel=0.02)
    assert kinds["decode, 1 sequence"]["measured_over_model"] == pytest.approx(1.0, rel=0.02)
    assert kinds["decode, 65 and over"]["measured_over_model"] == pytest.approx(1.0, rel=0.02)
    assert kinds["tower, 16,384-39,999 patches"]["steps"] == 1  # the step of tower blocks alone
    assert sum(kind["steps"] for kind in kinds.values()) == len(steps)
    measured_s = sum(ms for _, ms in steps) / 1e3
    assert sum(kind["measured_s"] for kind in kinds.values()) == pytest.approx(measured_s, rel=1e-3)


def test_time_that_lands_in_the_next_step_within_a_window_fits_the_same():
    """A step of tower blocks alone returns before its kernels end; its time shows up in the step after it."""
    model = StepModel.build("h200", "qwen3-vl-30b-a3b")
    steps = steps_of(dataclasses.replace(model, correction=StepCorrection(1.2, 0.8, 2.0)))
    shifted = list(steps)
    for i in range(0, len(steps) - 1, 2):  # half of each even step's time reported by its neighbour (same window)
        (w0, ms0), (w1, ms1) = steps[i], steps[i + 1]
        shifted[i], shifted[i + 1] = (w0, ms0 / 2), (w1, ms1 + ms0 / 2)
    assert fit_steps(model, shifted, window=2)["correction"] == fit_steps(model, steps, window=2)["correction"]


def test_a_negative_overhead_is_held_at_zero_and_the_scales_refitted():
    model = StepModel.build("h200", "qwen3-vl-30b-a3b")
    faster = dataclasses.replace(model, correction=StepCorrection(text_scale=0.9, vision_scale=1.2))
    steps = [(w, max(ms - 0.5, 0.01)) for w, ms in steps_of(faster)]  # less than no overhead at all
    correction = fit_steps(model, steps)["correction"]
    assert correction["step_overhead_ms"] == 0.0
    assert correction["text_scale"] == pytest.approx(0.9, rel=0.05)


def test_the_correction_applies_to_every_busy_step_and_round_trips_through_its_json(tmp_path):
    model = StepModel.build("h200", "qwen3-vl-30b-a3b")
    report = fit_steps(model, steps_of(dataclasses.replace(model, correction=StepCorrection(2.0, 1.0, 5.0))))
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(report))
    corrected = dataclasses.replace(model, correction=StepCorrection.load(path))
    decode = StepWork(num_seqs=64, decode_context_tokens=64 * 1024)
    assert corrected.step_ms(decode) == pytest.approx(2.0 * model.step_ms(decode) + 5.0, rel=1e-3)
    assert corrected.step_ms(StepWork()) == 0.0  # an idle step costs nothing


def test_a_malformed_trace_line_is_named_by_file_and_line(tmp_path):
    trace = StepTrace(tmp_path)
    trace.record(0.0, 0.01, StepWork(num_seqs=1), waiting=0, running=1)
    trace.close()
    with trace.path.open("a") as f:
        f.write('{"num_seqs": 2}\n')  # no "ms"
    with pytest.raises(ValueError, match=rf"{trace.path.name}:2: not a step-trace line"):
        read_steps(tmp_path)
    with pytest.raises(FileNotFoundError, match="no steps-"):
        read_steps((tmp_path / "empty").mkdir() or tmp_path / "empty")


def test_every_request_gets_one_line_with_its_times_in_order(tiny_moe_checkpoint, tmp_path):
    engine = LLMEngine.from_config(EngineConfig(checkpoint=tiny_moe_checkpoint, step_trace_dir=str(tmp_path), **LIMITS))
    run(engine)
    engine.close()
    lines = {line["request"]: line for line in read_requests(tmp_path)}
    assert set(lines) == {rid for _, rid, _ in ARRIVALS}
    for _, rid, prompt in ARRIVALS:
        line = lines[rid]
        assert line["prompt_tokens"] == len(prompt.token_ids)
        assert line["visual_tokens"] == prompt.token_ids.count(151655)
        assert line["submitted_s"] is None  # driven directly, not through a serving engine
        times = [line[k] for k in ("prepare_started_s", "prepared_s", "admitted_s", "first_scheduled_s",
                                   "first_token_s", "finished_s")]
        assert times == sorted(times), (rid, times)
        assert line["generated_tokens"] == 4 and line["finish_reason"] == "length"
    assert len(read_steps(tmp_path)) > 0  # the request lines do not disturb the steps


def test_a_served_request_records_its_wait_for_a_preparation_thread_and_an_abort_its_own_line(
        tiny_moe_checkpoint, tmp_path):
    import asyncio

    from contract.types import PromptInput, SamplingParams
    from workers.serve.async_engine import AsyncEngine

    served = AsyncEngine(LLMEngine.from_config(EngineConfig(checkpoint=tiny_moe_checkpoint, num_kv_blocks=64, max_model_len=128,
                                                            step_trace_dir=str(tmp_path))))

    async def main():
        done = [o async for o in served.generate("whole", PromptInput([1, 2, 3]), SamplingParams(max_tokens=3))]
        async for _ in served.generate("left", PromptInput([4, 5]), SamplingParams(max_tokens=50)):
            break  # leaving the stream aborts the request
        return done

    try:
        done = asyncio.run(main())
    finally:
        served.shutdown()
    assert done[-1].finished
    lines = {line["request"]: line for line in read_requests(tmp_path)}
    assert lines["whole"]["submitted_s"] <= lines["whole"]["prepare_started_s"] <= lines["whole"]["prepared_s"]
    assert lines["whole"]["finish_reason"] == "length" and lines["left"]["finish_reason"] == "abort"


def test_request_phases_split_each_request_at_its_trace_points(tiny_moe_checkpoint, tmp_path):
    from workers.core.step_trace import PHASES, request_phases

    engine = LLMEngine.from_config(EngineConfig(checkpoint=tiny_moe_checkpoint, step_trace_dir=str(tmp_path), **LIMITS))
    run(engine)
    engine.close()
    lines = read_requests(tmp_path)
    report = request_phases(lines)
    assert report["requests"] == len(ARRIVALS) and report["aborted"] == 0
    # no serving engine: no wait for a preparation thread; every other phase is timed, and they add up
    assert set(report["phases"]) == {name for name, _, _ in PHASES} - {"prepare_wait_s"}
    for line in lines:
        assert sum(line[b] - line[a] for _, a, b in PHASES[1:]) == pytest.approx(line["finished_s"] - line["prepare_started_s"])
    assert report["slowest_1pct"]["requests"] == 1


def test_a_trace_without_request_lines_says_so(tmp_path):
    from workers.core.step_trace import request_phases

    with pytest.raises(ValueError, match="no request lines"):
        request_phases([])


def test_a_step_correction_with_the_bench_validation_or_of_a_missing_file_is_refused_not_ignored(capsys, tmp_path):
    from lab.plan.layout_plan import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--validate", "--step-correction", "none"])
    assert exit_info.value.code == 2
    assert "--step-correction goes with --validate --product-path or a search" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--step-correction", str(tmp_path / "fit.json")])
    assert exit_info.value.code == 2
    assert "fit.json: no such file" in capsys.readouterr().err


def test_a_search_takes_the_product_paths_own_fit_unless_told_none_and_the_replay_none_unless_given():
    from lab.plan.layout_plan import parse_args
    from workers.sim.step_model import PRODUCT_PATH_FIT, StepCorrection

    assert parse_args([]).step_correction == PRODUCT_PATH_FIT
    assert parse_args(["--step-correction", "none"]).step_correction is None
    assert parse_args(["--validate", "--product-path"]).step_correction is None
    fit = StepCorrection.load(PRODUCT_PATH_FIT)  # the committed fit is a correction, not the identity
    assert fit.text_scale > 1 and fit.vision_scale < 1 and fit.step_overhead_ms > 0


def test_each_step_splits_its_wall_time_into_the_host_s_part_and_the_wait_for_the_device(tiny_moe_checkpoint, tmp_path):
    # the simulated engine in real time sleeps each step's modelled device time inside execute: its wait
    sim = simulated(
        EngineConfig(checkpoint=Path("simulated"), step_trace_dir=str(tmp_path / "sim"), **LIMITS),
        SimulationConfig(model="qwen3-vl-30b-a3b", output_tokens=1000, time_scale=20.0),
        StepModel.build("h200", "qwen3-vl-30b-a3b"), realtime=True,
    )
    sim.add_request("r", ARRIVALS[3][2], SamplingParams(temperature=0.0, max_tokens=3))
    while sim.has_unfinished():
        started = time.monotonic()
        sim.step()
        wall = time.monotonic() - started
        phases = sim.last_step_phases
        assert phases.wait == pytest.approx(sim.executor.last_wait_s) and phases.wait > 0
        assert 0 < phases.host < phases.schedule + phases.execute + phases.update <= wall
        assert phases.host == pytest.approx(phases.schedule + phases.execute - phases.wait + phases.update)
    sim.close()
    # the real engine on the CPU waits for nothing: every step is host time, and its trace lines say so
    real = LLMEngine.from_config(EngineConfig(checkpoint=tiny_moe_checkpoint, step_trace_dir=str(tmp_path / "real"), **LIMITS))
    run(real)
    real.close()
    lines = [line for line in _trace_lines(tmp_path / "real") if "request" not in line]
    assert lines and all(set(line["phases_ms"]) == {"schedule", "execute", "wait", "update", "host"} for line in lines)
    for phases in (line["phases_ms"] for line in lines):  # the token read-back returns at once: microseconds
        assert phases["wait"] <= 0.05 and phases["execute"] > 0
        assert phases["host"] == pytest.approx(phases["schedule"] + phases["execute"] + phases["update"], abs=0.06)


def _trace_lines(directory: Path) -> list[dict]:
    return [json.loads(text) for path in sorted(directory.glob("steps-*.jsonl")) for text in path.read_text().splitlines()]


def test_phase_medians_are_taken_per_phase():
    steps = [StepPhases(0.001, 0.010, 0.008, 0.002), StepPhases(0.003, 0.020, 0.010, 0.001),
             StepPhases(0.002, 0.030, 0.025, 0.004)]
    assert median_phases_ms([step.ms() for step in steps]) == {"schedule": 2.0, "execute": 20.0, "wait": 10.0, "update": 2.0, "host": 11.0}  # hosts 5, 14, 11


def test_a_traces_step_phases_are_summed_by_kind_of_step(tiny_moe_checkpoint, tmp_path, capsys):
    from lab.plan import layout_plan
    from workers.core.step_trace import read_step_lines, step_kind, step_phases

    assert [step_kind(line) for line in ({"num_seqs": 3, "prefill_tokens": 0}, {"num_seqs": 2, "prefill_tokens": 40},
            {"num_seqs": 1, "prefill_tokens": 0, "vision_patches": [64]}, {"num_seqs": 0, "vision_patches": [4096]})] \
        == ["decode", "prompt", "prompt", "tower"]
    real = LLMEngine.from_config(EngineConfig(checkpoint=tiny_moe_checkpoint, step_trace_dir=str(tmp_path / "real"), **LIMITS))
    run(real)
    real.close()
    lines = read_step_lines(tmp_path / "real")
    summary = step_phases(lines)
    kinds = summary["by_kind"]
    assert summary["steps"] == len(lines) and summary["untimed_steps"] == 0 and {"decode", "prompt"} <= set(kinds)
    assert sum(k["steps"] for k in kinds.values()) == len(lines)
    assert sum(k["seconds"] for k in kinds.values()) == pytest.approx(sum(line["ms"] for line in lines) / 1e3, abs=0.01)
    assert all(0.9 <= k["host_share"] <= 1.05 for k in kinds.values())  # the CPU waits for no device
    layout_plan.main(["--step-phases", str(tmp_path / "real")])
    assert json.loads(capsys.readouterr().out) == summary
    # a trace from before the phases says so, naming the flag
    with pytest.raises(SystemExit, match="--step-phases .*no step line carries phases_ms"):
        layout_plan.main(["--step-phases", str(Path(__file__).parents[1] / "benchmarks" / "2026-12-01-run60-server-steps.jsonl.gz")])


def test_each_request_line_places_its_tower_passes_and_prompt_chunks(tiny_moe_checkpoint, tmp_path):
    from workers.core.step_trace import TIMELINE, request_timeline

    engine = LLMEngine.from_config(EngineConfig(checkpoint=tiny_moe_checkpoint, step_trace_dir=str(tmp_path), **LIMITS))
    run(engine)
    engine.close()
    lines = {line["request"]: line for line in read_requests(tmp_path)}
    for _, rid, prompt in ARRIVALS:
        line = lines[rid]
        # every prompt token in exactly one traced chunk, in order, before the first token
        assert sum(tokens for _, _, tokens in line["prefill_s"]) == len(prompt.token_ids), rid
        assert [a for a, _, _ in line["prefill_s"]] == sorted(a for a, _, _ in line["prefill_s"])
        assert all(line["admitted_s"] <= a <= b <= line["first_token_s"] for a, b, _ in line["prefill_s"]), rid
        # one pass per image, each over before the first token
        assert len(line["tower_s"]) == len(prompt.images), rid
        assert all(line["admitted_s"] <= a < b <= line["first_token_s"] for a, b in line["tower_s"]), rid
        phases = request_timeline(line)
        assert list(phases) == list(TIMELINE) and all(v >= 0 for v in phases.values()), (rid, phases)
        # the phases add up to the request's time (rounded to microseconds each)
        assert sum(phases.values()) == pytest.approx(line["finished_s"] - line["prepare_started_s"], abs=1e-5)
        assert line["t0_unix_s"] == pytest.approx(time.time(), abs=600)
    # the image spread over two steps (its tower pass is twice a step's encoder budget) spans both, and its line
    # says what the scheduler weighed (no latency bound here: no slack, not past saving); the others have no such pass
    decision = lines["big"]["tower_decision"]
    assert decision["slack_s"] is None and decision["past_saving"] is False and decision["others"] >= 0
    assert [rid for _, rid, _ in ARRIVALS if "tower_decision" in lines[rid]] == ["big"]
    big_span = lines["big"]["tower_s"][0]
    steps = [line for line in map(json.loads, next(tmp_path.glob("steps-*.jsonl")).read_text().splitlines())
             if "request" not in line and big_span[0] <= line["t_s"] < big_span[1]]
    assert len(steps) >= 2


def test_a_timeline_splits_a_request_into_phases_that_add_up():
    from workers.core.step_trace import request_timeline

    line = {"request": "q1-s0", "submitted_s": 0.0, "prepare_started_s": 0.1, "prepared_s": 0.3, "admitted_s": 0.3,
            "first_scheduled_s": 0.5, "first_token_s": 1.6, "finished_s": 2.0, "finish_reason": "stop",
            # a pass spread over 0.4-0.9 (the first of its steps also ran another prompt), its chunks 0.8-0.9 and
            # 1.2-1.5; other requests' steps 0.9-1.2 and 1.5-1.6
            "tower_s": [[0.4, 0.9]], "prefill_s": [[0.8, 0.9, 8], [1.2, 1.5, 8]]}
    assert request_timeline(line) == pytest.approx(
        {"preprocess_s": 0.3, "queue_s": 0.1, "tower_s": 0.4, "prefill_s": 0.4, "stalled_s": 0.4, "decode_s": 0.4})
    assert request_timeline({**line, "finish_reason": "abort"}) is None
    old = {k: v for k, v in line.items() if k not in ("tower_s", "prefill_s")}  # written before the spans existed
    assert request_timeline(old) is None
