"""What the engine bench (lab/bench/engine.py) measures: the workload of each figure, the shapes
and precisions, and the config.json of random weights it writes (no checkpoint on disk)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path



PRESETS = {"30b-a3b": "qwen3-vl-30b-a3b", "235b-a22b": "qwen3-vl-235b-a22b", "tiny": "qwen3-vl-30b-a3b"}


NO_EOS = [-1]  # generation_config eos for the bench: every request runs to max_tokens


@dataclass
class Workload:
    """What is measured; `tiny` shrinks every size so the CPU smoke mode takes seconds."""

    samples: int = 256
    image_size: int = 1024  # square JPEG side in pixels: 1024 -> 1,024 visual tokens
    text_tokens: int = 700
    output_tokens: int = 45
    prefill_requests: int = 32
    prefill_len: int = 2048
    decode_batches: list[int] = field(default_factory=lambda: [1, 64, 256])
    decode_context: int = 1024
    decode_steps: int = 32
    vision_images: int = 16  # images of 1024 patches (32 x 32) encoded in one batch
    vision_grid: int = 32
    baseline_batch: int = 64
    max_num_seqs: int = 512  # mlperf_configs/h200x1.yaml (256 before run32)
    max_num_batched_tokens: int = 8192

    @classmethod
    def tiny(cls, samples: int) -> Workload:
        return cls(
            samples=samples, image_size=128, text_tokens=32, output_tokens=4, prefill_requests=4, prefill_len=64,
            decode_batches=[1, 4], decode_context=32, decode_steps=3, vision_images=2, vision_grid=8,
            baseline_batch=samples, max_num_seqs=16, max_num_batched_tokens=512,
        )


# --precisions: name -> (the checkpoint's weights, engine.fp8_compute)
PRECISIONS = {
    "bf16": ("bf16", "auto"), "fp8": ("fp8", "auto"), "fp8-dequantized": ("fp8", "dequantize"),
    "fp8-channel": ("fp8-channel", "auto"),  # the FP8-dynamic layout: per-channel weights, per-token activations
}


def write_config(shape: str, num_layers: int | None, out_dir: Path, precision: str = "bf16") -> None:
    """config.json (+ side configs) of the shape; generation never stops at an EOS. precision "fp8" / "fp8-channel":
    the quantization_config of the released FP8 checkpoints (128x128 blocks / FP8-dynamic per channel), so the random
    weights are FP8 in that layout."""
    from workers.quantized_checkpoint import released_quantization_config
    from workers.tiny_checkpoint import TINY_OVERRIDES, released_config, write_side_configs

    overrides = dict(TINY_OVERRIDES["moe"]) if shape == "tiny" else {}
    if num_layers:
        overrides["text_config.num_hidden_layers"] = num_layers
    config = released_config(PRESETS[shape], overrides)
    if precision in ("fp8", "fp8-channel"):
        config["quantization_config"] = released_quantization_config("channel" if precision == "fp8-channel" else "block", config)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    write_side_configs(out_dir)
    gen_path = out_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen.update(eos_token_id=NO_EOS, do_sample=False)
    gen_path.write_text(json.dumps(gen))
