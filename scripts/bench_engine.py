"""Engine speed on random weights of a real Qwen3-VL shape (no checkpoint on disk), with the transformers
baseline on the same workload; prints one JSON object (and writes it to --out). The bench is
lab/bench/engine.py; `--shape tiny` is a CPU smoke mode with tiny dims.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.bench.engine import main  # noqa: E402

if __name__ == "__main__":
    main()
