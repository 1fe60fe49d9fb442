"""The knee search of scripts/sim_sweep.py and what it measures per point: the search itself, LoadGen's trace,
latency drift, the engine/overhead split, and the simulated engine's streaming interval and request trace."""

import contextlib
import io
import json
from pathlib import Path

from contract.tokenizer import IM_END_ID as EOS_ID, IMAGE_PAD_ID
from contract.types import PromptInput, SamplingParams
from lab.plan.latency import kept_up
from lab.plan.sim_sweep import latency_drift, latency_split, loadgen_latencies, main, search_knee
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.sim.config import SimulationConfig
from workers.sim.engine import simulated
from workers.sim.step_model import StepModel
from workers.sim.trace import TracedRequest, read_traces

PROMPT = PromptInput([1] * 40 + [IMAGE_PAD_ID] * 16 + [2] * 8)


def test_search_steps_up_while_points_pass_then_bisects_once():
    knee, tried = search_knee(lambda qps: qps <= 3000, start=2000, factor=1.5, refine=1)
    assert tried == [2000, 3000, 4500, 3750]
    assert knee == 3000


def test_search_steps_down_while_points_fail():
    knee, tried = search_knee(lambda qps: qps <= 1000, start=2000, factor=2, refine=1)
    assert tried == [2000, 1000, 1500]
    assert knee == 1000


def test_search_gives_up_after_max_points_with_no_pass():
    knee, tried = search_knee(lambda qps: False, start=100, factor=2, max_points=3)
    assert knee is None and tried == [100, 50, 25]


def _trace_line(ts_us: float, latency_s: float) -> str:
    return ('{"name":"Latency","ph": "C","pid":1,"ts":%.3f,"args":{ "issue_delay":250,"issue_to_done":%d}},\n'
            % (ts_us, latency_s * 1e9))


def test_loadgen_trace_latencies_are_read_in_issue_order(tmp_path):
    trace = tmp_path / "mlperf_log_trace.json"
    trace.write_text('{"traceEvents":[\n' + _trace_line(2e6, 0.5) + '{"name":"Sample","ph":"b"},\n'
                     + _trace_line(1e6, 0.25) + "]}\n")
    assert loadgen_latencies(trace) == [(1.0, 0.25, 2.5e-7), (2.0, 0.5, 2.5e-7)]


def test_a_growing_backlog_shows_as_latency_drift():
    steady = [(t, 1.0 + 0.01 * (t % 3), 0.0) for t in range(100)]
    growing = [(t, 1.0 + 0.05 * t, 0.0) for t in range(100)]
    assert latency_drift(steady) < 1.05
    assert latency_drift(growing) > 1.25


def test_latency_split_adds_a_requests_prefill_and_decode_segments():
    rows = [(0.0, 10.0, 0.0), (1.0, 12.0, 0.0)]
    traced = [TracedRequest("q1-s0#1", 0.0, 3.0, 0.5), TracedRequest("q1-s0#2", 4.0, 9.0, 0.0),
              TracedRequest("q2-s1#1", 1.0, 12.0, 1.0)]
    split = latency_split(rows, traced, time_scale=10)
    assert split["requests_traced"] == 2
    assert split["engine_mean_s"] == (8.0 + 11.0) / 2 / 10
    assert split["overhead_mean_s"] == (11.0 - 9.5) / 10
    assert split["engine_overrun_mean_s"] == (0.5 + 1.0) / 2 / 10


def _engine(tmp_path: Path | None = None, **kw) -> LLMEngine:
    config = EngineConfig(checkpoint=Path("simulated"), max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=64)
    sim = SimulationConfig(model="qwen3-vl-30b-a3b", output_tokens=6, time_scale=1e-3,
                           trace_dir=str(tmp_path) if tmp_path else None, **kw)
    return simulated(config, sim, StepModel.build("h200", "qwen3-vl-30b-a3b"), realtime=tmp_path is not None)


def _tokens_per_output(e: LLMEngine) -> dict[str, list[list[int]]]:
    outputs: dict[str, list[list[int]]] = {}
    while e.has_unfinished():
        for out in e.step():
            outputs.setdefault(out.request_id, []).append(out.new_token_ids)
    return outputs


def test_a_long_stream_interval_hands_out_the_first_token_then_the_rest_at_the_end():
    every, coalesced = _engine(), _engine(stream_interval=64)
    for e in (every, coalesced):
        e.add_request("a", PROMPT, SamplingParams(max_tokens=150))
    per_token, bundled = _tokens_per_output(every)["a"], _tokens_per_output(coalesced)["a"]
    assert [len(t) for t in per_token] == [1] * 6
    assert [len(t) for t in bundled] == [1, 5]
    assert sum(bundled, []) == sum(per_token, []) and bundled[-1][-1] == EOS_ID


def test_a_stream_interval_of_two_hands_out_tokens_in_pairs():
    e = _engine(stream_interval=2)
    e.add_request("a", PROMPT, SamplingParams(max_tokens=150))
    assert [len(t) for t in _tokens_per_output(e)["a"]] == [1, 2, 2, 1]


def test_a_traced_engine_writes_one_line_per_finished_request(tmp_path):
    e = _engine(tmp_path)
    e.add_request("a", PROMPT, SamplingParams(max_tokens=150))
    e.add_request("b", PROMPT, SamplingParams(max_tokens=2))
    _tokens_per_output(e)
    traced = {t.request_id: t for t in read_traces(tmp_path)}
    assert set(traced) == {"a", "b"}
    assert all(t.t_out >= t.t_in and t.overrun_s >= 0 for t in traced.values())


def test_a_cluster_that_falls_behind_completes_fewer_queries_than_it_was_given():
    steady = [(t / 100, 1.0, 0.0) for t in range(1000)]
    behind = [(t / 100, 1.0 + t / 200, 0.0) for t in range(1000)]  # served at 2/3 of the offered rate
    assert abs(kept_up(steady) - 1.0) < 0.01
    assert kept_up(behind) < 0.8


def test_virtual_points_give_latency_and_kept_up_per_layout_at_the_per_engine_rate():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--virtual", "--hardware", "vera-rubin", "--model", "qwen3-vl-235b-a22b", "--weights", "fp4",
              "--kv-dtype", "fp8", "--workers", "72", "--layouts", "aggregated,disaggregated",
              "--policies", "round_robin", "--start-qps", "720", "--simulated-seconds", "1"])
    points = json.loads(out.getvalue())["points"]
    assert [(p["layout"], p["qps"]) for p in points] == [("aggregated", 720.0), ("disaggregated", 720.0)]
    assert all(0 < p["p50_s"] <= p["p99_s"] < 12 for p in points)
