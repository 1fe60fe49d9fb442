"""A Qwen3-VL checkpoint's configs: config.json as ModelConfig (the text tower's TextConfig, the vision tower's
transformers config, the weight format its quantization_config declares) and generation_config.json as
GenerationConfig. What the model is built from; workers/weights.py reads its tensors."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from workers.checkpoint_quant import QuantizationConfigError, WeightFormat, weight_format

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
    weight_format: WeightFormat = WeightFormat()  # config.json's quantization_config (checkpoint_quant.py)


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: frozenset[int]
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path} not found") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def load_model_config(checkpoint: Path) -> ModelConfig:
    from transformers import AutoConfig

    raw = read_json(checkpoint / "config.json")
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise CheckpointError(f"{checkpoint / 'config.json'}: model_type {model_type!r} is not one of {sorted(ARCHITECTURES)}")
    try:
        fmt = weight_format(raw, str(checkpoint / "config.json"))
    except QuantizationConfigError as exc:
        raise CheckpointError(str(exc)) from exc
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
        weight_format=fmt,
    )


def load_generation_config(checkpoint: Path) -> GenerationConfig:
    path = checkpoint / "generation_config.json"
    raw = read_json(path) if path.exists() else {}
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
