"""Reads a Qwen3-VL checkpoint's tensors, (sharded) safetensors, into the engine's modules (its configs:
workers/model_config.py).

Text-tower weights load by name into the engine's modules; MoE experts are accepted in the official
layout (gate_up_proj [E, H, 2I], down_proj [E, I, H]) and in transformers' in-memory layout.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from workers.checkpoint_quant import BlockShape, WeightFormat, weight_format
from workers.model import fp8, nvfp4
from workers.model.fp8 import FP8_DTYPE, FP8_MAX, dequantize_weight_blocks
from workers.model.layers import rows_scale
from workers.model.vision import build_vision_module
from workers.model_config import CheckpointError, ModelConfig, read_json


TEXT_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
LM_HEAD = "lm_head.weight"


def checkpoint_files(checkpoint: Path) -> list[Path]:
    """model.safetensors, or the shards named by model.safetensors.index.json."""
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(read_json(index)["weight_map"].values()))
        files = [checkpoint / s for s in shards]
    else:
        files = [checkpoint / "model.safetensors"]
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{f} not found")
    return files


class CheckpointIndex:
    """Every tensor of a checkpoint by name, over all its shards; tensors are read one at a time on request."""

    def __init__(self, checkpoint: Path):
        self.checkpoint = checkpoint
        self._file_of: dict[str, Path] = {}
        self._open: dict[Path, object] = {}
        for path in checkpoint_files(checkpoint):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    self._file_of[name] = path

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def names(self, prefix: str = "") -> list[str]:
        return [n for n in self._file_of if n.startswith(prefix)]

    def _handle(self, name: str):
        path = self._file_of[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path]

    def get(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise CheckpointError(f"{self.checkpoint}: tensor {name} not found")
        return self._handle(name).get_tensor(name)

    def is_fp8(self, name: str) -> bool:
        return name in self._file_of and self._handle(name).get_slice(name).get_dtype() == "F8_E4M3"

    def is_quantized(self, name: str, fmt: WeightFormat) -> bool:
        """Whether `name` is a quantised weight of `fmt`: float8_e4m3fn, or (nvfp4) uint8 packed e2m1 codes."""
        if fmt.method == "nvfp4":
            return name in self._file_of and self._handle(name).get_slice(name).get_dtype() == "U8"
        return self.is_fp8(name)


NVFP4_SIDE_SUFFIXES = ("weight_scale_2", "input_scale")  # an NVFP4 weight's global and (unused) activation scales


def side_tensors(index: CheckpointIndex, names: list[str], fmt: WeightFormat) -> set[str]:
    """The tensors that travel with the quantised weights among `names` (their scales; for nvfp4 also the global
    weight_scale_2 and the input_scale), read with their weight and never loaded on their own."""
    if not fmt.is_fp8:
        return set()
    out = set()
    for name in names:
        if index.is_quantized(name, fmt):
            out.add(scale_name(name, fmt))
            if fmt.method == "nvfp4":
                out.update(name.removesuffix("weight") + suffix for suffix in NVFP4_SIDE_SUFFIXES)
    return out


def scale_name(weight_name: str, fmt: WeightFormat) -> str:
    """The checkpoint name of a quantised tensor's scale: <module>.weight_scale_inv (fp8) or <module>.weight_scale
    (compressed-tensors); a fused expert tensor <...>.gate_up_proj has <...>.gate_up_proj_scale_inv (transformers'
    FP8Experts)."""
    if weight_name.endswith(".weight"):
        return weight_name.removesuffix("weight") + fmt.scale_suffix
    return weight_name + "_" + fmt.scale_suffix


@dataclass
class QuantTensor:
    """An FP8 checkpoint tensor [..., N, K] with one float32 scale per row and K block [..., N, ceil(K/block.k)]:
    the checkpoint's block scales expanded over their rows, so that any row slice or concatenation stays exact."""

    weight: torch.Tensor
    scale: torch.Tensor
    block_k: int

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_weight_blocks(self.weight, self.scale, BlockShape(1, self.block_k), dtype)


