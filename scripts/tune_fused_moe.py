"""Times candidate tile configurations of the fused MoE GEMMs per token count and writes the fastest to a tuned
table (workers/model/fused_moe_configs/{device}.json, read by workers.model.fused_moe.tile_config, or --out).
With --compare it writes nothing and prints one JSON object: the experts per token count with two tuned tables side
by side (before/after), the after table's parts (align, gated GEMM, down GEMM, k-sum) and the whole MoE layer.

The logic is lab/kernels/tune_fused_moe.py.
Usage (on the GPU): python3 scripts/tune_fused_moe.py [--out FILE] [--tokens 16,64,...]
                    python3 scripts/tune_fused_moe.py --compare [--before OLD.json] [--after NEW.json]
CPU smoke: TRITON_INTERPRET=1 python3 scripts/tune_fused_moe.py --smoke [--compare]
"""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lab.kernels.tune_fused_moe import main  # noqa: E402

if __name__ == "__main__":
    main()
