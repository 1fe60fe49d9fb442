"""Finds a system's peak through the product path: Offline samples/s, then the highest target QPS LoadGen calls VALID
for Server and Interactive (lab/peak/cli.py). Writes one JSON report and prints it as the last stdout line.

Example: python scripts/find_peak.py --system h200x1-synthetic --min-duration-ms 30000 --time-budget-s 480
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.peak.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