def read_weight(index: CheckpointIndex, name: str, fmt: WeightFormat) -> torch.Tensor | QuantTensor:
    """A checkpoint tensor; an FP8 one with its scale, checked against the format's block shape; an NVFP4 one
    converted to e4m3 with one scale per row (_read_nvfp4)."""
    tensor = index.get(name)
    if tensor.dtype == torch.uint8:
        if fmt.method != "nvfp4":
            raise CheckpointError(f"{name} is uint8 (packed FP4?) but config.json declares no NVFP4 quantization_config")
        return _read_nvfp4(index, name, tensor, fmt)
    if tensor.dtype != FP8_DTYPE:
        return tensor
    if not fmt.is_fp8:
        raise CheckpointError(f"{name} is float8_e4m3fn but config.json declares no quantization_config")
    sname = scale_name(name, fmt)
    if sname not in index:
        raise CheckpointError(f"{name} is float8_e4m3fn but its scale tensor {sname} is missing")
    scale = index.get(sname).float()
    rows, cols = tensor.shape[-2:]
    expected = (*tensor.shape[:-2], *fmt.block.grid(rows, cols))
    if tuple(scale.shape) != expected:
        raise CheckpointError(
            f"{sname}: shape {tuple(scale.shape)}, expected {expected} for {name} {tuple(tensor.shape)} in "
            f"{min(fmt.block.n, rows)}x{min(fmt.block.k, cols)} blocks"
        )
    if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
        raise CheckpointError(f"{sname}: scales must be finite and positive")
    return QuantTensor(tensor, rows_scale(scale, fmt.block, rows), fmt.block.k)


def _read_nvfp4(index: CheckpointIndex, name: str, packed: torch.Tensor, fmt: WeightFormat) -> QuantTensor:
    """An NVFP4 weight (workers/model/nvfp4.py) dequantised exactly in float32, then as e4m3 with one float32 scale
    per row (amax / 448): the FP8-dynamic representation the engine serves. Its scales are checked first, by name."""
    module = name.removesuffix("weight")
    scale_key, global_key = module + "weight_scale", module + "weight_scale_2"
    for key in (scale_key, global_key):
        if key not in index:
            raise CheckpointError(f"{name} is NVFP4 (uint8) but its scale tensor {key} is missing")
    scale, global_scale = index.get(scale_key), index.get(global_key)
    cols = 2 * packed.shape[-1]
    if cols % fmt.group:
        raise CheckpointError(f"{name}: {cols} columns are not a whole number of groups of {fmt.group}")
    expected = (*packed.shape[:-1], cols // fmt.group)
    if scale.dtype != FP8_DTYPE or tuple(scale.shape) != expected:
        raise CheckpointError(f"{scale_key}: {scale.dtype} {tuple(scale.shape)}, expected float8_e4m3fn {expected} for "
                              f"{name} (uint8 {tuple(packed.shape)}: {cols} columns in groups of {fmt.group})")
    if global_scale.numel() != 1 or not bool(torch.isfinite(global_scale).all()) or float(global_scale) <= 0:
        raise CheckpointError(f"{global_key}: expected one finite positive scale, got shape {tuple(global_scale.shape)}")
    if not bool(torch.isfinite(scale.float()).all()):
        raise CheckpointError(f"{scale_key}: scales must be finite")
    weight = nvfp4.dequantize_nvfp4(packed, scale, global_scale.float().reshape(()), fmt.group)
    q, row_scale = fp8.quantize_weight_blocks(weight, BlockShape(1, cols))
    return QuantTensor(q, row_scale, fmt.block.k)


def _join(parts: list, dim: int, name: str, new_dim: bool = False):
    """torch.cat (new_dim: torch.stack) of float tensors, or of QuantTensors (weights and per-row scales alike)."""
    join = torch.stack if new_dim else torch.cat
    kinds = {isinstance(p, QuantTensor) for p in parts}
    if len(kinds) > 1:
        raise CheckpointError(f"{name}: some experts are float8_e4m3fn and some are not")
    if kinds == {True}:
        return QuantTensor(join([p.weight for p in parts], dim), join([p.scale for p in parts], dim), parts[0].block_k)
    return join(parts, dim)


def iter_tensors(checkpoint: Path, prefix: str, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name without prefix, tensor) for every tensor whose name starts with prefix. An FP8 tensor comes
    dequantized (to dtype, default float32) and its scale tensor is not listed."""
    index = CheckpointIndex(checkpoint)
    fmt = weight_format(read_json(checkpoint / "config.json"), str(checkpoint / "config.json"))
    names = index.names(prefix)
    scales = side_tensors(index, names, fmt)
    for name in names:
        if name in scales:
            continue
        tensor = read_weight(index, name, fmt)
        if isinstance(tensor, QuantTensor):
            tensor = tensor.dequantized(dtype or torch.float32)
        yield name[len(prefix) :], tensor


def vision_module(model_config: ModelConfig, checkpoint: Path | None, device: torch.device, dtype: torch.dtype,
                  seed: int = 0) -> torch.nn.Module:
    """transformers' vision module for the model on `device` in `dtype` (workers.model.vision.VisionEncoder runs it),
    holding the checkpoint's model.visual.* tensors (an FP8 one dequantized), or random weights (checkpoint None:
    load_format 'random')."""
    module = build_vision_module(model_config.arch, model_config.hf_config.vision_config, device, dtype)
    if checkpoint is None:
        init_random_weights(module, seed)
        return module
    result = module.load_state_dict(dict(iter_tensors(checkpoint, VISION_PREFIX)), strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"{checkpoint}: vision weights do not match the vision config "
            f"(missing {result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]})"
        )
    return module


def _expert_tensor(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> torch.Tensor:
    """As transformers does (Transpose with check_dims): keep when already in memory layout, else transpose."""
    if tensor.shape == expected:
        return tensor
    if tensor.dim() == 3 and tensor.transpose(1, 2).shape == expected:
        return tensor.transpose(1, 2)
    raise CheckpointError(f"{name}: shape {tuple(tensor.shape)} fits neither {tuple(expected)} nor its transpose")


RANDOM_INIT_STD = 0.02
FP8_SCALE_PARAMS = ("weight_scale", "gate_up_scale", "down_scale")  # the engine's names of FP8 weights' scales


@torch.no_grad()
def init_random_weights(module: torch.nn.Module, seed: int, std: float = RANDOM_INIT_STD) -> None:
    """Fills every parameter in place where it lives: matrices ~N(0, std), norm weights 1, biases 0. Each
    parameter draws from its own seed (seed, position), so the replicated parameters of a tensor-parallel
    instance (embeddings, router, lm_head) are equal on every rank. FP8 weights and their scales are
    init_random_fp8_weights' job."""
    gen = torch.Generator(device=next(module.parameters()).device)
    for index, (name, param) in enumerate(module.named_parameters()):
        gen.manual_seed(seed * 1_000_003 + index)
        if param.dtype == FP8_DTYPE or name.endswith(FP8_SCALE_PARAMS):
            continue
        if param.dim() >= 2:
            param.normal_(0.0, std, generator=gen)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.fill_(1.0)


