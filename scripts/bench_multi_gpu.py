"""Two-GPU layouts of one model on the catalogue workload (random weights of a real shape), side by side:
TP2, EP2, two data-parallel instances, and prefill/decode split with the KV moved GPU-to-GPU; plus the
235B-A22B shape at a few layers in TP2/EP2 for a per-layer figure (lab/bench/multi_gpu.py). Prints one JSON
object. Each part runs in its own subprocess (this command line with --part) with its own timeout.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.bench.multi_gpu import main  # noqa: E402

if __name__ == "__main__":
    main()
