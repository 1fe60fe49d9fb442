"""Finds the capacity knee of simulated systems through the real harness (lab/plan/sim_sweep.py); prints one
JSON object. Also --router-ceiling (lab/bench/router_ceiling.py) and --virtual (the virtual clock)."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.plan.sim_sweep import main  # noqa: E402

if __name__ == "__main__":
    main()
