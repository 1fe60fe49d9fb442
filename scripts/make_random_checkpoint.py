"""Writes a random-weight Qwen3-VL checkpoint of the real shapes (30B-A3B, 235B-A22B) for performance runs.

The logic is lab/bench/random_checkpoint.py.
Usage: python -m scripts.make_random_checkpoint --help
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.bench.random_checkpoint import main  # noqa: E402

if __name__ == "__main__":
    main()
