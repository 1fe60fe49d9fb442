"""One query with one image of a given size through the product path (router -> Ray worker -> engine), and where
its time went: the client's times beside the engine's timeline of the request (lab/peak/query_probe.py). Prints one
JSON object.

Example: python scripts/probe_query.py --system h200x1-synthetic-fp8-dynamic --image 4000x4000 --repeat 3
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.peak.query_probe import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
