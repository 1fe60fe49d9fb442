"""NVFP4 checkpoints (NVIDIA ModelOpt's unified format, quant_algo NVFP4: NVIDIA's MLPerf Qwen3-VL checkpoints):
the format's arithmetic by hand, the layout written, loading (and its errors), and the engine's greedy tokens against
transformers on the weights the engine serves. Hopper has no FP4 tensor cores, so an NVFP4 weight is dequantised at
load and held as e4m3 with one scale per output row: the engine then serves it as an FP8-dynamic checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.helpers.engine_equivalence import make_engine, run_to_completion, transformers_reference
from tests.helpers.fp8_reference import dequantized_checkpoint, read_tensors, write_checkpoint
from tests.helpers.image_fixtures import png
from workers.checkpoint_quant import QuantizationConfigError, weight_format
from workers.checkpoint_quant import BlockShape
from workers.config import EngineConfig
from workers.executor.model_runner import build_text_model
from workers.model import fp8, nvfp4
from workers.model.fp8 import FP8_DTYPE
from workers.model.layers import Fp8Linear
from workers.model_config import CheckpointError, load_model_config
from workers.quantized_checkpoint import channel_quantization_config, quantize_checkpoint

E2M1 = {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 3.0, 6: 4.0, 7: 6.0}


def dequantize_by_hand(packed: torch.Tensor, scale: torch.Tensor, global_scale: float, group: int = 16) -> torch.Tensor:
    """Element by element: byte j of row i holds column 2j in its low nibble and 2j + 1 in its high one; a nibble is
    a sign bit (8) and an index into 0, 0.5, 1, 1.5, 2, 3, 4, 6; times the scale of its group of 16 columns and the
    tensor's global scale. Written without workers/model/nvfp4.py."""
    rows, half = packed.shape
    out = torch.empty(rows, 2 * half)
    for i in range(rows):
        for j in range(half):
            byte = int(packed[i, j])
            for col, nibble in ((2 * j, byte & 0xF), (2 * j + 1, byte >> 4)):
                value = -E2M1[nibble & 7] if nibble & 8 else E2M1[nibble & 7]
                out[i, col] = value * float(scale[i, col // group].float()) * global_scale
    return out


def test_nvfp4_dequantization_matches_hand_computed_values():
    packed = torch.tensor([[0x21, 0xF8] + [0x00] * 6, [0x7F] * 8], dtype=torch.uint8)  # two rows of 16 columns
    scale = torch.tensor([[2.0], [0.5]]).to(FP8_DTYPE)
    got = nvfp4.dequantize_nvfp4(packed, scale, torch.tensor(0.25))
    assert got[0, :4].tolist() == [0.5 * 0.5, 1.0 * 0.5, -0.0, -6.0 * 0.5]  # 2.0 x 0.25 = 0.5 a unit
    assert got[1].tolist() == [-6.0 * 0.125, 6.0 * 0.125] * 8  # 0x7F: low nibble 0xF (-6), high 0x7 (6)
    assert torch.equal(got, dequantize_by_hand(packed, scale, 0.25))


def test_quantization_follows_modelopts_recipe_and_round_trips_within_e2m1_steps():
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 0, 64)
    packed, scale, global_scale = nvfp4.quantize_nvfp4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (24, 32)
    assert scale.dtype == FP8_DTYPE and scale.shape == (24, 4)
    assert float(global_scale) == pytest.approx(float(w.abs().amax()) / (6 * 448))
    back = nvfp4.dequantize_nvfp4(packed, scale, global_scale)
    assert torch.equal(back, dequantize_by_hand(packed, scale, float(global_scale)))
    # every value lands within half of e2m1's widest step (2, between 4 and 6) of its group's unit, plus e4m3's
    # rounding of that unit (2^-4 relative)
    unit = scale.float().repeat_interleave(16, dim=1) * global_scale
    assert bool(((back - w).abs() <= unit * 1.0 + w.abs() * 2**-4).all())


@pytest.fixture(scope="module")
def tiny_moe_nvfp4_checkpoint(tiny_moe_checkpoint, tmp_path_factory):
    return quantize_checkpoint(tiny_moe_checkpoint, tmp_path_factory.mktemp("nvfp4") / "tiny-moe-nvfp4", layout="nvfp4")


def test_the_checkpoint_is_written_in_modelopts_nvfp4_layout(tiny_moe_nvfp4_checkpoint):
    config = json.loads((tiny_moe_nvfp4_checkpoint / "config.json").read_text())
    q = config["quantization_config"]
    assert (q["quant_method"], q["quant_algo"], q["group_size"]) == ("modelopt", "NVFP4", 16)
    fmt = weight_format(config)
    assert fmt.method == "nvfp4" and fmt.group == 16 and fmt.checkpoint_weights == "nvfp4"
    assert fmt.skips("lm_head") and fmt.skips("model.visual.blocks.0.attn.qkv")
    assert fmt.skips("model.language_model.layers.0.mlp.gate") and not fmt.skips("model.language_model.layers.0.mlp.gate_proj")
    with safe_open(str(tiny_moe_nvfp4_checkpoint / "model.safetensors"), framework="pt") as f:
        prefix = "model.language_model.layers.0."
        gate = prefix + "mlp.experts.3.gate_proj."
        assert f.get_tensor(gate + "weight").dtype == torch.uint8 and f.get_tensor(gate + "weight").shape == (48, 32)
        assert f.get_tensor(gate + "weight_scale").dtype == FP8_DTYPE and f.get_tensor(gate + "weight_scale").shape == (48, 4)
        assert f.get_tensor(gate + "weight_scale_2").numel() == 1 and f.get_tensor(gate + "input_scale").numel() == 1
        assert f.get_tensor(prefix + "self_attn.o_proj.weight").shape == (64, 32)
        assert f.get_tensor(prefix + "mlp.gate.weight").dtype == torch.float32


def served_copy(nvfp4_dir, out_dir):
    """The FP8-dynamic checkpoint the engine should be serving: every NVFP4 weight dequantised by hand, then e4m3
    with one scale per row (fp8.quantize_weight_blocks, checked by test_fp8_checkpoint)."""
    config = json.loads((nvfp4_dir / "config.json").read_text())
    config["quantization_config"] = channel_quantization_config()
    raw = read_tensors(nvfp4_dir)
    tensors = {}
    for name, tensor in raw.items():
        if name.endswith(("weight_scale", "weight_scale_2", "input_scale")):
            continue
        if tensor.dtype == torch.uint8:
            module = name.removesuffix("weight")
            w = dequantize_by_hand(tensor, raw[module + "weight_scale"], float(raw[module + "weight_scale_2"]))
            tensors[name], tensors[module + "weight_scale"] = fp8.quantize_weight_blocks(w, BlockShape(1, w.shape[1]))
        else:
            tensors[name] = tensor
    return write_checkpoint(nvfp4_dir, out_dir, config, tensors)


def test_loading_holds_each_weight_as_e4m3_per_row_of_its_exact_dequantisation(tiny_moe_nvfp4_checkpoint, tmp_path):
    checkpoint = tiny_moe_nvfp4_checkpoint
    model = build_text_model(EngineConfig(checkpoint=checkpoint, fp8_compute="fp8"), load_model_config(checkpoint),
                             torch.device("cpu"), torch.float32)
    reference = served_copy(checkpoint, tmp_path / "served")
    with safe_open(str(reference / "model.safetensors"), framework="pt") as f:
        o_proj = model.language_model.layers[1].self_attn.o_proj
        assert isinstance(o_proj, Fp8Linear) and o_proj.weight.dtype == FP8_DTYPE
        name = "model.language_model.layers.1.self_attn.o_proj."
        assert torch.equal(o_proj.weight.float(), f.get_tensor(name + "weight").float())
        assert torch.equal(o_proj.weight_scale.reshape(-1), f.get_tensor(name + "weight_scale").reshape(-1))
        experts = model.language_model.layers[0].mlp.experts
        assert experts.per_channel and experts.gate_up_proj.dtype == FP8_DTYPE
        down = "model.language_model.layers.0.mlp.experts.5.down_proj."
        assert torch.equal(experts.down_proj[5].float(), f.get_tensor(down + "weight").float())


def test_engine_on_the_nvfp4_checkpoint_matches_transformers_on_the_weights_it_serves(tiny_moe_nvfp4_checkpoint, tmp_path):
    served = served_copy(tiny_moe_nvfp4_checkpoint, tmp_path / "served")
    reference = transformers_reference(dequantized_checkpoint(served, tmp_path / "deq"))
    cases = {"text": reference([], list(range(1000, 1030))), "image": reference([png(67, 45, seed=1)], [3838, 374, 419])}
    got = run_to_completion(make_engine(tiny_moe_nvfp4_checkpoint), {0: [(rid, p) for rid, (p, _) in cases.items()]})
    assert got == {rid: tokens for rid, (_, tokens) in cases.items()}


def _rewritten(checkpoint, out, edit):
    shutil.copytree(checkpoint, out)
    path = out / "model.safetensors"
    tensors = read_tensors(out)
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("model.language_model.layers.1.self_attn.q_proj.weight_scale_2"),
     r"q_proj.weight is NVFP4 \(uint8\) but its scale tensor .*q_proj.weight_scale_2 is missing"),
    (lambda t: t.update({"model.language_model.layers.1.self_attn.q_proj.weight_scale":
                         t["model.language_model.layers.1.self_attn.q_proj.weight_scale"][:, :2].contiguous()}),
     r"q_proj.weight_scale: torch.float8_e4m3fn \(\d+, 2\), expected float8_e4m3fn \(\d+, 4\)"),
])
def test_a_missing_or_misshapen_nvfp4_scale_fails_at_load_naming_the_tensor(tiny_moe_nvfp4_checkpoint, tmp_path, edit, message):
    broken = _rewritten(tiny_moe_nvfp4_checkpoint, tmp_path / "broken", edit)
    with pytest.raises(CheckpointError, match=message):
        make_engine(broken)


