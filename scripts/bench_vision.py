"""The Qwen3-VL vision tower on one device: transformers' module (SDPA) beside our forward over the same random
weights (lab/bench/vision.py); prints one JSON object.
Usage: python -m scripts.bench_vision [--shape 30b-a3b|235b-a22b|tiny] [--reps N] [--new-shapes N]
                                      [--batch-sweep B,...] [--head-dim-sweep] [--out FILE]
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.bench.vision import main  # noqa: E402

if __name__ == "__main__":
    main()