# FP8 KV cache scales as checkpoints name them (vLLM's maybe_remap_kv_scale_name,
# https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/model_loader/weight_utils.py):
# llm-compressor / compressed-tensors write self_attn.k_scale and self_attn.v_scale, NVIDIA ModelOpt writes
# self_attn.k_proj.k_scale and self_attn.v_proj.v_scale, and older checkpoints one self_attn.kv_scale for both.
# Each is one float, the dequantisation factor (cache value * scale = K or V).
KV_SCALE_SUFFIXES = ("k_scale", "v_scale", ".kv_scale")
_KV_SCALE_NAME = re.compile(r"layers\.(\d+)\.self_attn\.(k_scale|v_scale|k_proj\.k_scale|v_proj\.v_scale|kv_scale)")


def load_kv_scales(checkpoint: Path, num_layers: int) -> list[tuple[float, float]] | None:
    """(k_scale, v_scale) of every text layer from the checkpoint's language_model.layers.N.self_attn scale
    tensors (reading only those); None when it has none (the FP8 cache then uses 1.0). A checkpoint with scales for
    some layers must have them for all; a scale that is not one positive finite number fails naming the tensor."""
    found: dict[tuple[int, str], float] = {}
    for path in checkpoint_files(checkpoint):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if not (name.startswith(TEXT_PREFIX) and name.endswith(KV_SCALE_SUFFIXES)):
                    continue
                match = _KV_SCALE_NAME.fullmatch(name[len(TEXT_PREFIX):])
                if match is None or int(match[1]) >= num_layers:
                    raise CheckpointError(f"{name}: not the KV scale of one of the {num_layers} text layers")
                tensor = f.get_tensor(name)
                value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else None
                if value is None or not 0 < value < float("inf"):
                    raise CheckpointError(f"{name}: a KV scale must be one positive finite number, got "
                                          f"shape {tuple(tensor.shape)}" + (f" value {value}" if value is not None else ""))
                layer, kind = int(match[1]), match[2]
                for which in ("k", "v") if kind == "kv_scale" else (kind[0],):
                    found[(layer, which)] = value
    if not found:
        return None
    for layer in range(num_layers):
        for which in ("k", "v"):
            if (layer, which) not in found:
                raise CheckpointError(f"{checkpoint}: {TEXT_PREFIX}layers.{layer}.self_attn.{which}_scale missing "
                                      "(the checkpoint has KV scales for other layers)")
    return [(found[(i, "k")], found[(i, "v")]) for i in range(num_layers)]


