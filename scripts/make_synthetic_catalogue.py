"""Writes a synthetic Shopify product catalogue in the hub's parquet layout (deterministic by seed).

Example: python scripts/make_synthetic_catalogue.py --out .cache/catalogue --samples 64 --seed 0
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from contract.dataset import DATASETS  # noqa: E402
from harness.synthetic_catalogue import PROFILES, write_synthetic_catalogue  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="catalogue directory (data/*.parquet go here)")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset", default="product-catalogue", choices=sorted(DATASETS),
                        help="product-catalogue: train+test shards; catalogue-8k: train only")
    parser.add_argument("--profile", default="small", choices=PROFILES,
                        help="small: tiny images of every format (fast); mixed: adds multi-megapixel images; "
                             "realistic: all JPEG, sizes and text lengths of the real dataset (GPU perf work)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_synthetic_catalogue(args.out, args.samples, args.seed, args.dataset, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
