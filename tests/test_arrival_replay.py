"""A measured run's own arrivals replayed on the step model (lab/plan/arrival_replay.py, plan_layout.py
--replay-arrivals): each traced request joins when it was prepared, with its catalogue sample's prompt and its bound."""

import json
from pathlib import Path

import pytest

from lab.bench.catalogue_workload import realistic_catalogue
from lab.plan.arrival_replay import replay_arrivals, trace_arrivals
from lab.plan.layout_plan import main
from lab.plan.planner_validation import product_path_model
from workers.config import EngineConfig

ENGINE = EngineConfig(checkpoint=Path("simulated"), max_num_seqs=64, max_num_batched_tokens=8192)


@pytest.fixture(scope="module")
def catalogue():
    return realistic_catalogue(8, 0, "v6.1")


def line(catalogue, sample: int, submitted: float, latency: float, query: int = 1) -> dict:
    """A finished request's step-trace line as the engine writes it (only the fields the replay reads)."""
    prompt = catalogue[sample].prompt.token_ids
    return {"request": f"q{query}-s{sample}#1", "submitted_s": submitted, "prepared_s": submitted + 0.01,
            "prompt_tokens": len(prompt), "visual_tokens": prompt.count(151655), "generated_tokens": 45,
            "finished_s": submitted + latency, "finish_reason": "length"}


def test_requests_replay_in_their_measured_order_and_a_burst_waits_for_itself(catalogue):
    model = product_path_model(weights="fp8", kv_dtype="fp8")
    spread = [line(catalogue, s, 10.0 * s, 0.5, query=s) for s in range(8)]
    burst = [line(catalogue, s, 0.001 * s, 0.5 + s, query=s) for s in range(8)]
    warm_up = {"request": "warmup-aggregated-0", "submitted_s": 0.0}
    alone = replay_arrivals(model, trace_arrivals(spread), catalogue, ENGINE, bound_s=1.5)
    together = replay_arrivals(model, trace_arrivals([warm_up, *reversed(burst)]), catalogue, ENGINE, bound_s=1.5)
    assert alone["requests"] == together["requests"] == 8
    assert together["measured"] == {"over": 6, "over_largest_image": 1, "p50_s": 4.5, "p99_s": 7.5}  # 0.5 ... 7.5 s
    assert alone["replayed"]["over"] == 0 and 0.1 < alone["replayed"]["p50_s"] < 1.0
    assert together["replayed"]["p99_s"] > alone["replayed"]["p99_s"]


def test_a_trace_from_another_catalogue_is_refused_by_request(catalogue):
    model = product_path_model(weights="fp8", kv_dtype="fp8")
    wrong = line(catalogue, 3, 0.0, 0.5)
    wrong["prompt_tokens"] += 47  # v6.0's prompt is 47 tokens longer
    with pytest.raises(ValueError, match=r"q1-s3#1.*1834 in the trace"):
        replay_arrivals(model, trace_arrivals([wrong]), catalogue, ENGINE, bound_s=1.5)
    with pytest.raises(ValueError, match="sample 9 is not in the 8-sample catalogue"):
        replay_arrivals(model, trace_arrivals([line(catalogue, 1, 0.0, 0.5) | {"request": "q1-s9"}]), catalogue,
                        ENGINE, bound_s=1.5)
    with pytest.raises(ValueError, match="'offline-7': no catalogue sample"):
        trace_arrivals([line(catalogue, 1, 0.0, 0.5) | {"request": "offline-7"}])


def test_plan_layout_replays_a_trace_file_with_its_bound(catalogue, tmp_path, capsys):
    trace = tmp_path / "steps-1.jsonl"
    trace.write_text("".join(json.dumps(line(catalogue, s, 0.3 * s, 0.4, query=s)) + "\n" for s in range(8)))
    main(["--replay-arrivals", str(trace), "--bound-s", "1.5", "--workload-samples", "8", "--weights", "fp8",
          "--kv-dtype", "fp8", "--max-num-seqs", "64"])
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 8 and report["bound_s"] == 1.5 and report["measured"]["over"] == 0
    assert report["step_correction"] == "2026-12-01-run60-step-fit.json" and report["engine"]["max_num_seqs"] == 64
    with pytest.raises(SystemExit):
        main(["--replay-arrivals", str(trace)])
    assert "go together" in capsys.readouterr().err


def test_a_burst_replays_with_its_large_pass_beside_the_steps(catalogue):
    """engine.vision_green_sms: a pass larger than the step's encoder budget (sample 5's 2,209-row image against
    2,048, arriving behind two others) runs beside the steps; a step that only starts it lasts no time, which is
    not a stall."""
    model = product_path_model(weights="fp8", kv_dtype="fp8")
    burst = trace_arrivals([line(catalogue, s, 0.02 * i, 0.5, query=s) for i, s in enumerate((0, 1, 5))])
    settings = dict(checkpoint=Path("simulated"), max_num_seqs=64, max_num_batched_tokens=8192,
                    max_num_encoder_tokens=2048)
    spread = replay_arrivals(model, burst, catalogue, EngineConfig(**settings), bound_s=1.5)
    beside = replay_arrivals(model, burst, catalogue, EngineConfig(**settings, device="cuda", vision_green_sms=64),
                             bound_s=1.5)
    assert spread["requests"] == beside["requests"] == 3
    assert beside["replayed"] != spread["replayed"]  # the pass ran whole beside the steps, not a share a step
