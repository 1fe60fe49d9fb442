"""The vision tower's attention, every implementation side by side (lab/bench/vision_attention.py); prints one
JSON object.
Usage: python -m scripts.bench_vision_attention [--patches 4096,16384,35344,62500] [--reps N] [--configs ...]
                                                [--fp8-configs ...] [--tower-side 250] [--tower-shards 2,4,8]
                                                [--accuracy-side 128] [--mixes 'S,S;S,...'] [--out FILE]
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.bench.vision_attention import main  # noqa: E402

if __name__ == "__main__":
    main()
