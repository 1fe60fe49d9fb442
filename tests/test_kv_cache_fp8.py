"""The FP8 KV cache: e4m3 rounding is the reference's bit for bit, the pool holds twice the tokens per byte, writes
quantize and reads dequantize with each layer's scales, exports carry FP8 rows and their scales, the checkpoint's
KV scales load under the names checkpoints use, and kv_cache_dtype is a validated engine setting."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml
from pydantic import ValidationError
from safetensors.torch import save_file

from harness.system_config import CONFIG_DIR, ConfigError, engine_config, parse_system_config
from tests.helpers.fp8_kv_reference import e4m3_bytes, probe_values
from workers.config import EngineConfig
from workers.kv_cache import FP8_DTYPE, KvCache, KvExport, cache_dtype, from_cache, quantize_fp8
from workers.model.attention import gather_kv, write_kv
from workers.model_config import CheckpointError
from workers.weights import load_kv_scales


@pytest.mark.parametrize("scale", [1.0, 0.5, 0.37, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_quantization_rounds_to_the_nearest_e4m3_value_ties_to_even_saturating_at_448(dtype, scale):
    x = probe_values().to(dtype)
    assert torch.equal(quantize_fp8(x, scale).view(torch.uint8), e4m3_bytes(x, scale))


def test_dequantized_fp8_is_the_e4m3_value_times_the_scale():
    x = torch.tensor([1.0, -3.3, 100.0, 1000.0])
    stored = quantize_fp8(x, 0.5)
    # x / 0.5 = 2, -6.6 -> -6.5, 200 (a tie of 192 and 208 -> the even 192), 2000 -> 448
    assert from_cache(stored, 0.5, torch.float32).tolist() == [1.0, -3.25, 96.0, 224.0]
    assert from_cache(x, 0.5, torch.bfloat16).dtype == torch.bfloat16  # not FP8: a cast, no scale


def test_an_fp8_pool_holds_twice_the_tokens_of_a_bfloat16_pool_in_the_same_bytes():
    shape = (48, 16, 4, 128)  # 30B-A3B: layers, block size, KV heads, head_dim
    assert cache_dtype("fp8", torch.bfloat16) == FP8_DTYPE and cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert KvCache.bytes_per_block(*shape, torch.bfloat16) == 2 * KvCache.bytes_per_block(*shape, FP8_DTYPE)


def test_writes_into_an_fp8_cache_store_quantized_rows_and_reads_return_them_times_the_scale():
    cache = KvCache(2, 4, 4, 2, 8, FP8_DTYPE, torch.device("cpu"), scales=[(0.5, 2.0), (0.25, 0.125)])
    keys, values, k_scale, v_scale = cache.layers[1]
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    slots = torch.tensor([4, 5, 6, 7, 12, 13])  # blocks 1 and 3
    write_kv(keys, values, k, v, slots, k_scale, v_scale)
    assert torch.equal(keys.flatten(0, 1)[slots].view(torch.uint8), e4m3_bytes(k, 0.25))
    assert torch.equal(values.flatten(0, 1)[slots].view(torch.uint8), e4m3_bytes(v, 0.125))
    read = gather_kv(keys, torch.tensor([1, 3]), 6, k_scale, torch.float32)
    assert torch.equal(read, quantize_fp8(k, 0.25).float() * 0.25)
    assert (read - k).abs().max() <= 0.0625 * k.abs().max()  # e4m3: 3 mantissa bits, half an ulp <= 1/16
    assert not cache.layers[0].keys.view(torch.uint8).any()  # layer 0 untouched


def test_an_fp8_cache_rejects_scales_that_are_not_positive():
    with pytest.raises(ValueError, match="layer 1 KV scales"):
        KvCache(2, 4, 4, 2, 8, FP8_DTYPE, torch.device("cpu"), scales=[(1.0, 1.0), (0.0, 1.0)])


def fp8_export(scales):
    keys = [quantize_fp8(torch.randn(5, 2, 8), k) for k, _ in scales]
    values = [quantize_fp8(torch.randn(5, 2, 8), v) for _, v in scales]
    return KvExport(5, 7, 0, keys, values, scales)


def test_fp8_exports_carry_their_scales_and_survive_the_byte_round_trip_bit_exact():
    export = fp8_export([(0.5, 0.25), (1.0, 2.0)])
    with pytest.raises(ValueError, match="exactly when it is FP8"):
        KvExport(5, 7, 0, export.keys, export.values)
    back = KvExport.from_layer_bytes(
        num_tokens=5, first_token_id=7, mrope_position_delta=0, num_kv_heads=2, head_dim=8,
        dtype_name=export.dtype_name, layers=[export.layer_bytes(i) for i in range(2)], scales=export.scales,
    )
    assert export.dtype_name == "float8_e4m3fn" and back.scales == export.scales
    assert torch.equal(back.stacked().view(torch.uint8), export.stacked().view(torch.uint8))


def test_an_fp8_cache_imports_rows_of_its_own_scales_as_bytes_and_requantizes_other_scales():
    export = fp8_export([(0.5, 0.25), (1.0, 2.0)])
    same = KvCache(2, 4, 4, 2, 8, FP8_DTYPE, torch.device("cpu"), scales=[(0.5, 0.25), (1.0, 2.0)])
    assert torch.equal(same.import_rows(export, torch.device("cpu")).view(torch.uint8), export.stacked().view(torch.uint8))
    other = KvCache(2, 4, 4, 2, 8, FP8_DTYPE, torch.device("cpu"), scales=[(1.0, 1.0), (1.0, 1.0)])
    rows = other.import_rows(export, torch.device("cpu"))
    assert torch.equal(rows[0, 0].view(torch.uint8), quantize_fp8(export.keys[0].float() * 0.5, 1.0).view(torch.uint8))
    bf16 = KvCache(2, 4, 4, 2, 8, torch.bfloat16, torch.device("cpu"))
    assert torch.equal(bf16.import_rows(export, torch.device("cpu"))[1, 1], (export.values[1].float() * 2.0).bfloat16())


def write_checkpoint(path, tensors):
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("k_name,v_name", [
    ("self_attn.k_scale", "self_attn.v_scale"),  # llm-compressor / compressed-tensors
    ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),  # NVIDIA ModelOpt
])
def test_kv_scales_load_under_the_names_fp8_checkpoints_use(tmp_path, k_name, v_name):
    prefix = "model.language_model.layers"
    tensors = {"model.language_model.norm.weight": torch.ones(4)}
    for i in range(3):
        tensors[f"{prefix}.{i}.{k_name}"] = torch.tensor(0.5 + i, dtype=torch.float32)
        tensors[f"{prefix}.{i}.{v_name}"] = torch.tensor([0.25 * (i + 1)], dtype=torch.bfloat16)
    assert load_kv_scales(write_checkpoint(tmp_path / "c", tensors), 3) == [(0.5, 0.25), (1.5, 0.5), (2.5, 0.75)]


def test_a_single_legacy_kv_scale_serves_both_and_no_scales_means_none(tmp_path):
    one = write_checkpoint(tmp_path / "a", {"model.language_model.layers.0.self_attn.kv_scale": torch.tensor(2.0)})
    assert load_kv_scales(one, 1) == [(2.0, 2.0)]
    assert load_kv_scales(write_checkpoint(tmp_path / "b", {"model.language_model.norm.weight": torch.ones(4)}), 1) is None


def test_a_missing_or_malformed_kv_scale_fails_naming_the_tensor(tmp_path):
    partial = write_checkpoint(tmp_path / "a", {
        "model.language_model.layers.0.self_attn.k_scale": torch.tensor(1.0),
        "model.language_model.layers.0.self_attn.v_scale": torch.tensor(1.0),
    })
    with pytest.raises(CheckpointError, match=r"layers\.1\.self_attn\.k_scale missing"):
        load_kv_scales(partial, 2)
    negative = write_checkpoint(tmp_path / "b", {"model.language_model.layers.0.self_attn.k_scale": torch.tensor(-1.0)})
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.k_scale: .* positive finite"):
        load_kv_scales(negative, 1)
    vector = write_checkpoint(tmp_path / "c", {"model.language_model.layers.0.self_attn.v_scale": torch.ones(4)})
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.v_scale: .* shape \(4,\)"):
        load_kv_scales(vector, 1)


def test_kv_cache_dtype_is_an_engine_setting_of_the_system_yaml():
    assert EngineConfig(checkpoint="c").kv_cache_dtype == "auto"
    data = yaml.safe_load((CONFIG_DIR / "cpu-tiny.yaml").read_text())
    data.setdefault("engine", {})["kv_cache_dtype"] = "fp8"
    config = parse_system_config(copy.deepcopy(data), "test.yaml")
    assert engine_config(config, config.model.checkpoint).kv_cache_dtype == "fp8"
    data["engine"]["kv_cache_dtype"] = "fp16"
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        parse_system_config(data, "test.yaml")
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        EngineConfig(checkpoint="c", kv_cache_dtype="int8")
