"""Paged attention on one GPU at the Qwen3-VL-30B-A3B attention shape (32 q / 4 kv heads, head_dim 128,
16-token blocks): per-sequence SDPA vs the Triton prefill kernel, split vs unsplit decode; prints one JSON object.

The logic is lab/bench/attention.py.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.bench.attention import main  # noqa: E402

if __name__ == "__main__":
    main()
