"""Writes a quantised copy of a float Qwen3-VL checkpoint: by default FP8 in the layout Qwen releases its `-FP8`
checkpoints in (or FP8-dynamic, or NVFP4: below).

The layout (workers/checkpoint_quant.py, workers/model/fp8.py): every text-tower linear's `weight` in float8_e4m3fn
with a float32 `weight_scale_inv` per block; MoE experts one module per expert (`mlp.experts.{e}.gate_proj`, `up_proj`,
`down_proj`, as vLLM's FP8 MoE loader expects them; transformers' own loader cannot read that layout for
qwen3_vl_moe: huggingface/transformers#44230); lm_head, the routers (`mlp.gate`) and the vision tower left in the
source dtype and named in `quantization_config.modules_to_not_convert`. Or (--layout channel) the FP8-dynamic
layout llm-compressor writes: the same tensors with one float32 `weight_scale` [N, 1] per output row and a
compressed-tensors quantization_config. Or (--layout nvfp4) NVIDIA ModelOpt's NVFP4 layout (workers/model/nvfp4.py:
packed e2m1 `weight`, e4m3 `weight_scale` per 16 columns, float32 `weight_scale_2` and `input_scale`), with its
quantization_config; quantised here by ModelOpt's max recipe, not its calibration, so for tests and experiments.
Usage: tests, and `python -m workers.quantized_checkpoint SRC OUT [--block 128 128 | --layout channel | --layout nvfp4]` for
a submitter's own bf16 weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workers.model import nvfp4
from workers.checkpoint_quant import BlockShape
from workers.model.fp8 import quantize_weight_blocks
from workers.model_config import CheckpointError
from workers.weights import TEXT_PREFIX, checkpoint_files

RELEASED_BLOCK = (128, 128)
_SIDE_FILES = ("generation_config.json", "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def quantization_config(block: tuple[int, int], num_layers: int, moe: bool) -> dict:
    """config.json's quantization_config for the FP8 copy."""
    skip = ["lm_head", "model.visual"]
    if moe:
        skip += [f"{TEXT_PREFIX}layers.{i}.mlp.gate" for i in range(num_layers)]
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        "modules_to_not_convert": skip,
    }


def channel_quantization_config() -> dict:
    """config.json's quantization_config of an FP8-dynamic checkpoint as llm-compressor writes it (compressed-tensors
    `float-quantized`: e4m3 weights with one scale per output channel, activations per token at run time; the layout
    of RedHat's Qwen3-VL-235B-A22B-Instruct-FP8-dynamic; keys as workers/checkpoint_quant.py reads them). Left in the
    source dtype: lm_head, the vision tower and the MoE routers."""
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True},
        }},
        "ignore": ["lm_head", "re:.*visual.*", r"re:.*mlp\.gate$"],
    }


def nvfp4_quantization_config() -> dict:
    """config.json's quantization_config of a ModelOpt NVFP4 checkpoint (the flat form; keys as
    workers/checkpoint_quant.py reads them). Left in the source dtype: lm_head, the vision tower, the MoE routers."""
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": nvfp4.GROUP, "kv_cache_quant_algo": None,
            "exclude_modules": ["lm_head", "model.visual*", "*mlp.gate"]}


Layout = Literal["block", "channel", "nvfp4"]


def released_quantization_config(layout: Layout, config: dict) -> dict:
    """The quantization_config a released quantised checkpoint of `config`'s model has: Qwen's 128x128 block layout
    (quantization_config), the FP8-dynamic one (channel_quantization_config) or NVFP4 (nvfp4_quantization_config)."""
    if layout == "channel":
        return channel_quantization_config()
    if layout == "nvfp4":
        return nvfp4_quantization_config()
    return quantization_config(RELEASED_BLOCK, config["text_config"]["num_hidden_layers"],
                               config["model_type"] == "qwen3_vl_moe")


def is_quantised_linear(name: str) -> bool:
    return (name.startswith(TEXT_PREFIX + "layers.") and name.endswith("_proj.weight")
            and ".mlp.gate." not in name)


