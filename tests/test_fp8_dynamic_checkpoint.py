"""FP8-dynamic checkpoints (compressed-tensors `float-quantized`, llm-compressor's FP8_DYNAMIC scheme; the layout of
RedHat's Qwen3-VL-235B-A22B FP8 checkpoint, the one the closed 8xH200 result ran): e4m3 weights with one scale per
output channel, activations quantised per token at run time. The layout written, loading, the engine's tokens
against transformers on the dequantized copy, and the arithmetic of the W8A8 path on it."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.engine_equivalence import make_engine, run_to_completion, transformers_reference
from tests.helpers.fp8_reference import dequantize_by_index, dequantized_checkpoint
from tests.helpers.image_fixtures import png
from workers.checkpoint_quant import weight_format
from workers.config import EngineConfig
from workers.executor.model_runner import build_text_model
from workers.model import fp8
from workers.model.fp8 import FP8_DTYPE
from workers.model.layers import Fp8Linear
from workers.model.moe import MoeExperts
from workers.model_config import load_model_config


@pytest.fixture(scope="module")
def tiny_moe_dynamic_checkpoint(tiny_moe_checkpoint, tmp_path_factory):
    from workers.quantized_checkpoint import quantize_checkpoint

    return quantize_checkpoint(tiny_moe_checkpoint, tmp_path_factory.mktemp("fp8dyn") / "tiny-moe-fp8-dynamic", layout="channel")


def test_the_checkpoint_is_written_in_the_fp8_dynamic_layout(tiny_moe_dynamic_checkpoint):
    from safetensors import safe_open

    config = json.loads((tiny_moe_dynamic_checkpoint / "config.json").read_text())
    q = config["quantization_config"]
    assert (q["quant_method"], q["format"]) == ("compressed-tensors", "float-quantized")
    group = q["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "channel" and group["input_activations"] == {
        "num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    fmt = weight_format(config)
    assert fmt.method == "fp8_channel" and fmt.scale_suffix == "weight_scale"
    assert fmt.skips("model.language_model.layers.0.mlp.gate") and fmt.skips("lm_head")
    assert not fmt.skips("model.language_model.layers.0.mlp.experts")
    with safe_open(str(tiny_moe_dynamic_checkpoint / "model.safetensors"), framework="pt") as f:
        prefix = "model.language_model.layers.0."
        gate = f.get_tensor(prefix + "mlp.experts.3.gate_proj.weight")
        assert gate.dtype == FP8_DTYPE and gate.shape == (48, 64)
        assert f.get_tensor(prefix + "mlp.experts.3.gate_proj.weight_scale").shape == (48, 1)
        assert f.get_tensor(prefix + "self_attn.o_proj.weight_scale").shape == (64, 1)
        assert f.get_tensor(prefix + "mlp.gate.weight").dtype == torch.float32


def test_each_row_dequantizes_by_its_own_scale(tiny_moe_dynamic_checkpoint):
    """The layout's arithmetic by hand: w[i, j] = q[i, j] * weight_scale[i, 0], and the largest |q| of a row is 448."""
    from safetensors import safe_open

    with safe_open(str(tiny_moe_dynamic_checkpoint / "model.safetensors"), framework="pt") as f:
        name = "model.language_model.layers.1.self_attn.q_proj."
        q, scale = f.get_tensor(name + "weight"), f.get_tensor(name + "weight_scale")
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((q.shape[0],), 448.0))
    assert torch.equal(dequantize_by_index(q, scale, (1, q.shape[1])), q.float() * scale)


def test_engine_on_the_fp8_dynamic_checkpoint_matches_transformers_on_its_dequantized_copy(tiny_moe_dynamic_checkpoint, tmp_path):
    reference = transformers_reference(dequantized_checkpoint(tiny_moe_dynamic_checkpoint, tmp_path / "deq"))
    cases = {
        "text": reference([], list(range(1000, 1030))),
        "image": reference([png(67, 45, seed=1)], [3838, 374, 419]),
    }
    engine = make_engine(tiny_moe_dynamic_checkpoint)
    got = run_to_completion(engine, {0: [(rid, prompt) for rid, (prompt, _) in cases.items()]})
    assert got == {rid: tokens for rid, (_, tokens) in cases.items()}


def test_fp8_compute_keeps_one_scale_per_output_row_and_rounds_activations_per_token(tiny_moe_dynamic_checkpoint):
    checkpoint = tiny_moe_dynamic_checkpoint
    model = build_text_model(EngineConfig(checkpoint=checkpoint, fp8_compute="fp8"), load_model_config(checkpoint),
                             torch.device("cpu"), torch.float32)
    layer = model.language_model.layers[0].self_attn.o_proj
    experts = model.language_model.layers[0].mlp.experts
    assert isinstance(layer, Fp8Linear) and layer.weight_scale.shape == (64, 1)
    assert isinstance(experts, MoeExperts) and experts.per_channel and experts.gate_up_scale.shape == (8, 96, 1)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)) * torch.logspace(-2, 1, 64)
    w = layer.weight.float() * layer.weight_scale
    per_token = fp8.fake_quantize_activations(x, 64) @ w.t()
    per_group = fp8.fake_quantize_activations(x, 16) @ w.t()
    got = layer(x)
    torch.testing.assert_close(got, per_token, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, per_group, rtol=1e-6, atol=1e-6)  # one scale per token, not per group


def test_random_fp8_dynamic_weights_are_built_from_config_json_alone(tiny_moe_dynamic_checkpoint, tmp_path):
    (tmp_path / "config.json").write_text((tiny_moe_dynamic_checkpoint / "config.json").read_text())
    config = EngineConfig(checkpoint=tmp_path, load_format="random", fp8_compute="fp8")
    model = build_text_model(config, load_model_config(tmp_path), torch.device("cpu"), torch.float32)
    qkv = model.language_model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale.shape == (qkv.out_features, 1)
