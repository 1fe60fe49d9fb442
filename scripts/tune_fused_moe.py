"""Times candidate tile configurations of the fused MoE kernels per token count on this GPU and writes the
fastest ones to workers/model/fused_moe_configs/{device}.json (read by workers.model.fused_moe.tile_config).
With --compare it writes nothing and prints one JSON object instead: the MoE layer (router + experts) per token
count before (torch router, argsort alignment, tiles at every size) and after (router and align kernels, GEMV
kernels up to SMALL_BATCH_TOKENS), each part alone, and a sweep of the GEMV tiles.

Usage (on the GPU): python3 scripts/tune_fused_moe.py [--compare] [--experts 128 --hidden 2048 --inter 768 --top-k 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts.gpu_timing import graph_us, time_us  # noqa: E402
from workers.model import fused_moe, moe_routing  # noqa: E402
from workers.model.fused_moe import TileConfig  # noqa: E402
from workers.model.moe import SparseMoeBlock  # noqa: E402

TOKENS = (16, 64, 256, 8192)  # up to fused_moe.SMALL_BATCH_TOKENS tokens the GEMV kernels run, not the tiles
COMPARE_TOKENS = (1, 8, 64, 256, 8192)
GEMV_GATED = [  # (BLOCK_N, BLOCK_K, warps) without register spills on sm_90
    TileConfig(1, n, k, w, 1)
    for n, k, w in ((4, 512, 4), (2, 512, 4), (2, 1024, 4), (4, 1024, 4), (1, 2048, 4), (2, 2048, 4), (4, 2048, 8), (8, 512, 8))
]
GEMV_DOWN = [
    TileConfig(1, n, k, w, 1)
    for n, k, w in ((4, 128, 8), (4, 128, 4), (2, 128, 4), (2, 256, 4), (1, 256, 4), (2, 256, 8), (4, 256, 8), (4, 256, 16))
]
SMALL = [TileConfig(16, n, k, 4, s) for n in (64, 128) for k in (64, 128) for s in (3, 5)]
LARGE = [
    TileConfig(m, n, k, w, s)
    for m, n, k, w, s in (
        (16, 128, 64, 4, 4), (16, 256, 64, 8, 4), (32, 128, 64, 4, 4), (32, 256, 64, 8, 3), (64, 64, 64, 4, 4), (64, 128, 64, 4, 4),
        (64, 128, 64, 8, 4), (128, 64, 64, 8, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
        (128, 128, 32, 8, 5), (64, 128, 128, 8, 3),
    )
]


@contextlib.contextmanager
def patched(module, **values):
    old = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(module, name, value)


def compare(e: int, h: int, i: int, k: int) -> dict:
    """Layer and part timings, before and after, as one JSON-ready dict (graph replay, bf16, random weights)."""
    torch.manual_seed(0)
    block = SparseMoeBlock(e, k, h, i).cuda().bfloat16()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.05)
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj

    def before(x):
        top_w, top_i = moe_routing.route_reference(F.linear(x, block.gate.weight), k, 0, e)
        return fused_moe.tiled_experts(x, top_w, top_i, gate_up, down)

    out: dict = {"device": torch.cuda.get_device_name(), "experts": e, "hidden": h, "inter": i, "top_k": k,
                 "small_batch_tokens": fused_moe.SMALL_BATCH_TOKENS, "layer_us": {"before": {}, "after": {}},
                 "router_us": {"torch": {}, "triton": {}}, "align_us": {"argsort": {}, "triton": {}},
                 "experts_us": {"tiles": {}, "after": {}}, "gemv_us": {}}
    for tokens in COMPARE_TOKENS:
        t = str(tokens)
        x = torch.randn(tokens, h, device="cuda").bfloat16()
        logits = F.linear(x, block.gate.weight)
        top_w, top_i = block.gate(x)
        block_m = fused_moe.tile_config(tokens * k, True, fused_moe.shape_key(e, i, h, True), out["device"]).block_m
        with patched(fused_moe, align_pairs=moe_routing.align_pairs_reference):
            out["layer_us"]["before"][t] = graph_us(lambda: before(x))
            out["experts_us"]["tiles"][t] = graph_us(lambda: fused_moe.tiled_experts(x, top_w, top_i, gate_up, down))
        out["layer_us"]["after"][t] = graph_us(lambda: block(x))
        out["experts_us"]["after"][t] = graph_us(lambda: fused_moe.fused_experts(x, top_w, top_i, gate_up, down))
        out["router_us"]["torch"][t] = graph_us(lambda: moe_routing.route_reference(logits, k, 0, e))
        out["router_us"]["triton"][t] = graph_us(lambda: moe_routing.route_triton(logits, k, 0, e))
        out["align_us"]["argsort"][t] = graph_us(lambda: moe_routing.align_pairs_reference(top_i, e, block_m))
        out["align_us"]["triton"][t] = graph_us(lambda: moe_routing.align_pairs_triton(top_i, e, block_m))
        if tokens <= fused_moe.SMALL_BATCH_TOKENS:
            sweep = out["gemv_us"][t] = {}
            for name, configs in (("GEMV_GATED", GEMV_GATED), ("GEMV_DOWN", GEMV_DOWN)):
                for cfg in configs:  # the whole GEMV path with one kernel's tiles changed
                    with patched(fused_moe, **{name: cfg}):
                        key = f"{name} n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps}"
                        try:
                            sweep[key] = graph_us(lambda: fused_moe.small_batch_experts(x, top_w, top_i, gate_up, down))
                        except Exception as exc:  # noqa: BLE001 - a tile that does not compile
                            sweep[key] = type(exc).__name__
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--compare", action="store_true", help="time the MoE layer before/after; print JSON, write nothing")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    args = p.parse_args()
    e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
    if args.compare:
        print(json.dumps(compare(e, h, i, k)), flush=True)
        return
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
