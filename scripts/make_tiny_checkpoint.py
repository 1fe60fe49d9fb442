"""Writes a tiny random Qwen3-VL checkpoint (real architecture and vocabulary, tiny dims) for tests and cpu-tiny.

Usage: python -m scripts.make_tiny_checkpoint --arch moe --out .cache/tiny-moe [--seed 0] [--shards 1]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from workers.tiny_checkpoint import make_tiny_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=["moe", "dense"], required=True)
    parser.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1, help="number of safetensors files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(make_tiny_checkpoint(args.out, arch=args.arch, seed=args.seed, shards=args.shards))


if __name__ == "__main__":
    main()
