"""Router overhead with instant workers: sustained requests/s through one router process, the CPU it spends per
request and the latency it adds, round_robin vs least_loaded, gRPC and HTTP, side by side with vllm-router (Rust)
when installed; and routing in the caller's own process (router.embedded, the harness's router.mode embedded)
beside a direct call to a worker.

The logic is lab/bench/router.py.
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.bench.router import main  # noqa: E402

if __name__ == "__main__":
    main()
