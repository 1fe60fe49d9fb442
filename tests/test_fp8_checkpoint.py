"""FP8 checkpoints in the released block layout: the format's arithmetic, the layout written, loading (and its
errors), and the engine's greedy tokens against transformers on the same FP8 checkpoint.

On the CPU transformers dequantizes an FP8 checkpoint at load and computes in float32; the engine's default there
does the same, so tokens must be equal. transformers cannot load the per-expert MoE layout (#44230): the MoE
reference is transformers on a dequantized copy made by tests/helpers/fp8_reference.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from contract.types import PromptInput
from tests.helpers.engine_equivalence import make_engine, run_to_completion, transformers_reference
from tests.helpers.fp8_reference import dequantize_by_index, dequantized_checkpoint
from tests.helpers.image_fixtures import png
from workers.checkpoint_quant import BlockShape
from workers.config import EngineConfig
from workers.executor.model_runner import build_text_model
from workers.model.fp8 import FP8_DTYPE, dequantize_weight_blocks, quantize_weight_blocks
from workers.model.layers import Fp8Linear
from workers.model.moe import MoeExperts
from workers.model_config import CheckpointError, load_model_config
from workers.parallel import TensorParallel

BLOCK = (16, 16)


def test_index_dequantization_reference_matches_hand_computed_blocks():
    q = torch.tensor([[1.0, 2.0, -0.5], [4.0, -1.0, 0.25], [448.0, 0.0, 3.0]]).to(FP8_DTYPE)
    scale = torch.tensor([[0.5, 2.0], [3.0, 0.25]])  # blocks of 2x2: rows {0,1},{2}; columns {0,1},{2}
    expected = torch.tensor([
        [1.0 * 0.5, 2.0 * 0.5, -0.5 * 2.0],
        [4.0 * 0.5, -1.0 * 0.5, 0.25 * 2.0],
        [448.0 * 3.0, 0.0 * 3.0, 3.0 * 0.25],
    ])
    assert torch.equal(dequantize_by_index(q, scale, (2, 2)), expected)


@pytest.mark.parametrize("shape", [(64, 48), (50, 70), (16, 16), (3, 200)])
def test_block_dequantization_equals_the_index_reference(shape):
    q, scale = quantize_weight_blocks(torch.randn(shape, generator=torch.Generator().manual_seed(0)), BlockShape(*BLOCK))
    assert torch.equal(dequantize_weight_blocks(q, scale, BlockShape(*BLOCK)), dequantize_by_index(q, scale, BLOCK))


def test_block_quantization_rounds_each_element_within_e4m3_precision():
    w = torch.randn(70, 50, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 1, 50)
    block = BlockShape(*BLOCK)
    q, scale = quantize_weight_blocks(w, block)
    per_element_scale = dequantize_weight_blocks(torch.ones_like(q, dtype=torch.float32).to(FP8_DTYPE), scale, block)
    # e4m3: 3 mantissa bits (half-ulp 2^-4 relative) for normals; subnormal steps of 2^-9 times the block scale.
    bound = w.abs() * 2**-4 + per_element_scale * 2**-10
    assert bool(((dequantize_weight_blocks(q, scale, block) - w).abs() <= bound).all())
    assert torch.allclose(scale.amax(), w.abs().amax() / 448)  # the block holding the largest value uses all of e4m3


def test_fp8_checkpoint_is_written_in_the_released_layout(tiny_moe_fp8_checkpoint):
    from safetensors import safe_open

    config = json.loads((tiny_moe_fp8_checkpoint / "config.json").read_text())
    q = config["quantization_config"]
    assert (q["quant_method"], q["fmt"], q["activation_scheme"], q["weight_block_size"]) == ("fp8", "e4m3", "dynamic", list(BLOCK))
    assert {"lm_head", "model.visual", "model.language_model.layers.0.mlp.gate"} <= set(q["modules_to_not_convert"])
    with safe_open(str(tiny_moe_fp8_checkpoint / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        prefix = "model.language_model.layers.0."
        gate = f.get_tensor(prefix + "mlp.experts.3.gate_proj.weight")
        assert gate.dtype == FP8_DTYPE and gate.shape == (48, 64)
        assert f.get_tensor(prefix + "mlp.experts.3.gate_proj.weight_scale_inv").shape == (3, 4)
        assert f.get_tensor(prefix + "self_attn.q_proj.weight").dtype == FP8_DTYPE
        assert f.get_tensor(prefix + "mlp.gate.weight").dtype == torch.float32  # the router stays float
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
    assert not any(n.startswith("model.visual.") and n.endswith("scale_inv") for n in names)


@pytest.fixture(scope="module")
def dense_fp8_reference(tiny_dense_fp8_checkpoint):
    return transformers_reference(tiny_dense_fp8_checkpoint)  # transformers loads the FP8 checkpoint itself


@pytest.fixture(scope="module")
def moe_fp8_reference(tiny_moe_fp8_checkpoint, tmp_path_factory):
    return transformers_reference(dequantized_checkpoint(tiny_moe_fp8_checkpoint, tmp_path_factory.mktemp("deq") / "moe"))


def _cases(reference):
    return {
        "text": reference([], list(range(1000, 1030))),
        "image": reference([png(67, 45, seed=1)], [3838, 374, 419]),
        "two-images": reference([png(130, 90, seed=2), png(40, 200, seed=3)], [3838, 374]),
    }


def _assert_engine_matches(checkpoint, cases):
    engine = make_engine(checkpoint)
    got = run_to_completion(engine, {0: [(rid, prompt) for rid, (prompt, _) in cases.items()]})
    assert got == {rid: tokens for rid, (_, tokens) in cases.items()}


def test_engine_on_the_fp8_dense_checkpoint_matches_transformers_on_it(tiny_dense_fp8_checkpoint, dense_fp8_reference):
    _assert_engine_matches(tiny_dense_fp8_checkpoint, _cases(dense_fp8_reference))


def test_engine_on_the_fp8_moe_checkpoint_matches_transformers_on_its_dequantized_copy(tiny_moe_fp8_checkpoint, moe_fp8_reference):
    _assert_engine_matches(tiny_moe_fp8_checkpoint, _cases(moe_fp8_reference))


def test_fp8_and_bf16_checkpoints_differ_only_by_the_rounding_of_their_weights(tiny_dense_checkpoint, tiny_dense_fp8_checkpoint):
    """The FP8 copy is the same model: its dequantized weights are within e4m3 rounding of the float ones."""
    config = load_model_config(tiny_dense_fp8_checkpoint)
    fp8 = build_text_model(EngineConfig(checkpoint=tiny_dense_fp8_checkpoint), config, torch.device("cpu"), torch.float32)
    ref = build_text_model(EngineConfig(checkpoint=tiny_dense_checkpoint), load_model_config(tiny_dense_checkpoint), torch.device("cpu"), torch.float32)
    a = fp8.language_model.layers[1].self_attn.o_proj.weight
    b = ref.language_model.layers[1].self_attn.o_proj.weight
    assert not torch.equal(a, b) and torch.allclose(a, b, rtol=2**-4, atol=b.abs().max().item() * 2**-8)


def _fp8_model(checkpoint, tp=None, **settings):
    config = EngineConfig(checkpoint=checkpoint, fp8_compute="fp8", **settings)
    return build_text_model(config, load_model_config(checkpoint), torch.device("cpu"), torch.float32, tp)


def test_fp8_compute_keeps_fp8_weights_with_one_scale_per_block(tiny_moe_fp8_checkpoint):
    model = _fp8_model(tiny_moe_fp8_checkpoint)
    qkv = model.language_model.layers[0].self_attn.qkv_proj
    experts = model.language_model.layers[0].mlp.experts
    assert isinstance(qkv, Fp8Linear) and qkv.weight.dtype == FP8_DTYPE
    # q (64 rows), k and v (32 each) are whole 16-row blocks: the fused layer keeps one scale per block.
    assert qkv.block == BlockShape(16, 16) and qkv.weight_scale.shape == (128 // 16, 64 // 16)
    assert isinstance(experts, MoeExperts) and experts.gate_up_proj.dtype == FP8_DTYPE
    assert experts.block == BlockShape(16, 16) and experts.gate_up_scale.shape == (8, 96 // 16, 64 // 16)
    assert model.lm_head.weight.dtype == torch.float32  # left unquantised, as the checkpoint says


def test_fp8_layers_compute_within_activation_rounding_of_their_dequantized_weights(tiny_moe_fp8_checkpoint):
    model = _fp8_model(tiny_moe_fp8_checkpoint)
    layer = model.language_model.layers[0].self_attn.o_proj
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    exact = x @ dequantize_weight_blocks(layer.weight, layer.weight_scale, layer.block).t()
    got = layer(x)
    # Only the activations are rounded (e4m3: <= 2^-4 relative each): the error is a few percent of the output scale.
    assert (got - exact).abs().max() <= 0.08 * exact.abs().max()
    assert not torch.equal(got, exact)


@pytest.mark.parametrize("arch", ["moe", "dense"])
def test_engine_w8a8_tokens_equal_transformers_with_the_fp8_arithmetic_on_the_same_weights(arch, request, tmp_path):
    """fp8_compute "fp8" on the CPU (activations rounded to e4m3 per token and group, weights kept in e4m3) against
    transformers' own forward on the dequantized weights with the same activation rounding emulated around each
    quantised linear, experts included (tests/helpers/fp8_reference.py): the same arithmetic in float32, so the same
    greedy tokens."""
    from tests.helpers.fp8_reference import fp8_activation_rounding, quantized_weight_names

    checkpoint = request.getfixturevalue(f"tiny_{arch}_fp8_checkpoint")
    names = quantized_weight_names(checkpoint)
    assert names and all("visual" not in n and ".mlp.gate." not in n for n in names)
    reference = transformers_reference(dequantized_checkpoint(checkpoint, tmp_path / "deq"),
                                       around=lambda model: fp8_activation_rounding(model, names, BLOCK[1]))
    cases = _cases(reference)
    engine = make_engine(checkpoint, fp8_compute="fp8")
    got = run_to_completion(engine, {0: [(rid, prompt) for rid, (prompt, _) in cases.items()]})
    assert got == {rid: tokens for rid, (_, tokens) in cases.items()}
    # and the rounding matters: without it transformers gives other tokens on some prompt
    plain = _cases(transformers_reference(dequantized_checkpoint(checkpoint, tmp_path / "deq2")))
    assert any(plain[rid][1] != cases[rid][1] for rid in cases)


def test_fp8_compute_on_the_cpu_generates(tiny_moe_fp8_checkpoint):
    """W8A8 on the kernels' torch references: activations rounded, so not transformers' tokens; it runs end to end."""
    engine = make_engine(tiny_moe_fp8_checkpoint, fp8_compute="fp8")
    got = run_to_completion(engine, {0: [("a", PromptInput([151644, 872, 198, 151652, *[151655] * 4, 151653, 1000, 1001, 151645], [png(64, 64, seed=5)]))]})
    assert len(got["a"]) == 8


def test_tensor_parallel_ranks_load_their_slices_of_fp8_weights_and_scales(tiny_dense_fp8_checkpoint):
    full = _fp8_model(tiny_dense_fp8_checkpoint)
    rank1 = _fp8_model(tiny_dense_fp8_checkpoint, TensorParallel(rank=1, size=2))
    for name in ("self_attn.o_proj", "mlp.down_proj"):  # row-parallel: a K slice
        a = full.language_model.layers[0].get_submodule(name)
        b = rank1.language_model.layers[0].get_submodule(name)
        k = a.weight.shape[1] // 2
        assert torch.equal(b.weight.view(torch.uint8), a.weight[:, k:].view(torch.uint8))
        assert torch.equal(b.weight_scale, a.weight_scale[:, k // 16 :])


def test_expert_parallel_ranks_load_whole_fp8_experts(tiny_moe_fp8_checkpoint):
    full = _fp8_model(tiny_moe_fp8_checkpoint).language_model.layers[2].mlp.experts
    rank1 = _fp8_model(tiny_moe_fp8_checkpoint, TensorParallel(rank=1, size=2, expert_parallel=True)).language_model.layers[2].mlp.experts
    assert torch.equal(rank1.down_proj.view(torch.uint8), full.down_proj[4:].view(torch.uint8))
    assert torch.equal(rank1.gate_up_scale, full.gate_up_scale[4:])


def test_a_k_slice_that_splits_scale_blocks_fails_naming_the_tensor(tiny_moe_fp8_checkpoint):
    # moe_intermediate_size 48 over 2 ranks: 24 columns of down_proj each, not whole 16-column blocks.
    with pytest.raises(CheckpointError, match=r"experts.*down_proj.*24 of its 48 input columns.*expert_parallel"):
        _fp8_model(tiny_moe_fp8_checkpoint, TensorParallel(rank=0, size=2))


def _broken_copy(src, tmp_path, edit):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "broken"
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_missing_scale_fails_at_load_naming_the_tensor(tiny_dense_fp8_checkpoint, tmp_path):
    name = "model.language_model.layers.1.mlp.up_proj.weight_scale_inv"
    broken = _broken_copy(tiny_dense_fp8_checkpoint, tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"its scale tensor {name} is missing"):
        make_engine(broken)


def test_a_scale_of_the_wrong_shape_fails_at_load_naming_the_tensor(tiny_moe_fp8_checkpoint, tmp_path):
    name = "model.language_model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"
    broken = _broken_copy(tiny_moe_fp8_checkpoint, tmp_path, lambda t: t.update({name: t[name][:, :1].contiguous()}))
    with pytest.raises(CheckpointError, match=rf"{name}: shape \(4, 1\), expected \(4, 3\)"):
        make_engine(broken, fp8_compute="fp8")


@pytest.mark.parametrize("edit, key", [
    ({"fmt": "e5m2"}, "fmt"),
    ({"activation_scheme": "static"}, "activation_scheme"),
    ({"weight_block_size": [128]}, "weight_block_size"),
    ({"quant_method": "awq"}, "quant_method"),
])
def test_an_unsupported_quantization_config_fails_naming_the_key(tiny_dense_fp8_checkpoint, tmp_path, edit, key):
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_dense_fp8_checkpoint, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"].update(edit)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=rf"quantization_config\.{key}"):
        load_model_config(out)


def test_random_fp8_weights_are_built_from_config_json_alone(tiny_moe_fp8_checkpoint, tmp_path):
    only_config = tmp_path / "config-only"
    only_config.mkdir()
    for name in ("config.json", "generation_config.json", "preprocessor_config.json"):
        shutil.copy(tiny_moe_fp8_checkpoint / name, only_config / name)
    model = _fp8_model(only_config, load_format="random")
    experts = model.language_model.layers[1].mlp.experts
    values = experts.gate_up_proj.float()
    assert experts.gate_up_proj.dtype == FP8_DTYPE and values.std() > 10  # e4m3 values spread over the format
    assert model.language_model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert torch.isfinite(model.language_model.layers[1].self_attn.qkv_proj(torch.randn(3, 64))).all()


@pytest.mark.parametrize("expects, fixture", [("fp8", "tiny_dense_checkpoint"), ("bf16", "tiny_dense_fp8_checkpoint")])
def test_a_system_expecting_another_weight_format_fails_before_start_naming_the_key(expects, fixture, request, tmp_path):
    from harness.assets import resolve_checkpoint
    from harness.system_config import ConfigError, ModelSection

    checkpoint = request.getfixturevalue(fixture)
    model = ModelSection(checkpoint=str(checkpoint), dtype="bfloat16", weights=expects)
    with pytest.raises(ConfigError, match=rf"model.weights: '{expects}', but .*config.json declares"):
        resolve_checkpoint(model, tmp_path)
    assert resolve_checkpoint(model.model_copy(update={"weights": "bf16" if expects == "fp8" else "fp8"}), tmp_path) == checkpoint
