"""Searches layouts for a hardware profile and a scenario with the step model and writes the system YAML it
recommends (lab/plan/planner.py, lab/plan/layout_plan.py); `--validate` prints the model against the measured
H200 runs of benchmarks/planner-validation-runs.json (lab/plan/planner_validation.py).

    python scripts/plan_layout.py --hardware vera-rubin --gpus 72 --scenario server --out plan.yaml
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.plan.layout_plan import main  # noqa: E402

if __name__ == "__main__":
    main()
