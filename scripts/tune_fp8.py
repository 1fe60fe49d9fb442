"""Sweeps the FP8 kernels' tile configs on one GPU beside the bf16 kernels, at the Qwen3-VL-30B-A3B layer shapes;
prints one JSON object (every config's time, the best of each, bf16's time).

The logic is lab/kernels/tune_fp8.py.
Usage: python scripts/tune_fp8.py [--tokens 8192,16384] [--moe-tokens 16384] [--out FILE] [--table-out FILE]
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.kernels.tune_fp8 import main  # noqa: E402

if __name__ == "__main__":
    main()