FP8_RANDOM_SPREAD = 64.0  # random FP8 weights: e4m3 values ~N(0, 64^2) times a scale std/64 (7 sigma below 448)


@torch.no_grad()
def init_random_fp8_weights(module: torch.nn.Module, seed: int, std: float = RANDOM_INIT_STD) -> None:
    """Fills the FP8 weights of module (Fp8Linear layers and FP8 MoE experts) with values ~N(0, std) in e4m3 times
    one scale each; the float parameters are init_random_weights' job."""
    gen = torch.Generator(device=next(module.parameters()).device)
    for index, (name, param) in enumerate(module.named_parameters()):
        if param.dtype == FP8_DTYPE:
            gen.manual_seed(seed * 1_000_003 + index)
            values = torch.randn(param.shape, generator=gen, device=param.device, dtype=torch.bfloat16)
            param.copy_((values * FP8_RANDOM_SPREAD).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
        elif name.endswith(FP8_SCALE_PARAMS):
            param.fill_(std / FP8_RANDOM_SPREAD)


def text_precision(checkpoint: Path, fmt: WeightFormat, load_format: str) -> Callable[[str], BlockShape | None]:
    """Which text-tower modules to build with FP8 weights (workers/model/text.py LinearPrecision): those the
    checkpoint stores in float8_e4m3fn (read from the safetensors headers), or, for load_format 'random', every
    linear the quantization_config does not name as left unquantised. Routers and lm_head stay in the activation
    dtype (the releases leave them unquantised); a checkpoint that quantised them is dequantized at load."""
    if not fmt.is_fp8:
        return lambda _name: None
    row_block = BlockShape(1, fmt.block.k)
    if load_format == "random":
        return lambda name: None if fmt.skips("model.language_model." + name) else row_block
    index = CheckpointIndex(checkpoint)

    def precision(name: str) -> BlockShape | None:
        full = TEXT_PREFIX + name
        if name.endswith("mlp.experts"):
            candidates = (full + ".gate_up_proj", full + ".0.gate_proj.weight")
        else:
            candidates = (full + ".weight",)
        return row_block if any(index.is_quantized(c, fmt) for c in candidates) else None

    return precision


_EXPERT_SOURCES = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _read_experts(index: CheckpointIndex, source: str, which: str, num_experts: int, fmt: WeightFormat):
    """One layer's experts in transformers' memory layout ([E, 2I, H] gate then up rows, or [E, H, I]), from the
    fused layout (released bf16: `mlp.experts.gate_up_proj` [E, H, 2I]) or the per-expert one Qwen's FP8 releases
    use (`mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj`, `down_proj` [H, I], each with its scale)."""
    fused = source + which
    if fused in index:
        return read_weight(index, fused, fmt), fused
    first = f"{source}0.{_EXPERT_SOURCES[which][0]}.weight"
    if first not in index:
        raise CheckpointError(f"{index.checkpoint}: neither {fused} nor per-expert tensors like {first}")
    experts = []
    for e in range(num_experts):
        parts = [read_weight(index, f"{source}{e}.{proj}.weight", fmt) for proj in _EXPERT_SOURCES[which]]
        experts.append(_join(parts, 0, f"{source}{e}") if len(parts) > 1 else parts[0])
    return _join(experts, 0, source, new_dim=True), first


class RankShards(Protocol):
    """How a rank cuts checkpoint tensors (workers/parallel.py's TensorParallel; declared here so that the
    loader does not import the module that imports it)."""

    def full_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]: ...

    def shard(self, name: str, tensor: torch.Tensor) -> torch.Tensor: ...

    def check_scale_cut(self, name: str, cols: int, block_k: int, source_name: str) -> None: ...


