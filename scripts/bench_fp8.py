"""FP8 against bf16 on one GPU at the Qwen3-VL-30B-A3B layer shapes, side by side in one run; prints one JSON object.

The logic is lab/bench/fp8.py.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.bench.fp8 import main  # noqa: E402

if __name__ == "__main__":
    main()
