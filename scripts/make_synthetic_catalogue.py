"""Writes a synthetic Shopify product catalogue in the hub's parquet layout (deterministic by seed).

Example: python scripts/make_synthetic_catalogue.py --out .cache/catalogue --samples 64 --seed 0
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.synthetic_catalogue import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
