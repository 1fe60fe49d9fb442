"""Writes a random-weight Qwen3-VL checkpoint of the real shapes (30B-A3B, 235B-A22B) for performance runs.

The writer is workers/random_checkpoint.py (tensors streamed to safetensors shard by shard, never held in memory).
scripts/make_random_checkpoint.py's command line: python scripts/make_random_checkpoint.py --help
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from workers.random_checkpoint import RandomCheckpointSpec, make_random_checkpoint
from workers.tiny_checkpoint import ARCHITECTURES, RELEASED_CONFIGS


def _override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"override {text!r} is not KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"override {key}: value {value!r} is not JSON") from exc


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    moe_presets = sorted(p for p, c in RELEASED_CONFIGS.items() if c["architectures"][0] == ARCHITECTURES["moe"])
    parser.add_argument("--preset", choices=moe_presets, default="qwen3-vl-30b-a3b")
    parser.add_argument("--num-layers", type=int, help="text decoder layers (fewer than the real count)")
    parser.add_argument("--num-experts", type=int, help="experts per MoE layer")
    parser.add_argument(
        "--override", type=_override, action="append", default=[], metavar="KEY=JSON",
        help="config.json field by dotted path, e.g. vision_config.depth=2 (repeatable)",
    )
    parser.add_argument("--expert-layout", choices=["release", "transformers"], default="release")
    parser.add_argument("--precision", choices=["bf16", "fp8", "fp8-dynamic"], default="bf16",
                        help="fp8: Qwen's released FP8 layout (e4m3 weights, 128x128 block scales, per-expert experts); "
                        "fp8-dynamic: the FP8-dynamic layout (compressed-tensors: one scale per output channel)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = RandomCheckpointSpec(
        preset=args.preset,
        num_layers=args.num_layers,
        num_experts=args.num_experts,
        overrides=dict(args.override),
        expert_layout=args.expert_layout,
        precision=args.precision,
        max_shard_bytes=int(args.max_shard_gb * 10**9),
        seed=args.seed,
    )
    print(make_random_checkpoint(args.out, spec))

