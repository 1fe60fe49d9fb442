"""Tiny and real-shape random Qwen3-VL checkpoints: transformers loads them exactly and they behave."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from workers.inputs.image_processing import preprocess
from workers.random_checkpoint import RandomCheckpointSpec, make_random_checkpoint, tensor_shapes
from workers.tiny_checkpoint import make_tiny_checkpoint, released_config

transformers = pytest.importorskip("transformers")

CHAT_PREFIX = [151644, 872, 198]  # <|im_start|>user\n
ASSISTANT = [151645, 198, 151644, 77091, 198]  # <|im_end|>\n<|im_start|>assistant\n

# Real 30B-A3B layout shrunk so the files stay small: real vocabulary, tiny widths.
SHRUNK = {
    "text_config.hidden_size": 64,
    "text_config.intermediate_size": 128,
    "text_config.num_attention_heads": 4,
    "text_config.num_key_value_heads": 2,
    "text_config.head_dim": 16,
    "text_config.moe_intermediate_size": 48,
    "text_config.num_experts_per_tok": 2,
    "text_config.rope_scaling": {"mrope_interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default"},
    "vision_config.depth": 2,
    "vision_config.hidden_size": 32,
    "vision_config.num_heads": 2,
    "vision_config.intermediate_size": 64,
    "vision_config.out_hidden_size": 64,
    "vision_config.deepstack_visual_indexes": [0, 1],
}


def load(checkpoint: Path):
    model_type = json.loads((checkpoint / "config.json").read_text())["architectures"][0]
    model, info = getattr(transformers, model_type).from_pretrained(checkpoint, output_loading_info=True)
    return model.eval(), info


def safetensors_keys(checkpoint: Path) -> dict[str, str]:
    keys = {}
    for path in checkpoint.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            keys.update({key: path.name for key in f.keys()})
    return keys


def all_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in checkpoint.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


@pytest.mark.parametrize("fixture", ["tiny_moe_checkpoint", "tiny_dense_checkpoint"])
def test_tiny_checkpoint_loads_exactly_and_greedy_text_generation_varies(fixture, request):
    model, info = load(request.getfixturevalue(fixture))
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())

    prompt = torch.tensor([CHAT_PREFIX + [9707, 11, 1879, 0] + ASSISTANT])
    out = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1] :]

    assert len(out) == 12
    assert len(set(out.tolist())) > 3  # not collapsed onto one token


def test_tiny_checkpoint_generates_from_an_image_preprocessed_by_us(tiny_moe_checkpoint):
    model, _ = load(tiny_moe_checkpoint)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (200, 300, 3), dtype=np.uint8))
    pixel_values, grid_thw = preprocess([image])
    n_tokens = int(grid_thw.prod()) // 4
    ids = CHAT_PREFIX + [151652] + [151655] * n_tokens + [151653, 9707] + ASSISTANT

    def first_tokens(pixels: torch.Tensor) -> list[int]:
        out = model.generate(
            torch.tensor([ids]), pixel_values=pixels, image_grid_thw=grid_thw, max_new_tokens=4, do_sample=False
        )
        return out[0, len(ids) :].tolist()

    assert first_tokens(pixel_values) != first_tokens(-pixel_values)  # the image reaches the text tower


def test_tiny_checkpoint_files_carry_the_real_ids_sampling_defaults_and_preprocessor(tiny_moe_checkpoint):
    config = json.loads((tiny_moe_checkpoint / "config.json").read_text())
    generation = json.loads((tiny_moe_checkpoint / "generation_config.json").read_text())
    preprocessor = json.loads((tiny_moe_checkpoint / "preprocessor_config.json").read_text())
    text = config["text_config"]

    assert config["architectures"] == ["Qwen3VLMoeForConditionalGeneration"]
    assert (config["image_token_id"], config["vision_start_token_id"], config["vision_end_token_id"]) == (
        151655, 151652, 151653,
    )
    assert text["vocab_size"] == 151936
    assert text["rope_parameters"]["mrope_interleaved"] is True
    assert sum(text["rope_parameters"]["mrope_section"]) == text["head_dim"] // 2
    assert text["rope_parameters"]["rope_theta"] == 5_000_000
    assert max(config["vision_config"]["deepstack_visual_indexes"]) < config["vision_config"]["depth"]
    expected_sampling = {
        "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
        "eos_token_id": [151645, 151643], "pad_token_id": 151643, "bos_token_id": 151643,
    }
    assert {k: generation[k] for k in expected_sampling} == expected_sampling
    assert preprocessor["size"] == {"shortest_edge": 65536, "longest_edge": 16777216}
    assert preprocessor["image_mean"] == preprocessor["image_std"] == [0.5, 0.5, 0.5]


def test_tiny_checkpoint_is_deterministic_by_seed_and_not_rewritten(tmp_path):
    first = make_tiny_checkpoint(tmp_path / "a", arch="dense", seed=3)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    again = make_tiny_checkpoint(tmp_path / "a", arch="dense", seed=3)
    twin = make_tiny_checkpoint(tmp_path / "b", arch="dense", seed=3)
    other = make_tiny_checkpoint(tmp_path / "c", arch="dense", seed=4)

    assert (again / "model.safetensors").stat().st_mtime_ns == mtime
    assert (first / "model.safetensors").read_bytes() == (twin / "model.safetensors").read_bytes()
    assert (first / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_tiny_checkpoint_rebuilds_when_args_change(tmp_path):
    make_tiny_checkpoint(tmp_path / "ck", arch="dense", seed=0)
    rebuilt = make_tiny_checkpoint(tmp_path / "ck", arch="moe", seed=0)
    assert json.loads((rebuilt / "config.json").read_text())["model_type"] == "qwen3_vl_moe"


def test_tiny_checkpoint_refuses_to_overwrite_a_foreign_directory(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a tiny checkpoint"):
        make_tiny_checkpoint(tmp_path / "mine", arch="moe")


def test_sharded_tiny_checkpoint_index_maps_every_tensor_to_its_shard(tmp_path):
    sharded = make_tiny_checkpoint(tmp_path / "sharded", arch="moe", seed=0, shards=3)
    single = make_tiny_checkpoint(tmp_path / "single", arch="moe", seed=0)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())

    assert sorted(p.name for p in sharded.glob("*.safetensors")) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    ]
    assert index["weight_map"] == safetensors_keys(sharded)
    sharded_tensors, single_tensors = all_tensors(sharded), all_tensors(single)
    assert sharded_tensors.keys() == single_tensors.keys()
    assert all(torch.equal(sharded_tensors[k], single_tensors[k]) for k in single_tensors)


@pytest.mark.parametrize("layout", ["release", "transformers"])
def test_random_real_layout_checkpoint_loads_in_transformers_with_no_missing_keys(tmp_path, layout):
    spec = RandomCheckpointSpec(
        preset="qwen3-vl-30b-a3b", num_layers=1, num_experts=4, overrides=SHRUNK,
        expert_layout=layout, max_shard_bytes=30_000_000,
    )
    checkpoint = make_random_checkpoint(tmp_path / "random", spec)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())

    model, info = load(checkpoint)

    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert index["weight_map"] == safetensors_keys(checkpoint)
    assert len(index["weight_map"]) == len(model.state_dict())
    assert json.loads((checkpoint / "config.json").read_text())["text_config"]["rope_theta"] == 5000000
    experts = model.model.language_model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (4, 96, 64)  # transformers' own layout once loaded
    assert torch.equal(model.model.language_model.norm.weight, torch.ones(64))


@pytest.mark.parametrize("preset, billions", [("qwen3-vl-30b-a3b", 31.07), ("qwen3-vl-235b-a22b", 235.67)])
def test_real_shapes_have_the_published_parameter_count(preset, billions):
    shapes = dict(tensor_shapes(released_config(preset), "release"))
    total = sum(int(np.prod(shape)) for shape in shapes.values())

    assert total / 1e9 == pytest.approx(billions, abs=0.01)
    assert shapes["lm_head.weight"][0] == 151936
    hidden = shapes["model.language_model.embed_tokens.weight"][1]
    experts, h, two_i = shapes["model.language_model.layers.0.mlp.experts.gate_up_proj"]  # released [E, H, 2I]
    _, i, h_out = shapes["model.language_model.layers.0.mlp.experts.down_proj"]  # released [E, I, H]
    assert (experts, h, two_i, h_out) == (128, hidden, 2 * i, hidden)


def test_config_override_of_an_unknown_key_names_it():
    with pytest.raises(KeyError, match="text_config.num_layers"):
        released_config("qwen3-vl-30b-a3b", {"text_config.num_layers": 2})



def test_building_a_tiny_checkpoint_does_not_change_what_later_calls_expect(tmp_path):
    """transformers mutates nested config dicts it is given; the stamp a later process computes must still
    match, or every new process would rebuild (and swap out) a checkpoint others are reading."""
    import json

    from workers import tiny_checkpoint

    before = json.dumps(tiny_checkpoint._expected_stamp("moe", 0, 1), sort_keys=True)
    tiny_checkpoint.make_tiny_checkpoint(tmp_path / "ckpt", arch="moe", seed=0)
    after = json.dumps(tiny_checkpoint._expected_stamp("moe", 0, 1), sort_keys=True)
    assert before == after


@pytest.mark.parametrize(("precision", "scale_suffix", "method"), [
    ("fp8", "weight_scale_inv", "fp8_block"),  # Qwen's released layout: a scale per 128x128 block
    ("fp8-dynamic", "weight_scale", "fp8_channel"),  # the FP8-dynamic one: a scale per output row
])
def test_random_fp8_checkpoints_are_in_their_layout_and_load(tmp_path, precision, scale_suffix, method):
    from workers.config import EngineConfig
    from workers.checkpoint_quant import BlockShape
    from workers.model.fp8 import FP8_DTYPE
    from workers.executor.model_runner import build_text_model
    from workers.model_config import load_model_config

    spec = RandomCheckpointSpec(preset="qwen3-vl-30b-a3b", num_layers=1, num_experts=4, overrides=SHRUNK,
                                precision=precision, max_shard_bytes=30_000_000)
    checkpoint = make_random_checkpoint(tmp_path / f"random-{precision}", spec)
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    name = "model.language_model.layers.0.mlp.experts.3.down_proj.weight"
    with safe_open(str(checkpoint / index["weight_map"][name]), framework="pt") as f:
        weight, scale = f.get_tensor(name), f.get_tensor(name.removesuffix("weight") + scale_suffix)
    assert weight.dtype == FP8_DTYPE and scale.dtype == torch.float32
    block = BlockShape(128, 128) if method == "fp8_block" else BlockShape(1, weight.shape[1])
    assert tuple(scale.shape) == block.grid(*weight.shape)
    assert index["weight_map"] == safetensors_keys(checkpoint)
    config = load_model_config(checkpoint)
    assert config.weight_format.method == method
    model = build_text_model(EngineConfig(checkpoint=checkpoint, fp8_compute="fp8"), config, torch.device("cpu"), torch.float32)
    experts = model.language_model.layers[0].mlp.experts
    assert experts.down_proj.dtype == FP8_DTYPE
    assert experts.block.k == (128 if method == "fp8_block" else 1 << 30)  # K groups of 128, or the whole row
