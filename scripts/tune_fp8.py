"""Sweeps the FP8 kernels' tile configs on one GPU beside the bf16 kernels, at prefill-sized steps of the
Qwen3-VL-30B-A3B layer shapes; prints one JSON object (every config's time, the best of each, bf16's time).

Dense: the Triton W8A8 GEMM (fp8_gemm.w8a8_gemm) on q/k/v and o. MoE: the tiled fp8 experts, sweeping the gated
GEMM's tiles with the down GEMM's default, then the down GEMM's with the gated default; decode-sized steps (at most
4,096 token-expert pairs, e.g. --moe-tokens 64,256) sweep 16- and 32-row tiles, where the weights' bytes set the
time. CUDA-graph replay, median.
Usage: python scripts/tune_fp8.py [--tokens 8192,16384] [--moe-tokens 16384] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from workers.bench.gpu_timing import graph_median_us  # noqa: E402
from workers.model import fp8, fp8_gemm, fused_moe  # noqa: E402
from workers.model.fp8 import BlockShape  # noqa: E402
from workers.model.fused_moe import TileConfig  # noqa: E402

DENSE = {"qkv_2048x5120": (5120, 2048), "o_4096x2048": (2048, 4096)}
EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8
BLOCK = BlockShape(128, 128)


def _time(fn) -> float | str:
    try:
        fn()
        torch.cuda.synchronize()
        return round(graph_median_us(fn, calls=5, reps=10), 2)
    except Exception as exc:  # a config that does not compile or fit: recorded, not fatal
        return f"{type(exc).__name__}: {str(exc)[:160]}"


def dense(tokens: int) -> dict:
    out = {}
    for name, (n, k) in DENSE.items():
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda") * 0.02
        wq, ws = fp8.quantize_weight_blocks(w, BLOCK)
        wb = w.bfloat16()
        xq, xs = fp8_gemm.quantize_activations(x)
        rows = {"bf16": _time(lambda: F.linear(x, wb)), "fp8_default": _time(lambda: fp8_gemm.w8a8_gemm(xq, xs, wq, ws, BLOCK, x.dtype))}
        for bm, bn, warps, stages, gm in itertools.product((64, 128), (128, 256), (4, 8), (3, 4), (8,)):
            cfg = fp8_gemm.GemmConfig(bm, bn, warps, stages, gm)
            rows[f"{bm}x{bn} w{warps} s{stages}"] = _time(lambda cfg=cfg: fp8_gemm.w8a8_gemm(xq, xs, wq, ws, BLOCK, x.dtype, cfg=cfg))
        out[name] = rows
    return out


def moe(tokens: int) -> dict:
    torch.manual_seed(0)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) * 0.02
    gq, gs = fp8.quantize_weight_blocks(gate_up, BLOCK)
    dq, ds = fp8.quantize_weight_blocks(down, BLOCK)
    logits = torch.randn(tokens, EXPERTS, device="cuda")
    top_w, top_i = torch.topk(logits.softmax(-1), TOP_K)
    top_w = top_w.bfloat16()
    kwargs = dict(gate_up_scale=gs, down_scale=ds, block=BLOCK)
    rows = {
        "bf16": _time(lambda: fused_moe.fused_experts(x, top_w, top_i, gate_up, down)),
        "fp8_default": _time(lambda: fused_moe.fused_experts(x, top_w, top_i, gq, dq, **kwargs)),
    }
    original = fused_moe.tile_config
    pairs = tokens * TOP_K
    default = {g: original(pairs, g, None, None, True) for g in (True, False)}
    try:
        decode_sized = pairs <= fused_moe.HEURISTIC_PAIR_BOUNDS[1]  # experts see a few rows each: weights stream
        rows_per_tile = (16, 32) if decode_sized else (64, 128)
        group_m = 1 if decode_sized else 8
        for gated in (True, False):
            widths = (128,) if gated else ((64, 128, 256) if decode_sized else (128, 256))
            stage_counts = (3, 4, 5) if decode_sized else (2, 3, 4)
            for bm, bn, warps, stages, tma in itertools.product(rows_per_tile, widths, (4, 8), stage_counts, (0, 1)):
                cfg = TileConfig(bm, bn, 128, warps, stages, group_m, tma)
                fused_moe.tile_config = lambda n, g, *a, cfg=cfg, gated=gated, **k: cfg if g == gated else default[g]
                rows[f"{'gated' if gated else 'down'} {bm}x{bn} w{warps} s{stages} tma{tma}"] = _time(
                    lambda: fused_moe.fused_experts(x, top_w, top_i, gq, dq, **kwargs))
    finally:
        fused_moe.tile_config = original
    return rows


def best(rows: dict) -> dict:
    timed = {k: v for k, v in rows.items() if isinstance(v, float)}
    out = {"bf16": rows.get("bf16"), "fp8_default": rows.get("fp8_default")}
    for prefix in ("gated", "down", ""):
        cands = {k: v for k, v in timed.items() if k not in out and (k.startswith(prefix) if prefix else k[0].isdigit())}
        if cands:
            key = min(cands, key=cands.get)
            out[f"best{'_' + prefix if prefix else ''}"] = [key, cands[key]]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="8192,16384")
    p.add_argument("--moe-tokens", default="16384", help="the MoE sweep's step sizes (72 configs each)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    moe_tokens = {int(v) for v in args.moe_tokens.split(",")}
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dense": {}, "moe": {}}
    for t in (int(v) for v in args.tokens.split(",")):
        result["dense"][t] = {name: {"all": rows, "best": best(rows)} for name, rows in dense(t).items()}
        if t in moe_tokens:
            rows = moe(t)
            result["moe"][t] = {"all": rows, "best": best(rows)}
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps({t: {n: v["best"] for n, v in d.items()} for t, d in result["dense"].items()}))
    print(json.dumps({t: v["best"] for t, v in result["moe"].items()}))
    return result


if __name__ == "__main__":
    main()
