"""Times candidate tile configurations of the fused MoE kernels per token count on this GPU and writes the
fastest ones to workers/model/fused_moe_configs/{device}.json (read by workers.model.fused_moe.tile_config).

Usage (on the GPU): python3 scripts/tune_fused_moe.py [--experts 128 --hidden 2048 --inter 768 --top-k 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workers.model import fused_moe  # noqa: E402
from workers.model.fused_moe import TileConfig  # noqa: E402

TOKENS = (1, 64, 256, 8192)
SMALL = [TileConfig(16, n, k, 4, s) for n in (64, 128) for k in (64, 128) for s in (3, 5)]
LARGE = [
    TileConfig(m, n, k, w, s)
    for m, n, k, w, s in (
        (16, 128, 64, 4, 4), (16, 256, 64, 8, 4), (32, 128, 64, 4, 4), (32, 256, 64, 8, 3), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4),
        (64, 128, 64, 8, 4), (128, 64, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
        (128, 128, 32, 8, 5), (64, 128, 128, 8, 3),
    )
]


def time_us(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    args = p.parse_args()
    e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * 0.02).bfloat16()
    down = (torch.randn(e, h, i, device="cuda", generator=gen) * 0.02).bfloat16()
    table: dict[str, list] = {fused_moe.shape_key(e, i, h, True): [], fused_moe.shape_key(e, h, i, False): []}
    for tokens in TOKENS:
        pairs = tokens * k
        x = torch.randn(tokens, h, device="cuda", generator=gen).bfloat16()
        top_i = torch.rand(tokens, e, device="cuda", generator=gen).topk(k, dim=-1).indices
        top_w = torch.rand(tokens, k, device="cuda", generator=gen).bfloat16()
        act = x.new_empty(pairs, i)
        ys = x.new_empty(pairs, h)
        for gated, key in ((True, fused_moe.shape_key(e, i, h, True)), (False, fused_moe.shape_key(e, h, i, False))):
            best = None
            for cfg in SMALL if pairs <= 512 else LARGE:
                ids, experts = fused_moe.align_pairs(top_i, e, cfg.block_m)
                if gated:
                    run = lambda: fused_moe._gemm(x, gate_up, act, None, ids, experts, k, True, cfg)  # noqa: E731
                else:
                    run = lambda: fused_moe._gemm(act, down, ys, top_w.reshape(-1), ids, experts, 1, False, cfg)  # noqa: E731
                try:
                    us = time_us(run)
                except Exception as exc:  # noqa: BLE001 - a config that does not compile (e.g. shared memory)
                    print(f"T={tokens} {key} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
            us, cfg = best
            flops = 2 * pairs * (2 * i if gated else i) * h
            print(f"T={tokens:5d} {key:26s} best {cfg} {us:8.1f} us  {flops / us / 1e6:6.1f} TFLOP/s", flush=True)
            table[key].append([pairs, [cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages]])
    out = fused_moe.TUNED_DIR / f"{torch.cuda.get_device_name().replace(' ', '_')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
