"""JPEG bytes to the vision tower's input: PIL on the host beside nvJPEG and the device resize
(lab/bench/image_path.py); prints one JSON object.
Usage: python -m scripts.bench_image_path [--sizes 4000x4000,...] [--reps N] [--tower-size WxH] [--out FILE]
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.bench.image_path import main  # noqa: E402

if __name__ == "__main__":
    main()
