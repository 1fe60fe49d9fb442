"""How the fixed catalogue's images reach the vision tower, on the CPU: the engine's own Scheduler and BlockManager
run the workload with no model (lab/plan/vision_batches.py). Prints one JSON object per max_num_seqs.

Usage: python -m scripts.sim_vision_batches [--samples 2000] [--max-num-seqs 256,384,512] [--kv-blocks 41983]
       [--budget 16384] [--no-encode-ahead]
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.plan.vision_batches import main  # noqa: E402

if __name__ == "__main__":
    main()
