"""Writes a random-weight Qwen3-VL checkpoint of the real shapes (30B-A3B, 235B-A22B) for performance runs.

Tensors are streamed to safetensors shard by shard and never held in memory; names and shapes come from a
meta-device instance of the transformers class. The command line: scripts/make_random_checkpoint.py --help
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from workers.tiny_checkpoint import (
    released_config,
    transformers_config,
    write_side_configs,
)

log = logging.getLogger(__name__)

BYTES_PER_VALUE = 2  # bfloat16
INIT_STD = 0.02
PATTERN_VALUES = 1 << 20  # random values per pattern block; tensors repeat it from a random offset
_BF16_ONE = np.array([0x3F80], dtype=np.uint16)
_EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")

TensorShapes = list[tuple[str, tuple[int, ...]]]  # (name, shape) in file order
# FP8 layout (workers/quantized_checkpoint.py): e4m3 values ~N(0, 64^2) (bytes of a pattern), each tensor's scales INIT_STD/64.
FP8_SPREAD = 64.0


@dataclass(frozen=True)
class RandomCheckpointSpec:
    """What to write. expert_layout "release" stores fused experts as the released checkpoints do
    (gate_up_proj [E, H, 2I], down_proj [E, I, H]); "transformers" as transformers v5 saves them
    ([E, 2I, H], [E, H, I]). transformers' from_pretrained loads both."""

    preset: str = "qwen3-vl-30b-a3b"
    num_layers: int | None = None
    num_experts: int | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    expert_layout: Literal["release", "transformers"] = "release"
    # fp8: Qwen's released FP8 layout (per-expert, 128x128 blocks); fp8-dynamic: the FP8-dynamic one (per-expert,
    # one weight_scale per output row, compressed-tensors quantization_config)
    precision: Literal["bf16", "fp8", "fp8-dynamic"] = "bf16"
    max_shard_bytes: int = 5 * 10**9
    seed: int = 0

    def config(self) -> dict[str, Any]:
        overrides = dict(self.overrides)
        if self.num_layers is not None:
            overrides["text_config.num_hidden_layers"] = self.num_layers
        if self.num_experts is not None:
            overrides["text_config.num_experts"] = self.num_experts
        config = released_config(self.preset, overrides)
        if self.precision != "bf16":
            from workers.quantized_checkpoint import released_quantization_config

            config["quantization_config"] = released_quantization_config(
                "channel" if self.precision == "fp8-dynamic" else "block", config)
        return config


def tensor_shapes(config: Mapping[str, Any], expert_layout: str) -> TensorShapes:
    """(name, shape) of every tensor save_pretrained would write for this config, without allocating any; with a
    quantization_config, the FP8 layout's names and shapes instead (fp8_shapes)."""
    if "quantization_config" in config:
        return fp8_shapes(config, _float_shapes(config, "transformers"))
    return _float_shapes(config, expert_layout)


def fp8_shapes(config: Mapping[str, Any], shapes: TensorShapes) -> TensorShapes:
    """The FP8 layout of float shapes (memory-layout experts): per-expert gate/up/down, and after each quantised
    linear a weight_scale_inv [ceil(N/128), ceil(K/128)] (the released block layout) or a weight_scale [N, 1] (the
    FP8-dynamic layout, quant_method compressed-tensors)."""
    from workers.quantized_checkpoint import is_quantised_linear
    from workers.checkpoint_quant import BlockShape

    q = config["quantization_config"]
    blocks = q["quant_method"] == "fp8"
    block = BlockShape(*q["weight_block_size"]) if blocks else None
    text = config["text_config"]
    inter, hidden = text["moe_intermediate_size"], text["hidden_size"]
    out: TensorShapes = []

    def linear(name: str, shape: tuple[int, int]) -> None:
        out.append((name, shape))
        if blocks:
            out.append((name.removesuffix("weight") + "weight_scale_inv", block.grid(*shape)))
        else:
            out.append((name.removesuffix("weight") + "weight_scale", (shape[0], 1)))

    for name, shape in shapes:
        if name.endswith("mlp.experts.gate_up_proj"):
            for e in range(shape[0]):
                for proj in ("gate_proj", "up_proj"):
                    linear(f"{name.rsplit('.', 1)[0]}.{e}.{proj}.weight", (inter, hidden))
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(shape[0]):
                linear(f"{name.rsplit('.', 1)[0]}.{e}.down_proj.weight", (hidden, inter))
        elif is_quantised_linear(name):
            linear(name, shape)
        else:
            out.append((name, shape))
    return out


def _float_shapes(config: Mapping[str, Any], expert_layout: str) -> TensorShapes:
    import torch
    import transformers

    model_class = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        model = model_class(transformers_config(config))
    shapes = []
    for name, tensor in model.state_dict().items():
        shape = tuple(tensor.shape)
        if expert_layout == "release" and name.endswith(_EXPERT_TENSORS):
            shape = (*shape[:-2], shape[-1], shape[-2])
        shapes.append((name, shape))
    return shapes


