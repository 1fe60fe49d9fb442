"""FP8 against bf16 on one GPU at the Qwen3-VL-30B-A3B layer shapes, side by side in one run; prints one JSON object.

Dense: q/k/v (2048 -> 5120) and o (4096 -> 2048) as F.linear in bf16; block-scaled weights (128x128) through the
Triton W8A8 GEMM and torch._scaled_mm blockwise; per-channel weights (FP8-dynamic) through torch._scaled_mm
row-wise (activation quantisation included in each; torch's paths where fp8_gemm's probes pass). MoE: 128 experts
of 768, top-8, random routing: the bf16 fused MoE, the fp8 one on 128x128 blocks, and per-channel experts through
the Triton kernels and through torch's grouped GEMM (grouped_fp8_moe). The activation quantisation kernel also alone.
Each figure: `calls` calls captured in one CUDA graph (no launch gaps, as the engine replays its steps), median of
--reps replays, microseconds per call, and TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lab.bench.gpu_timing import graph_median_us
from workers.checkpoint_quant import BlockShape
from workers.model import fp8, fp8_gemm, fused_moe, grouped_fp8_moe

TOKENS = (1, 8, 64, 256, 1024, 8192, 16384)
DENSE = {"qkv_2048x5120": (5120, 2048), "o_4096x2048": (2048, 4096)}  # name: (N, K)
EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8
BLOCK = BlockShape(128, 128)
CHANNEL = BlockShape(1, 1 << 30)  # one scale per output row


def timed(fn, tokens: int, reps: int, flops: float) -> dict:
    calls = 10 if tokens <= 256 else 2  # large steps: a few ms a call already
    us = graph_median_us(fn, calls, reps)
    return {"us": round(us, 2), "tflops": round(flops / us / 1e6, 1), "host_us": host_us(fn)}


def host_us(fn, calls: int = 10) -> float:
    """Eager host time per call (Python and launches, the GPU never waited on): what an eager prefill step pays
    beside the kernels; median of 5 bursts of `calls`, each after a sync."""
    fn()
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return round(sorted(times)[2], 1)


def bench_dense(n: int, k: int, reps: int, scaled_mm: bool, rowwise: bool) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16()
    wq, ws = fp8.quantize_weight_blocks(w, BLOCK)
    cq, cs = fp8.quantize_weight_blocks(w, CHANNEL)
    rows = {}
    for m in TOKENS:
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        flops = 2.0 * m * n * k
        row = {
            "bf16": timed(lambda: F.linear(x, w), m, reps, flops),
            "fp8_block_triton": timed(lambda: fp8_gemm.fp8_linear(x, wq, ws, BLOCK, backend="triton"), m, reps, flops),
            "fp8_channel_triton": timed(lambda: fp8_gemm.fp8_linear(x, cq, cs, CHANNEL, backend="triton"), m, reps, flops),
        }
        if scaled_mm:
            row["fp8_block_scaled_mm"] = timed(lambda: fp8_gemm.fp8_linear(x, wq, ws, BLOCK, backend="scaled_mm"), m, reps, flops)
        if rowwise:
            row["fp8_channel_scaled_mm"] = timed(lambda: fp8_gemm.fp8_linear(x, cq, cs, CHANNEL, backend="scaled_mm"), m, reps, flops)
        rows[str(m)] = row
    return rows


def bench_quantize(k: int, reps: int) -> dict:
    """Bytes moved (bf16 in, fp8 and scales out) per microsecond: GB/s."""
    rows = {}
    for m in TOKENS:
        x = torch.randn(m, k, device="cuda").bfloat16()
        us = graph_median_us(lambda: fp8_gemm.quantize_activations(x), 10 if m <= 256 else 2, reps)
        rows[str(m)] = {"us": round(us, 2), "gb_per_s": round(m * k * (2 + 1 + 4 / 128) / us / 1e3, 1)}
    return rows


def bench_moe(reps: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) * 0.02).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) * 0.02).bfloat16()
    (gq, gs), (dq, ds) = fp8.quantize_weight_blocks(gate_up, BLOCK), fp8.quantize_weight_blocks(down, BLOCK)
    (cgq, cgs), (cdq, cds) = fp8.quantize_weight_blocks(gate_up, CHANNEL), fp8.quantize_weight_blocks(down, CHANNEL)
    row_block = BlockShape(1, 128)  # per-channel scales seen by the Triton kernels: one per row and 128 columns
    cgs_rows, cds_rows = cgs.expand(EXPERTS, 2 * INTER, HIDDEN // 128), cds.expand(EXPERTS, HIDDEN, INTER // 128)
    grouped = grouped_fp8_moe.available(torch.device("cuda"))
    rows = {}
    for t in TOKENS:
        x = torch.randn(t, HIDDEN, device="cuda", generator=gen).bfloat16()
        top_i = torch.rand(t, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices
        top_w = torch.rand(t, TOP_K, device="cuda", generator=gen).bfloat16()
        flops = 2.0 * t * TOP_K * 3 * INTER * HIDDEN
        rows[str(t)] = {
            "path": "gemv" if t <= fused_moe.SMALL_BATCH_TOKENS else "tiled",
            "bf16": timed(lambda: fused_moe.fused_experts(x, top_w, top_i, gate_up, down), t, reps, flops),
            "fp8_block": timed(lambda: fused_moe.fused_experts(x, top_w, top_i, gq, dq, gate_up_scale=gs, down_scale=ds,
                                                               block=BLOCK), t, reps, flops),
            "fp8_channel_triton": timed(lambda: fused_moe.fused_experts(
                x, top_w, top_i, cgq, cdq, gate_up_scale=cgs_rows, down_scale=cds_rows, block=row_block), t, reps, flops),
        }
        if grouped:
            rows[str(t)]["fp8_channel_grouped"] = timed(lambda: grouped_fp8_moe.grouped_fp8_experts(
                x, top_w, top_i, cgq, cdq, cgs, cds), t, reps, flops)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available() or fp8_gemm.triton is None:
        sys.exit("bench_fp8 needs CUDA and triton")
    device = torch.device("cuda")
    scaled_mm = fp8_gemm.scaled_mm_available(device)  # before any capture: the probes sync
    rowwise = fp8_gemm.rowwise_available(device)
    grouped = grouped_fp8_moe.available(device)
    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": fp8_gemm.triton.__version__,
        "timing": "CUDA graph replay, median of --reps, us per call",
        "scaled_mm_blockwise_available": scaled_mm,
        "scaled_mm_rowwise_available": rowwise,
        "scaled_grouped_mm_rowwise_available": grouped,
        "probe_failures": fp8_gemm.PROBE_FAILURES,
        "dense": {name: bench_dense(n, k, args.reps, scaled_mm, rowwise) for name, (n, k) in DENSE.items()},
        "activation_quant": {f"k{k}": bench_quantize(k, args.reps) for k in (2048, 4096)},
        "moe_128x768_top8": bench_moe(args.reps),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)

