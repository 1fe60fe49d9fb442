"""The step model: calibration from the bench JSON, its scaling to other hardware, and its 1xH200 validation."""

import pytest

from workers.sim.step_model import Calibration, StepModel, StepWork, load_hardware


def test_calibration_reproduces_the_measured_h200_steps():
    model = StepModel.build("h200", "qwen3-vl-30b-a3b")
    assert model.step_ms(StepWork(num_seqs=256, decode_context_tokens=256 * 1024)) == pytest.approx(40.832, rel=1e-6)
    assert model.step_ms(StepWork(num_seqs=1, decode_context_tokens=1024)) == pytest.approx(12.994, rel=1e-6)
    assert model.step_ms(StepWork(num_seqs=4, prefill_tokens=8192)) == pytest.approx(231.25, rel=1e-6)
    assert model.vision_ms(1024) == pytest.approx(5.855, rel=1e-6)
    assert model.vision_ms(4096) == pytest.approx(6.35e3 / 256, rel=1e-6)  # the catalogue's 1024x1024 images


def test_kv_capacity_matches_the_measured_pool():
    assert StepModel.build("h200", "qwen3-vl-30b-a3b").kv_capacity_tokens() == pytest.approx(44355 * 16, rel=0.01)


def test_micro_benchmarks_alone_have_no_visual_excess():
    assert Calibration.from_bench(visual_fit=False).visual_token_extra_ms == 0
    assert Calibration.from_bench().visual_token_extra_ms > 0


def test_faster_hardware_and_narrower_weights_shorten_steps():
    work = StepWork(num_seqs=64, prefill_tokens=2048, visual_prefill_tokens=1024, decode_context_tokens=64 * 1500,
                    vision_patches=[4096])
    h200 = StepModel.build("h200", "qwen3-vl-235b-a22b", tp=8).step_ms(work)
    gb300 = StepModel.build("gb300", "qwen3-vl-235b-a22b", tp=8).step_ms(work)
    rubin = StepModel.build("vera-rubin", "qwen3-vl-235b-a22b", tp=8).step_ms(work)
    rubin_fp4 = StepModel.build("vera-rubin", "qwen3-vl-235b-a22b", "fp4", "fp8", tp=8).step_ms(work)
    assert h200 > gb300 > rubin > rubin_fp4


def test_the_235b_model_does_not_fit_one_h200_but_fits_eight():
    assert StepModel.build("h200", "qwen3-vl-235b-a22b").kv_capacity_tokens() == 0
    assert StepModel.build("h200", "qwen3-vl-235b-a22b", tp=8).kv_capacity_tokens() > 100_000


@pytest.mark.parametrize("name", ["h200", "gb200", "gb300", "vera-rubin"])
def test_every_hardware_profile_names_its_sources(name):
    profile = load_hardware(name)
    assert profile.sources and profile.hbm_tb_s > 0 and profile.tflops("fp4") > 0


def test_unknown_hardware_is_named():
    with pytest.raises(ValueError, match="unknown hardware profile 'tpu'.*h200"):
        load_hardware("tpu")


def test_prediction_of_the_1x_and_2x_h200_catalogue_runs_is_within_15_percent():
    from scripts.plan_layout import validate

    rows = {row["run"]: row for row in validate()["rows"]}
    for run in ("run2", "run1", "run2-eager", "run6 dp2 (2xH200, two instances)"):
        assert abs(rows[run]["samples_per_s"]["error_pct"]) < 15, rows[run]