def test_packed_weights_without_an_nvfp4_config_and_other_algorithms_are_refused(tiny_moe_nvfp4_checkpoint, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_moe_nvfp4_checkpoint, bare)
    config = json.loads((bare / "config.json").read_text())
    config.pop("quantization_config")
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="is uint8 .* declares no NVFP4 quantization_config"):
        make_engine(bare)
    with pytest.raises(QuantizationConfigError, match="quant_algo 'NVFP4_AWQ': only 'NVFP4'"):
        weight_format({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4_AWQ"}})


def test_a_system_names_an_nvfp4_checkpoint_as_nvfp4_before_start(tiny_moe_nvfp4_checkpoint, tmp_path):
    from harness.assets import resolve_checkpoint
    from harness.system_config import ConfigError, ModelSection

    model = ModelSection(checkpoint=str(tiny_moe_nvfp4_checkpoint), dtype="bfloat16", weights="fp8")
    with pytest.raises(ConfigError, match=r"model.weights: 'fp8', but .*declares nvfp4 weights .*\('nvfp4'\)"):
        resolve_checkpoint(model, tmp_path)
    assert resolve_checkpoint(model.model_copy(update={"weights": "nvfp4"}), tmp_path) == tiny_moe_nvfp4_checkpoint


def test_a_generated_nvfp4_system_builds_random_weights_as_the_engine_holds_nvfp4(tmp_path):
    from harness.system_config import GeneratedCheckpointSection

    config = GeneratedCheckpointSection(preset="qwen3-vl-30b-a3b").config_json("nvfp4")
    fmt = weight_format(config)
    assert fmt.method == "nvfp4" and fmt.skips("model.language_model.layers.0.mlp.gate")
