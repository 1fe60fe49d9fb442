"""An Offline-style burst through one router: `--requests` concurrent requests, each with an image of `--image-mb`
MB, to one simulated Qwen3-VL-30B-A3B worker (lab.bench.router_ceiling's helper); prints one JSON object: how each
request ended, how long it all took, the slowest control call to the router (ListWorkers) and to the worker
(GetLoad) timed from a process of their own while the burst runs (a held-up event loop shows there), and the
worker's down marks in the router's log.

The logic is lab/bench/router_burst.py.
`python scripts/bench_router_burst.py [--requests 1500] [--image-mb 2]` (about 80 s on 2 cores).
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.bench.router_burst import main  # noqa: E402

if __name__ == "__main__":
    main()