def _quantized(tensor: torch.Tensor, layout: Layout, block: BlockShape) -> dict[str, torch.Tensor]:
    """One weight [N, K] in `layout`, as {tensor name after "<module>.": tensor}."""
    if layout == "nvfp4":
        packed, scale, global_scale = nvfp4.quantize_nvfp4(tensor)
        return {"weight": packed, "weight_scale": scale, "weight_scale_2": global_scale.float(),
                "input_scale": torch.tensor(1.0)}  # a static FP4 activation scale: read by FP4 engines, not this one
    if layout == "channel":
        q, scale = quantize_weight_blocks(tensor, BlockShape(1, tensor.shape[-1]))
        return {"weight": q, "weight_scale": scale}
    q, scale = quantize_weight_blocks(tensor, block)
    return {"weight": q, "weight_scale_inv": scale}


def _checkpoint_tensors(name: str, tensor: torch.Tensor, layout: Layout, block: BlockShape, text: dict) -> dict[str, torch.Tensor]:
    """The quantised checkpoint's tensors for one source tensor."""
    if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return _per_expert(name, tensor, layout, block, text)
    if is_quantised_linear(name):
        module = name.removesuffix("weight")
        return {module + suffix: t for suffix, t in _quantized(tensor, layout, block).items()}
    return {name: tensor}


def _per_expert(name: str, tensor: torch.Tensor, layout: Layout, block: BlockShape, text: dict) -> dict[str, torch.Tensor]:
    """Fused experts (released [E, H, 2I] / [E, I, H] or transformers' [E, 2I, H] / [E, H, I]) as one quantised
    gate_proj [I, H], up_proj [I, H] and down_proj [H, I] per expert."""
    hidden, inter = text["hidden_size"], text["moe_intermediate_size"]
    prefix = name.rsplit(".", 1)[0] + "."
    out: dict[str, torch.Tensor] = {}
    if name.endswith("gate_up_proj"):
        memory = tensor if tensor.shape[1:] == (2 * inter, hidden) else tensor.transpose(1, 2)
        parts = {"gate_proj": memory[:, :inter], "up_proj": memory[:, inter:]}
    else:
        parts = {"down_proj": tensor if tensor.shape[1:] == (hidden, inter) else tensor.transpose(1, 2)}
    for proj, weights in parts.items():
        for e in range(weights.shape[0]):
            for suffix, t in _quantized(weights[e].contiguous(), layout, block).items():
                out[f"{prefix}{e}.{proj}.{suffix}"] = t
    return out


def quantize_checkpoint(src: Path, out: Path, block: tuple[int, int] = RELEASED_BLOCK, layout: Layout = "block") -> Path:
    """Writes out/ (built aside and renamed into place): config.json with quantization_config, the side configs, and
    the weights shard by shard with an index. layout "block": Qwen's released layout in `block`s; "channel": the
    FP8-dynamic one (one scale per output row, channel_quantization_config); "nvfp4": ModelOpt's NVFP4
    (nvfp4_quantization_config). Refuses a source already quantised."""
    src, out = Path(src), Path(out)
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise CheckpointError(f"{src / 'config.json'} already has a quantization_config")
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    text = config["text_config"]
    shape = BlockShape(*block)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    config["quantization_config"] = (
        quantization_config(block, text["num_hidden_layers"], config["model_type"] == "qwen3_vl_moe") if layout == "block"
        else released_quantization_config(layout, config))
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for side in _SIDE_FILES:
        if (src / side).exists():
            shutil.copy(src / side, staging / side)
    files = checkpoint_files(src)
    weight_map: dict[str, str] = {}
    for index, path in enumerate(files, start=1):
        filename = "model.safetensors" if len(files) == 1 else f"model-{index:05d}-of-{len(files):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors.update(_checkpoint_tensors(name, f.get_tensor(name), layout, shape, text))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / filename), metadata={"format": "pt"})
        weight_map.update({name: filename for name in tensors})
    if len(files) > 1:
        index_json = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (staging / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    os.rename(staging, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path, help="a float (bf16/fp32) Qwen3-VL checkpoint directory")
    parser.add_argument("out", type=Path, help="where to write the FP8 copy (must not exist)")
    parser.add_argument("--block", type=int, nargs=2, default=list(RELEASED_BLOCK), metavar=("ROWS", "COLS"))
    parser.add_argument("--layout", choices=("block", "channel", "nvfp4"), default="block", help="block: Qwen's "
                        "released FP8 layout; channel: FP8-dynamic (compressed-tensors, one scale per output channel); "
                        "nvfp4: ModelOpt NVFP4")
    args = parser.parse_args(argv)
    print(quantize_checkpoint(args.src, args.out, tuple(args.block), args.layout))


if __name__ == "__main__":
    main()