def load_text_weights(
    model: torch.nn.Module, checkpoint: Path, tie_word_embeddings: bool, dtype: torch.dtype,
    tp: RankShards | None = None, fmt: WeightFormat | None = None,
) -> None:
    """Fills the engine's text tower (language_model.*, lm_head.*) from the checkpoint, in place; under
    tensor/expert parallelism each parameter gets this rank's slice of the checkpoint tensor. FP8 tensors go into
    FP8 parameters with their scales (one per row; see QuantTensor), or dequantized into float parameters."""
    fmt = fmt or WeightFormat()
    index = CheckpointIndex(checkpoint)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    consumed: set[str] = set()

    def put(name: str, source_name: str, tensor: torch.Tensor) -> None:
        param = params[name]
        if name.endswith(("experts.gate_up_proj", "experts.down_proj", "experts.gate_up_scale", "experts.down_scale")):
            weight_name = name.replace("_scale", "_proj") if name.endswith("_scale") else name
            full = params[weight_name].shape if tp is None else tp.full_shape(weight_name, tuple(params[weight_name].shape))
            if name.endswith("_scale"):
                full = (*full[:-1], tensor.shape[-1])  # the weight's rows, its K blocks
            tensor = _expert_tensor(source_name, tensor, torch.Size(full))
        if tp is not None:
            tensor = tp.shard(name, tensor)
        if tensor.shape != param.shape:
            raise CheckpointError(f"{source_name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor if param.dtype == FP8_DTYPE else tensor.to(param.dtype))
        loaded.add(name)

    def put_weight(name: str, scale_param: str, source_name: str, tensor) -> None:
        """A weight into its parameter: FP8 with its scale, or float (dequantized if the checkpoint's is FP8)."""
        param = params.get(name)
        if param is None:
            raise CheckpointError(f"{source_name}: no such parameter in the text tower")
        if param.dtype == FP8_DTYPE:
            if not isinstance(tensor, QuantTensor):
                raise CheckpointError(f"{source_name}: expected float8_e4m3fn weights with scales, got {tensor.dtype}")
            if tp is not None:
                tp.check_scale_cut(name, tensor.weight.shape[-1], tensor.block_k, source_name)
            put(name, source_name, tensor.weight)
            put(scale_param, scale_name(source_name, fmt), tensor.scale)
        else:
            put(name, source_name, tensor.dequantized(dtype) if isinstance(tensor, QuantTensor) else tensor)

    moe_layers = {}
    for pname in params:
        if pname.endswith(("experts.gate_up_proj", "experts.down_proj")):
            moe_layers[pname] = pname.rsplit(".", 1)
    for pname, (owner, which) in moe_layers.items():
        source = TEXT_PREFIX + owner.removeprefix("language_model.") + "."
        num_experts = model.cfg.num_experts if hasattr(model, "cfg") else params[pname].shape[0]
        tensor, source_name = _read_experts(index, source, which, num_experts, fmt)
        consumed.update(n for n in index.names(source) if _is_expert_tensor(n, source, which))
        put_weight(pname, f"{owner}.{which.replace('_proj', '_scale')}", source_name, tensor)

    scales = side_tensors(index, index.names(TEXT_PREFIX), fmt)
    for name in index.names(TEXT_PREFIX):
        if name in consumed or name in scales or name.endswith(KV_SCALE_SUFFIXES):
            continue  # (KV scales are the KV cache's, not text-tower parameters: load_kv_scales)
        engine_name = "language_model." + name[len(TEXT_PREFIX) :]
        put_weight(engine_name, engine_name.removesuffix("weight") + "weight_scale", name, read_weight(index, name, fmt))
    if LM_HEAD in index:
        put_weight("lm_head.weight", "lm_head.weight_scale", LM_HEAD, read_weight(index, LM_HEAD, fmt))
    elif tie_word_embeddings:
        model.lm_head.weight = model.language_model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"{checkpoint}: missing text-tower weights, e.g. {missing[:3]}")


def _is_expert_tensor(name: str, source: str, which: str) -> bool:
    """Whether `name` is one of the tensors (weights or scales) _read_experts read for `which`."""
    rest = name[len(source) :]
    if rest.startswith(which):
        return True
    parts = rest.split(".")
    return len(parts) >= 3 and parts[0].isdigit() and parts[1] in _EXPERT_SOURCES[which]
