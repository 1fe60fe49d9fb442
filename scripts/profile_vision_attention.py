"""Launch the vision attention's kernels a few times each on one frame, for a profiler (ncu) to read.

Nothing is timed here: `ncu --kernel-name regex:... python3 scripts/profile_vision_attention.py ...` reads the
hardware counters of each launch (benchmarks/README.md records the commands).
Usage: python3 scripts/profile_vision_attention.py [--patches 62500] [--launches 2]
                                                   [--gluon-configs M:N:W:S,...] [--sdpa]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from lab.bench.vision_attention import HEAD_DIM, parse_gluon_configs, tower_inputs  # noqa: E402
from workers.model import vision_attention as va  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--patches", type=int, default=62500)
    p.add_argument("--launches", type=int, default=2, help="launches of each kernel")
    p.add_argument("--gluon-configs", default="128:64:8:2")
    p.add_argument("--sdpa", action="store_true", help="also SDPA's cuDNN kernel")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_vision_attention needs a CUDA device")
    q, k, v = tower_inputs(args.patches, "cuda", seed=args.patches)
    plan = va.AttentionPlan([(args.patches, 1)])
    scale = HEAD_DIM**-0.5
    for config in parse_gluon_configs(args.gluon_configs):
        for _ in range(args.launches):
            va.vision_attention(q, k, v, plan, scale, "gluon", config)
        torch.cuda.synchronize()
        print(f"gluon {config}: {args.launches} launches", flush=True)
    if args.sdpa:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            for _ in range(args.launches):
                va.attention_reference(q, k, v, plan.runs, scale)
        torch.cuda.synchronize()
        print(f"sdpa cudnn: {args.launches} launches", flush=True)


if __name__ == "__main__":
    main()
