"""The weight format a checkpoint declares in config.json's `quantization_config`: bfloat16 (none), FP8 in blocks
(`quant_method: fp8`, Qwen's released `-FP8` checkpoints) or FP8 per output channel (compressed-tensors
`float-quantized`, the "FP8-dynamic" checkpoints llm-compressor writes, e.g. RedHat's Qwen3-VL-235B-A22B one).

Facts used, with their public sources:
* fp8 (transformers `FineGrainedFP8Config`, vLLM `Fp8Config.from_config`): keys `quant_method: "fp8"`, `fmt: "e4m3"`,
  `activation_scheme: "dynamic"` (activations quantised on the fly; "static" carries `activation_scale` tensors, not
  supported here), `weight_block_size: [128, 128]`, `modules_to_not_convert` (module names left in bf16: lm_head, the
  vision tower, the MoE routers `mlp.gate`). Tensors: `<module>.weight` float8_e4m3fn and `<module>.weight_scale_inv`.
* compressed-tensors (vLLM `CompressedTensorsConfig`, llm-compressor's `FP8_DYNAMIC` scheme): `quant_method:
  "compressed-tensors"`, `format: "float-quantized"`, `config_groups.*.weights` {num_bits 8, type float, strategy
  "channel", symmetric} and `input_activations` {strategy "token", dynamic true}, `ignore` (names or `re:` regexes).
  Tensors: `<module>.weight` float8_e4m3fn and `<module>.weight_scale` [N, 1]: one dequantisation scale per output
  row. That is a block of 1 row x all columns, so both formats load into one representation (workers/model/fp8.py).
* modelopt NVFP4 (vLLM `ModelOptNvFp4Config.from_config`, the flat form config.json carries): `quant_method:
  "modelopt"`, `quant_algo: "NVFP4"`, `group_size: 16`, `exclude_modules` (names with `*` wildcards, matched
  against whole module names), `kv_cache_quant_algo` ("FP8" or null). Tensors: workers/model/nvfp4.py. Hopper has no
  FP4 tensor cores, so the loader converts each NVFP4 weight to e4m3 with one scale per output row at load, and the
  engine serves it as it serves FP8-dynamic (per-token activations, row-wise FP8 GEMMs): 4-bit weights on disk,
  8-bit in memory, with e4m3's rounding on top of the checkpoint's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

# A block as wide as any weight: per-channel scales are one K group.
WHOLE_ROW = 1 << 30


@dataclass(frozen=True)
class BlockShape:
    """Rows (output features) x columns (input features) covered by one weight scale."""

    n: int
    k: int

    def grid(self, rows: int, cols: int) -> tuple[int, int]:
        """The scale tensor's last two dims for a [rows, cols] weight (ragged edge blocks count)."""
        return -(-rows // self.n), -(-cols // self.k)


class QuantizationConfigError(ValueError):
    """config.json's quantization_config asks for a format this engine cannot serve."""


@dataclass(frozen=True)
class WeightFormat:
    """How the checkpoint stores its quantised linears. method "none": every tensor is a float tensor."""

    method: Literal["none", "fp8_block", "fp8_channel", "nvfp4"] = "none"
    block: BlockShape | None = None  # the scale granularity the engine loads (nvfp4: per row, after conversion)
    scale_suffix: str = ""  # the scale tensor's name: "<module>." + scale_suffix
    skip: tuple[str, ...] = ()  # module names (or "re:" patterns) the checkpoint leaves unquantised
    group: int = 0  # nvfp4: columns per weight_scale entry on disk

    @property
    def is_fp8(self) -> bool:
        return self.method != "none"

    @property
    def label(self) -> str:
        """What the run's calibration note and logs say about the weights."""
        if self.method == "fp8_block":
            return f"fp8 e4m3 weights in {self.block.n}x{self.block.k} blocks, dynamic per-token-group activations"
        if self.method == "fp8_channel":
            return "fp8 e4m3 weights per output channel, dynamic per-token activations"
        if self.method == "nvfp4":
            return (f"nvfp4 weights (e2m1, e4m3 scales per {self.group} columns) served as fp8 e4m3 per output "
                    "channel, dynamic per-token activations")
        return "bfloat16 weights"

    @property
    def checkpoint_weights(self) -> Literal["bf16", "fp8", "nvfp4"]:
        """The format a system config names for this checkpoint (model.weights)."""
        return "nvfp4" if self.method == "nvfp4" else "fp8" if self.is_fp8 else "bf16"

    def skips(self, module: str) -> bool:
        """Whether the checkpoint names `module` (full name, e.g. model.language_model.layers.0.mlp.gate) as left
        unquantised: an exact name, a parent of it, or a `re:` pattern that matches it."""
        for entry in self.skip:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif module == entry or module.startswith(entry + ".") or module.endswith("." + entry):
                return True
        return False


def weight_format(raw_config: dict, where: str = "config.json") -> WeightFormat:
    """The WeightFormat of a config.json dict; raises QuantizationConfigError naming the key it cannot serve."""
    q = raw_config.get("quantization_config")
    if q is None:
        return WeightFormat()
    method = q.get("quant_method")
    if method == "fp8":
        return _fp8_block(q, where)
    if method == "compressed-tensors":
        return _compressed_tensors(q, where)
    if method == "modelopt":
        return _modelopt(q, where)
    raise QuantizationConfigError(
        f"{where}: quantization_config.quant_method {method!r} is not one of 'fp8', 'compressed-tensors', 'modelopt'")


def _modelopt(q: dict, where: str) -> WeightFormat:
    key = f"{where}: quantization_config"
    if q.get("quant_algo") != "NVFP4":
        raise QuantizationConfigError(f"{key}.quant_algo {q.get('quant_algo')!r}: only 'NVFP4' is supported")
    group = q.get("group_size", 16)
    if not (isinstance(group, int) and group > 0 and group % 2 == 0):
        raise QuantizationConfigError(f"{key}.group_size {group!r}: expected a positive even integer (16)")
    patterns = q.get("exclude_modules") or []
    if not isinstance(patterns, list):
        raise QuantizationConfigError(f"{key}.exclude_modules: expected a list of module names")
    skip = tuple("re:" + re.escape(p).replace(r"\*", ".*") + "$" if "*" in p else p for p in patterns)
    return WeightFormat("nvfp4", BlockShape(1, WHOLE_ROW), "weight_scale", skip, group)


def _fp8_block(q: dict, where: str) -> WeightFormat:
    key = f"{where}: quantization_config"
    if q.get("fmt", "e4m3") != "e4m3":
        raise QuantizationConfigError(f"{key}.fmt {q.get('fmt')!r}: only 'e4m3' is supported")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise QuantizationConfigError(f"{key}.activation_scheme {q.get('activation_scheme')!r}: only 'dynamic' is supported")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantizationConfigError(f"{key}.weight_block_size {block!r}: expected two positive integers, e.g. [128, 128]")
    skip = q.get("modules_to_not_convert") or []
    return WeightFormat("fp8_block", BlockShape(*block), "weight_scale_inv", tuple(skip))


def _compressed_tensors(q: dict, where: str) -> WeightFormat:
    key = f"{where}: quantization_config"
    if q.get("format") != "float-quantized":
        raise QuantizationConfigError(f"{key}.format {q.get('format')!r}: only 'float-quantized' (FP8) is supported")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantizationConfigError(f"{key}.config_groups: expected one group, got {len(groups)}")
    (name, group), = groups.items()
    weights, acts = group.get("weights") or {}, group.get("input_activations") or {}
    wanted = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
    for field, value in wanted.items():
        if weights.get(field) != value:
            raise QuantizationConfigError(f"{key}.config_groups.{name}.weights.{field} {weights.get(field)!r}: expected {value!r}")
    if acts and not (acts.get("dynamic") is True and acts.get("strategy") in ("token", "group")):
        raise QuantizationConfigError(f"{key}.config_groups.{name}.input_activations: only dynamic per-token activations are supported")
    return WeightFormat("fp8_channel", BlockShape(1, WHOLE_ROW), "weight_scale", tuple(q.get("ignore") or ()))
