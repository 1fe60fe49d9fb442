"""Fault soak: real cpu-tiny Server runs with worker and router faults injected mid-run (lab/soak/fault_soak.py);
prints one JSON object of figures. Example: python scripts/fault_soak.py --minutes 4"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.soak.fault_soak import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