def _dtype(name: str, fp8: bool) -> tuple[str, int]:
    """(safetensors dtype, bytes per value) of a tensor of the checkpoint."""
    if not fp8:
        return "BF16", BYTES_PER_VALUE
    if name.endswith(("weight_scale_inv", "weight_scale")):
        return "F32", 4
    from workers.quantized_checkpoint import is_quantised_linear

    return ("F8_E4M3", 1) if is_quantised_linear(name) else ("BF16", BYTES_PER_VALUE)


def plan_shards(shapes: TensorShapes, max_shard_bytes: int, fp8: bool = False) -> list[TensorShapes]:
    """Greedy split in order (as save_pretrained does); a tensor larger than the limit gets a shard of its own."""
    shards: list[TensorShapes] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = int(np.prod(shape)) * _dtype(name, fp8)[1]
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _random_pattern(seed: int) -> np.ndarray:
    """PATTERN_VALUES values ~N(0, INIT_STD) as bfloat16 bit patterns, stored twice so any offset can be sliced."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    values = (torch.randn(PATTERN_VALUES, generator=generator) * INIT_STD).to(torch.bfloat16)
    bits = values.view(torch.int16).numpy().view(np.uint16)
    return np.concatenate([bits, bits])


def _fp8_pattern(seed: int) -> np.ndarray:
    """PATTERN_VALUES e4m3 bytes of values ~N(0, FP8_SPREAD^2), stored twice."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    values = (torch.randn(PATTERN_VALUES, generator=generator) * FP8_SPREAD).clamp(-448, 448).to(torch.float8_e4m3fn)
    bits = values.view(torch.uint8).numpy()
    return np.concatenate([bits, bits])


def _tensor_chunks(name: str, count: int, pattern: np.ndarray, rng: np.random.Generator, dtype: str = "BF16") -> Iterator[bytes]:
    """The bytes of one tensor: ones for norm weights (so activations keep their scale), one scale for an FP8
    tensor's scales, else the pattern (bf16 or e4m3)."""
    if dtype == "F32":
        yield np.full(count, INIT_STD / FP8_SPREAD, dtype=np.float32).tobytes()
        return
    if "norm" in name and name.endswith(".weight"):
        yield np.broadcast_to(_BF16_ONE, (count,)).tobytes()
        return
    offset = int(rng.integers(PATTERN_VALUES))
    while count > 0:
        take = min(count, PATTERN_VALUES)
        yield pattern[offset : offset + take].tobytes()
        count -= take


def write_safetensors(
    path: Path, tensors: TensorShapes, pattern: np.ndarray, rng: np.random.Generator, fp8_pattern: np.ndarray | None = None,
) -> None:
    """Writes one safetensors file (bfloat16 tensors; with fp8_pattern the FP8 layout's e4m3 weights and float32
    scales too), streaming the data after the header."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        dtype, size = _dtype(name, fp8_pattern is not None)
        nbytes = int(np.prod(shape)) * size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for name, shape in tensors:
            dtype = header[name]["dtype"]
            source = fp8_pattern if dtype == "F8_E4M3" else pattern
            for chunk in _tensor_chunks(name, int(np.prod(shape)), source, rng, dtype):
                f.write(chunk)


def make_random_checkpoint(out_dir: Path, spec: RandomCheckpointSpec) -> Path:
    """Writes config.json (released layout, bfloat16), generation/preprocessor configs and the sharded
    weights into out_dir, built aside in out_dir.partial and renamed into place when complete."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another --out")
    config = spec.config()
    shapes = tensor_shapes(config, spec.expert_layout)
    fp8 = spec.precision != "bf16"
    shards = plan_shards(shapes, spec.max_shard_bytes, fp8)
    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_side_configs(staging)

    pattern = _random_pattern(spec.seed)
    fp8_pattern = _fp8_pattern(spec.seed) if fp8 else None
    rng = np.random.default_rng(spec.seed)
    weight_map: dict[str, str] = {}
    for index, tensors in enumerate(shards, start=1):
        filename = "model.safetensors" if len(shards) == 1 else f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(staging / filename, tensors, pattern, rng, fp8_pattern)
        weight_map.update({name: filename for name, _ in tensors})
        log.info("wrote %s (%d tensors)", filename, len(tensors))
    if len(shards) > 1:
        total = sum(int(np.prod(shape)) for _, shape in shapes)
        index_json = {
            "metadata": {"total_parameters": total,
                         "total_size": sum(int(np.prod(shape)) * _dtype(n, fp8)[1] for n, shape in shapes)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (staging / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    os.rename(staging, out_dir)
    return out_dir
