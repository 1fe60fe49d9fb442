"""Qwen3-VL checkpoint configs in their released layout, and tiny random checkpoints of the real
architecture (real vocabulary, tiny dims) written by transformers' save_pretrained for tests and cpu-tiny.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from contract.tokenizer import ENDOFTEXT_ID, IM_END_ID, IMAGE_PAD_ID, VIDEO_PAD_ID, VISION_END_ID, VISION_START_ID

log = logging.getLogger(__name__)

VOCAB_SIZE = 151936

ARCHITECTURES = {"moe": "Qwen3VLMoeForConditionalGeneration", "dense": "Qwen3VLForConditionalGeneration"}

# The Instruct models' generation_config.json; MLPerf samples with exactly these (use_model_defaults).
GENERATION_CONFIG: dict[str, Any] = {
    "bos_token_id": ENDOFTEXT_ID,
    "pad_token_id": ENDOFTEXT_ID,
    "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
    "repetition_penalty": 1.0,
}

# preprocessor_config.json as released for every Qwen3-VL size (size values are pixel counts).
PREPROCESSOR_CONFIG: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "processor_class": "Qwen3VLProcessor",
    "do_convert_rgb": True,
    "do_resize": True,
    "resample": 3,
    "do_rescale": True,
    "rescale_factor": 0.00392156862745098,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}


def _release_config(arch: Literal["moe", "dense"], text: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    """A config.json laid out like the released Qwen3-VL checkpoints (legacy rope_scaling + rope_theta keys)."""
    model_type = "qwen3_vl_moe" if arch == "moe" else "qwen3_vl"
    text_config = {
        "model_type": f"{model_type}_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "dtype": "bfloat16",
        "head_dim": 128,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        "rope_theta": 5000000,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": VOCAB_SIZE,
        **text,
    }
    vision_config = {
        "model_type": model_type,  # the released files say this; transformers maps it to the vision type
        "deepstack_visual_indexes": [8, 16, 24],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304,
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        **vision,
    }
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": model_type,
        "image_token_id": IMAGE_PAD_ID,
        "video_token_id": VIDEO_PAD_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "tie_word_embeddings": False,
        "text_config": text_config,
        "vision_config": vision_config,
    }


_MOE_TEXT = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "num_experts_per_tok": 8}

# Released configs: text_config / vision_config of the models' Hugging Face config.json files,
# https://huggingface.co/Qwen/Qwen3-VL-30B-A3B-Instruct/blob/main/config.json
# https://huggingface.co/Qwen/Qwen3-VL-235B-A22B-Instruct/blob/main/config.json
# https://huggingface.co/Qwen/Qwen3-VL-8B-Instruct/blob/main/config.json
RELEASED_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-vl-30b-a3b": _release_config(
        "moe",
        {**_MOE_TEXT, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
         "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128, "moe_intermediate_size": 768},
        {"out_hidden_size": 2048},
    ),
    "qwen3-vl-235b-a22b": _release_config(
        "moe",
        {**_MOE_TEXT, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 94,
         "num_attention_heads": 64, "num_key_value_heads": 4, "num_experts": 128, "moe_intermediate_size": 1536},
        {"out_hidden_size": 4096},
    ),
    "qwen3-vl-8b": _release_config(
        "dense",
        {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
         "num_attention_heads": 32, "num_key_value_heads": 8},
        {"out_hidden_size": 4096},
    ),
}


def released_config(preset: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A copy of a released config.json with dotted-path overrides, e.g. {"text_config.num_hidden_layers": 2}.
    Only keys that exist may be overridden, so a typo fails naming the key."""
    if preset not in RELEASED_CONFIGS:
        raise ValueError(f"unknown preset {preset!r}; known: {sorted(RELEASED_CONFIGS)}")
    config = copy.deepcopy(RELEASED_CONFIGS[preset])
    for dotted, value in (overrides or {}).items():
        *parents, leaf = dotted.split(".")
        node = config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            raise KeyError(f"config override {dotted!r}: no such key in preset {preset!r}")
        node[leaf] = copy.deepcopy(value)  # transformers mutates nested dicts (rope_scaling) it is given
    return config


# Tiny dims on top of the released layouts. moe_intermediate 48 keeps 2*I (96) != hidden (64), so the
# released [E, H, 2I] and transformers' [E, 2I, H] expert layouts cannot be confused by shape.
# Deepstack after vision blocks 1 and 2 of 3, injected after text layers 0 and 1 of 3 (layer 2 has none).
_TINY_COMMON = {
    "text_config.hidden_size": 64,
    "text_config.intermediate_size": 128,
    "text_config.num_hidden_layers": 3,
    "text_config.num_attention_heads": 4,
    "text_config.num_key_value_heads": 2,
    "text_config.head_dim": 16,
    "text_config.rope_scaling": {"mrope_interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default"},
    "text_config.dtype": "float32",
    "vision_config.depth": 3,
    "vision_config.hidden_size": 32,
    "vision_config.num_heads": 2,
    "vision_config.intermediate_size": 64,
    "vision_config.out_hidden_size": 64,
    "vision_config.deepstack_visual_indexes": [1, 2],
}
TINY_OVERRIDES: dict[str, dict[str, Any]] = {
    "moe": {
        **_TINY_COMMON,
        "text_config.num_experts": 8,
        "text_config.num_experts_per_tok": 2,
        "text_config.moe_intermediate_size": 48,
    },
    "dense": _TINY_COMMON,
}
_TINY_BASE = {"moe": "qwen3-vl-30b-a3b", "dense": "qwen3-vl-8b"}
# Weights ~N(0, 0.02) make a tiny random model's logits nearly flat, so greedy decoding collapses onto
# one token; a wider init keeps outputs input-dependent.
TINY_INIT_STD = 0.25
_STAMP = "tiny_checkpoint.json"


