"""The vision tower split over n ranks beside the whole tower on one, in one run (lab/bench/vision_tp.py); prints one
JSON object.
Usage: python -m scripts.bench_vision_tp [--ranks 2] [--shape 235b-a22b|30b-a3b|tiny] [--side 250] [--reps 5]
                                         [--attention auto] [--device cuda|cpu] [--out FILE]
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.bench.vision_tp import main  # noqa: E402

if __name__ == "__main__":
    main()
