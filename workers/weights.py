"""Reads a Qwen3-VL checkpoint directory: config.json, generation_config.json, (sharded) safetensors.

Text-tower weights load by name into the engine's modules; MoE experts are accepted in the official
layout (gate_up_proj [E, H, 2I], down_proj [E, I, H]) and in transformers' in-memory layout.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

if TYPE_CHECKING:
    from workers.parallel import TensorParallel


TEXT_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
LM_HEAD = "lm_head.weight"
ARCHITECTURES = {"qwen3_vl": "dense", "qwen3_vl_moe": "moe"}


class CheckpointError(ValueError):
    """The checkpoint directory is missing a file, a key, or holds a tensor of the wrong shape."""


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: list[int]
    attention_bias: bool
    max_position_embeddings: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "dense" | "moe"
    text: TextConfig
    hf_config: object  # transformers' Qwen3VLConfig / Qwen3VLMoeConfig (the vision tower is built from it)
    tie_word_embeddings: bool
    image_token_id: int
    vision_start_token_id: int
    spatial_merge_size: int


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: frozenset[int]
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} not found") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def load_model_config(checkpoint: Path) -> ModelConfig:
    from transformers import AutoConfig

    raw = _read_json(checkpoint / "config.json")
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise CheckpointError(f"{checkpoint / 'config.json'}: model_type {model_type!r} is not one of {sorted(ARCHITECTURES)}")
    hf = AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    t = hf.text_config
    rope = t.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"text_config.rope_parameters.rope_type {rope['rope_type']!r} is not supported")
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    text = TextConfig(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=t.rms_norm_eps,
        rope_theta=float(rope["rope_theta"]),
        mrope_section=list(rope.get("mrope_section", [24, 20, 20])),
        attention_bias=bool(t.attention_bias),
        max_position_embeddings=t.max_position_embeddings,
        num_experts=getattr(t, "num_experts", 0) if model_type == "qwen3_vl_moe" else 0,
        num_experts_per_tok=getattr(t, "num_experts_per_tok", 0),
        moe_intermediate_size=getattr(t, "moe_intermediate_size", 0),
        decoder_sparse_step=getattr(t, "decoder_sparse_step", 1) or 1,
        mlp_only_layers=tuple(getattr(t, "mlp_only_layers", None) or ()),
    )
    return ModelConfig(
        arch=ARCHITECTURES[model_type],
        text=text,
        hf_config=hf,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        image_token_id=hf.image_token_id,
        vision_start_token_id=hf.vision_start_token_id,
        spatial_merge_size=hf.vision_config.spatial_merge_size,
    )


def load_generation_config(checkpoint: Path) -> GenerationConfig:
    path = checkpoint / "generation_config.json"
    raw = _read_json(path) if path.exists() else {}
    eos = raw.get("eos_token_id")
    if eos is None:
        raise CheckpointError(f"{path}: eos_token_id is missing")
    eos_ids = frozenset([eos] if isinstance(eos, int) else eos)
    return GenerationConfig(
        eos_token_ids=eos_ids,
        do_sample=bool(raw.get("do_sample", False)),
        temperature=float(raw.get("temperature", 1.0)),
        top_p=float(raw.get("top_p", 1.0)),
        top_k=int(raw.get("top_k", 0) or 0),
    )


def checkpoint_files(checkpoint: Path) -> list[Path]:
    """model.safetensors, or the shards named by model.safetensors.index.json."""
    index = checkpoint / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        files = [checkpoint / s for s in shards]
    else:
        files = [checkpoint / "model.safetensors"]
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{f} not found")
    return files


def iter_tensors(checkpoint: Path, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name without prefix, tensor) for every tensor whose name starts with prefix."""
    for path in checkpoint_files(checkpoint):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    yield name[len(prefix) :], f.get_tensor(name)


def _expert_tensor(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> torch.Tensor:
    """As transformers does (Transpose with check_dims): keep when already in memory layout, else transpose."""
    if tensor.shape == expected:
        return tensor
    if tensor.dim() == 3 and tensor.transpose(1, 2).shape == expected:
        return tensor.transpose(1, 2)
    raise CheckpointError(f"{name}: shape {tuple(tensor.shape)} fits neither {tuple(expected)} nor its transpose")


RANDOM_INIT_STD = 0.02


@torch.no_grad()
def init_random_weights(module: torch.nn.Module, seed: int, std: float = RANDOM_INIT_STD) -> None:
    """Fills every parameter in place where it lives: matrices ~N(0, std), norm weights 1, biases 0. Each
    parameter draws from its own seed (seed, position), so the replicated parameters of a tensor-parallel
    instance (embeddings, router, lm_head) are equal on every rank."""
    gen = torch.Generator(device=next(module.parameters()).device)
    for index, (name, param) in enumerate(module.named_parameters()):
        gen.manual_seed(seed * 1_000_003 + index)
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


def load_text_weights(
    model: torch.nn.Module, checkpoint: Path, tie_word_embeddings: bool, dtype: torch.dtype,
    tp: TensorParallel | None = None,
) -> None:
    """Fills the engine's text tower (language_model.*, lm_head.*) from the checkpoint, in place; under
    tensor/expert parallelism each parameter gets this rank's slice of the checkpoint tensor."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()

    def put(name: str, source_name: str, tensor: torch.Tensor) -> None:
        param = params.get(name)
        if param is None:
            raise CheckpointError(f"{source_name}: no such parameter in the text tower")
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            full = param.shape if tp is None else tp.full_shape(name, tuple(param.shape))
            tensor = _expert_tensor(source_name, tensor, torch.Size(full))
        if tp is not None:
            tensor = tp.shard(name, tensor)
        if tensor.shape != param.shape:
            raise CheckpointError(f"{source_name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor.to(dtype))
        loaded.add(name)

    for name, tensor in iter_tensors(checkpoint, TEXT_PREFIX):
        if name.endswith(KV_SCALE_SUFFIXES):  # the KV cache's, not a text-tower parameter: load_kv_scales
            continue
        put("language_model." + name, TEXT_PREFIX + name, tensor)
    head = dict(iter_tensors(checkpoint, LM_HEAD))
    if "" in head:
        put("lm_head.weight", LM_HEAD, head[""])
    elif tie_word_embeddings:
        model.lm_head.weight = model.language_model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise CheckpointError(f"{checkpoint}: missing text-tower weights, e.g. {missing[:3]}")