def write_side_configs(out_dir: Path) -> None:
    """generation_config.json and preprocessor_config.json as the released checkpoints carry them."""
    side_configs = {"generation_config.json": GENERATION_CONFIG, "preprocessor_config.json": PREPROCESSOR_CONFIG}
    for name, content in side_configs.items():
        (out_dir / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


def transformers_config(config: Mapping[str, Any]):
    """The transformers config object for a config.json dict (released or save_pretrained layout)."""
    from transformers import AutoConfig

    config = dict(config)
    return AutoConfig.for_model(config.pop("model_type"), **config)


def _expected_stamp(arch: str, seed: int, shards: int) -> dict[str, Any]:
    """Everything the files depend on, so changing the tiny dims here invalidates old checkpoints."""
    return {
        "arch": arch, "seed": seed, "shards": shards, "init_std": TINY_INIT_STD,
        "config": released_config(_TINY_BASE[arch], TINY_OVERRIDES[arch]),
        "transformers": importlib.metadata.version("transformers"),
    }


def _is_complete(out_dir: Path, stamp: dict[str, Any]) -> bool:
    stamp_path = out_dir / _STAMP
    try:
        written = json.loads(stamp_path.read_text())
    except (OSError, ValueError):
        return False
    return written.get("args") == stamp and all((out_dir / f).is_file() for f in written.get("files", []))


def _shard_size_for(model, shards: int) -> int:
    """The max_shard_size (bytes) at which save_pretrained's greedy split yields exactly `shards` files."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers.core_model_loading import revert_weight_conversion

    state_dict = revert_weight_conversion(model, model.state_dict())  # what save_pretrained splits, in its order

    def count(size: int) -> int:
        return len(split_torch_state_dict_into_shards(state_dict, max_shard_size=size).filename_to_tensors)

    low, high = 1, sum(t.numel() * t.element_size() for t in state_dict.values())
    while low < high:  # smallest size giving at most `shards` files; the count only falls as size grows
        mid = (low + high) // 2
        low, high = (mid + 1, high) if count(mid) > shards else (low, mid)
    if count(low) != shards:
        raise ValueError(f"cannot split the tiny checkpoint into exactly {shards} shards (got {count(low)})")
    return low


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' tqdm bars off inside the block, as they were after it."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _build(out_dir: Path, arch: Literal["moe", "dense"], seed: int, shards: int) -> None:
    import torch
    import transformers

    config = transformers_config(released_config(_TINY_BASE[arch], TINY_OVERRIDES[arch]))
    model_class = getattr(transformers, ARCHITECTURES[arch])
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:  # 1-D tensors (norm weights, biases) keep transformers' init
                param.normal_(0.0, TINY_INIT_STD)
    max_shard_size = _shard_size_for(model, shards) if shards > 1 else "50GB"
    with _no_progress_bars():  # save_pretrained's "Writing model shards" bar is not the harness's line to print
        model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    write_side_configs(out_dir)  # replaces the generation_config.json save_pretrained derived from config


def make_tiny_checkpoint(out_dir: Path, arch: Literal["moe", "dense"], seed: int = 0, shards: int = 1) -> Path:
    """Writes (or finds already written) a tiny random Qwen3-VL checkpoint and returns its directory.

    Deterministic by seed. Safe against concurrent callers: built aside, then renamed into place.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be 'moe' or 'dense', got {arch!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    out_dir = Path(out_dir)
    stamp = _expected_stamp(arch, seed, shards)
    if _is_complete(out_dir, stamp):
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / _STAMP).exists():
        raise FileExistsError(f"{out_dir} exists and is not a tiny checkpoint; refusing to overwrite it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _build(staging, arch, seed, shards)
        files = sorted(p.name for p in staging.iterdir())
        (staging / _STAMP).write_text(json.dumps({"args": stamp, "files": files}, indent=2) + "\n")
        if out_dir.exists():
            if _is_complete(out_dir, stamp):  # another process finished first
                return out_dir
            shutil.rmtree(out_dir)  # an older tiny checkpoint (stamped) with other args
        os.rename(staging, out_dir)
    except OSError:
        if not _is_complete(out_dir, stamp):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("wrote tiny %s checkpoint (seed %d, %d shard(s)) to %s", arch, seed, shards, out_dir)
    return out_dir
