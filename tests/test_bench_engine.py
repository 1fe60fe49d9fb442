"""scripts/bench_engine.py's CPU smoke mode runs our engine on random tiny weights and reports every figure."""

from __future__ import annotations

import json

import pytest

from lab.bench import engine as bench_engine


def test_tiny_smoke_mode_prints_one_json_object_with_every_figure(tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = bench_engine.main(["--shape", "tiny", "--samples", "2", "--skip-baseline", "--out", str(out)])
    printed = json.loads(capsys.readouterr().out)
    assert printed == result == json.loads(out.read_text())
    assert {"shape", "num_layers", "device", "date", "workload", "ours"} <= set(result)
    ours = result["ours"]
    assert {"prefill_tokens_per_s", "decode", "vision_ms_per_image", "catalogue", "kv_blocks"} <= set(ours)
    assert set(ours["decode"]) == {"1", "4"}
    assert all(d["tokens_per_s"] > 0 for d in ours["decode"].values())
    for d in ours["decode"].values():  # where each step's time went: on the CPU all of it is the host's
        phases = d["phases_ms_median"]
        assert set(phases) == {"schedule", "execute", "wait", "update", "host"}
        assert phases["wait"] < phases["host"] <= d["step_ms_median"] * 1.05
    catalogue = ours["catalogue"]
    assert catalogue["samples"] == 2 and catalogue["samples_per_s"] > 0
    # a 128x128 JPEG is raised to 64 visual tokens; 32 text tokens; 10 of the chat template
    assert catalogue["prompt_tokens"]["max"] == 64 + 32 + 10 and catalogue["visual_tokens"]["median"] == 64
    assert catalogue["output_tokens"]["mean"] == result["workload"]["output_tokens"]
    assert 0 < catalogue["preprocess_done_s"] <= catalogue["wall_s"]
    # every sample's one image goes through the tower exactly once (nothing preempted in a run this small)
    assert catalogue["preemptions"] == 0 and catalogue["vision_encodes"]["images"] == 2
    assert 1 <= catalogue["vision_encodes"]["calls"] <= 2
    # the run records how it was asked for, and prepares images on the engine's own pool size, as the worker does
    assert result["args"]["samples"] == 2 and result["args"]["skip_baseline"] is True
    assert ours["preprocess_threads"] == 4
    first = ours["catalogue_prepared_first"]  # the A/B: every request prepared before the first step
    assert first["samples"] == 2 and 0 < first["engine_wall_s"] <= first["wall_s"]


def test_catalogue_only_runs_the_catalogue_once_with_the_asked_sequence_limit(capsys):
    result = bench_engine.main(["--shape", "tiny", "--samples", "2", "--skip-baseline", "--catalogue-only",
                                "--max-num-seqs", "1"])
    capsys.readouterr()
    ours = result["ours"]
    assert result["workload"]["max_num_seqs"] == 1 and ours["catalogue"]["samples"] == 2
    assert not {"decode", "prefill_tokens_per_s", "vision_ms_per_image", "catalogue_prepared_first"} & set(ours)
    # one sequence at a time: the two samples' images go through the tower in two calls
    assert ours["catalogue"]["vision_encodes"] == {"calls": 2, "images": 2, "images_per_call_mean": 1.0,
                                                  "images_per_call_max": 1}


def test_repeat_fixed_runs_the_fixed_catalogue_again_on_the_same_engine(capsys):
    result = bench_engine.main(["--shape", "tiny", "--samples", "2", "--skip-baseline", "--catalogue-only",
                                "--repeat-fixed", "3"])
    capsys.readouterr()
    ours = result["ours"]
    assert [ours[key]["samples"] for key in ("catalogue", "catalogue_run2", "catalogue_run3")] == [2, 2, 2]
    assert "catalogue_run4" not in ours
    assert ours["warm_up"] is None  # the engine warms itself up on CUDA only


@pytest.mark.parametrize("sampling", ["greedy", "model-defaults"])
def test_the_requests_sample_as_asked_greedy_or_with_the_checkpoints_defaults(capsys, monkeypatch, sampling):
    """--sampling model-defaults: every request of the parts and the catalogue picks tokens with generation_config's
    temperature / top-p / top-k, as MLPerf's requests ask through the product path."""
    from workers.sampler import Sampler

    seen, sample = set(), Sampler.sample
    monkeypatch.setattr(Sampler, "sample", lambda self, logits, ids, params, *a: (
        seen.update((p.temperature, p.top_p, p.top_k) for p in params), sample(self, logits, ids, params, *a))[1])
    result = bench_engine.main(["--shape", "tiny", "--samples", "2", "--skip-baseline", "--workloads", "fixed",
                                "--decode-batches", "2", "--sampling", sampling])
    capsys.readouterr()
    assert result["ours"]["sampling"] == sampling and result["ours"]["catalogue"]["samples"] == 2
    assert seen == ({(0.0, 1.0, 0)} if sampling == "greedy" else {(0.7, 0.8, 20)})


def test_precisions_run_fp8_weights_beside_bf16_in_the_same_call(tmp_path, capsys):
    result = bench_engine.main(["--shape", "tiny", "--samples", "2", "--skip-baseline", "--precisions", "bf16,fp8",
                                "--workloads", "fixed", "--catalogue-only"])
    assert result["ours"]["weights"] == "bfloat16 weights"
    assert result["ours_fp8"]["weights"].startswith("fp8 e4m3 weights in 128x128 blocks")
    assert result["ours_fp8"]["catalogue"]["samples_per_s"] > 0
    assert result["ours_fp8"]["kv_pool_tokens"] == result["ours_fp8"]["kv_blocks"] * result["ours_fp8"]["block_size"]


def test_no_workload_gives_the_part_figures_alone_on_the_moe_tables_asked_for(tmp_path, capsys, monkeypatch):
    from workers.model import fused_moe

    # on CUDA each part is a process of its own; on the CPU the table folder is set in this one, then put back
    monkeypatch.setattr(fused_moe, "TUNED_DIR", fused_moe.TUNED_DIR)
    fused_moe._tuned.cache_clear()
    try:
        result = bench_engine.main(["--shape", "tiny", "--skip-baseline", "--workloads", "none",
                                    "--moe-configs", str(tmp_path), "--overlap-decode-steps"])
        assert fused_moe.TUNED_DIR == tmp_path
    finally:
        fused_moe._tuned.cache_clear()
    capsys.readouterr()
    ours = result["ours"]
    assert {"decode", "prefill_tokens_per_s", "vision_ms_per_image"} <= set(ours)
    assert not {key for key in ours if key.startswith("catalogue")}
    assert ours["moe_configs"] == str(tmp_path) and ours["overlap_decode_steps"] is True


def test_layer_fusions_both_runs_each_precision_with_the_fused_launches_off_then_on(capsys, monkeypatch):
    from workers.model import norm_quant, route_align

    monkeypatch.setattr(norm_quant, "FUSED", True)  # on CUDA each part is a process of its own; here they are put back
    monkeypatch.setattr(route_align, "FUSED", True)
    result = bench_engine.main(["--shape", "tiny", "--skip-baseline", "--workloads", "none", "--layer-fusions", "both"])
    capsys.readouterr()
    assert result["ours_unfused"]["layer_fusions"] is False and result["ours"]["layer_fusions"] is True
    assert norm_quant.FUSED and route_align.FUSED  # the last part ran with them on


def test_decode_batches_measures_the_decode_steps_at_the_batch_sizes_asked_for(capsys):
    result = bench_engine.main(["--shape", "tiny", "--skip-baseline", "--workloads", "none", "--decode-batches", "1,3,2"])
    capsys.readouterr()
    assert list(result["ours"]["decode"]) == ["1", "3", "2"]  # in the order asked (each after the one before)
    try:
        bench_engine.main(["--shape", "tiny", "--decode-batches", "1,0"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("--decode-batches 1,0 was accepted")
    assert "--decode-batches" in capsys.readouterr().err


def test_no_workload_is_refused_where_a_catalogue_is_asked_for(capsys):
    for argv in (["--workloads", "none"], ["--workloads", "none", "--skip-baseline", "--catalogue-only"]):
        try:
            bench_engine.main(["--shape", "tiny", *argv])
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(f"{argv} was accepted")
    assert "--workloads none" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--profile-decode", "--profile-prefill"])
def test_profiling_steps_is_refused_without_a_gpu(flag, tmp_path, capsys):
    try:
        bench_engine.main(["--shape", "tiny", "--skip-baseline", flag, str(tmp_path / "p.txt")])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError(f"{flag} was accepted on the CPU")
    assert f"{flag} profiles CUDA kernels: it needs a CUDA device" in capsys.readouterr().err


def test_a_profiled_windows_gpu_timeline_gives_kernels_busy_time_and_gaps_per_step():
    from lab.bench.engine_probes import timeline_per_step

    # two steps: three kernels and a copy overlapping the second (28 us busy), 2 us between the first two kernels
    # (launch latency), 100 us waiting for the host
    ops = [("k1", 0.0, 10.0), ("k2", 12.0, 20.0), ("Memcpy HtoD (Pinned -> Device)", 19.0, 21.0), ("k3", 121.0, 130.0)]
    assert timeline_per_step(ops, 2) == {"kernels": 1.5, "copies": 0.5, "busy_ms": 0.014, "short_gaps_ms": 0.001,
                                         "long_gaps_ms": 0.05}


def _decode_batch_engine(batch: int, max_tokens: int, w):
    """The simulated engine (the real scheduler) with batch prompts of w.decode_context tokens, past their prefill."""
    from pathlib import Path

    from contract.types import PromptInput, SamplingParams
    from workers.config import EngineConfig
    from workers.sim.config import SimulationConfig
    from workers.sim.engine import simulated
    from workers.sim.step_model import StepModel

    engine = simulated(EngineConfig(checkpoint=Path("simulated"), max_num_batched_tokens=w.max_num_batched_tokens,
                                    max_num_seqs=w.max_num_seqs, max_model_len=4096),
                       SimulationConfig(model="qwen3-vl-30b-a3b", output_tokens=10_000),
                       StepModel.build("h200", "qwen3-vl-30b-a3b"), realtime=False)
    for i in range(batch):
        engine.add_request(f"r{i}", PromptInput([1000 + i] * w.decode_context),
                           SamplingParams(temperature=0, max_tokens=max_tokens))
    while any(s.num_generated_tokens == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    return engine


@pytest.mark.parametrize("batch", [256, 64])
def test_every_timed_decode_step_decodes_the_whole_batch(batch):
    """256 prompts of 1,024 tokens take ~33 steps of 8,192 to prefill, and the first ones decode in each of them: with
    tokens for the timed steps alone, they finish while the batch is timed (256 down to 12 sequences)."""
    from lab.bench.engine_probes import check_decode_batch, prefill_steps
    from lab.bench.engine_setup import Workload

    w = Workload()
    tokens = w.decode_steps + 2 + prefill_steps(batch, w.decode_context, w.max_num_batched_tokens)
    engine = _decode_batch_engine(batch, tokens, w)
    for _ in range(w.decode_steps):
        check_decode_batch(engine, batch)
        engine.step()
    check_decode_batch(engine, batch)


def test_a_batch_that_shrank_while_timed_is_refused():
    from lab.bench.engine_probes import check_decode_batch
    from lab.bench.engine_setup import Workload

    w = Workload()
    engine = _decode_batch_engine(256, w.decode_steps + 2, w)  # tokens for the timed steps only
    with pytest.raises(RuntimeError, match="decode batch 256: .* sequences decoding"):
        for _ in range(w.decode_steps):
            check_decode_batch(engine, 256)
            engine.step()
