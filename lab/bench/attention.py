"""Paged attention on one GPU at the Qwen3-VL-30B-A3B attention shape (32 q / 4 kv heads, head_dim 128,
16-token blocks): per-sequence SDPA vs the Triton prefill kernel, split vs unsplit decode; prints one JSON object.

Prefill: one layer's attention of a step of multi-row chunks (eager, median of --reps). Decode: 48 calls (one
per layer) captured in a CUDA graph, as the engine replays them; microseconds per call. fp8_cache: the same
kernels (default tiles and splits) over a bf16 cache, then an FP8 cache widened to bfloat16 (earlier passes) and
to float16 (paged_decode.FP8_DOT_DTYPE), side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from lab.bench.gpu_timing import median_us
from lab.bench.paged_attention_step import paged_step
from workers.model import paged_decode, paged_prefill
from workers.model.attention import sdpa_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 4, 128, 16
LAYERS = 48
# (rows, context) per chunk. catalogue: a 1,734-token prompt's tail, four whole prompts, the next one's head.
PREFILL_STEPS = {
    "catalogue": [(478, 1734)] + [(1734, 1734)] * 4 + [(778, 778)],
    "prompts_4x2048": [(2048, 2048)] * 4,
    "later_chunks_4x2048_of_4096": [(2048, 4096)] * 4,
}
DECODES = {"batch1_ctx1800": (1, 1800), "batch64_ctx1800": (64, 1800), "batch256_ctx1024": (256, 1024)}
TILE_SWEEP = [
    paged_prefill.TileConfig(128, 64, 8, 2),
    paged_prefill.TileConfig(128, 64, 8, 2, fresh_tma=True),
    paged_prefill.TileConfig(128, 64, 8, 3, fresh_tma=True),
    paged_prefill.TileConfig(128, 64, 8, 4, fresh_tma=True),
    paged_prefill.TileConfig(128, 128, 8, 3, fresh_tma=True),
    paged_prefill.TileConfig(128, 64, 8, 3),
    paged_prefill.TileConfig(64, 64, 4, 3),
]


def causal_flops(chunks, heads: int, head_dim: int) -> float:
    """QK^T and PV multiply-adds of the visible (query, key) pairs, 2 FLOPs each."""
    pairs = sum(rows * (ctx - rows) + rows * (rows + 1) // 2 for rows, ctx in chunks)
    return 4.0 * heads * head_dim * pairs


def bench_prefill(chunks, reps: int) -> dict:
    q, k, v, k_cache, v_cache, meta = paged_step(chunks, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, "cuda")
    scale = HEAD_DIM**-0.5
    old = torch.empty_like(q)
    sdpa_us = median_us(lambda: sdpa_attention(q, k, v, k_cache, v_cache, meta, scale, old), reps)
    flops = causal_flops(chunks, HEADS, HEAD_DIM)
    result = {
        "rows": meta.query_starts[-1],
        "chunks": chunks,
        "gflop": round(flops / 1e9, 1),
        "sdpa_per_sequence_us": round(sdpa_us, 1),
        "sdpa_tflops": round(flops / sdpa_us / 1e6, 1),
        "triton": {},
    }
    for tiles in TILE_SWEEP:
        new = torch.empty_like(q)
        us = median_us(
            lambda: paged_prefill.prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_starts_device, meta.context_lens,
                0, meta.query_starts[-1], scale, new, tiles, k, v,
            ),
            reps,
        )
        result["triton"][tile_name(tiles)] = {
            "us": round(us, 1),
            "tflops": round(flops / us / 1e6, 1),
            "max_abs_diff_vs_sdpa": round((new.float() - old.float()).abs().max().item(), 4),
        }
    default = result["triton"][tile_name(paged_prefill.default_tiles(q.device))]
    result["default_speedup"] = round(sdpa_us / default["us"], 2)
    result["saved_ms_per_48_layers"] = round((sdpa_us - default["us"]) * LAYERS / 1e3, 2)
    return result


def tile_name(tiles: paged_prefill.TileConfig) -> str:
    return "m{}_n{}_w{}_s{}".format(*tiles) + ("_fresh_tma" if tiles.fresh_tma else "")


def decode_graph_us(q, k_cache, v_cache, meta, out, reps: int, **options) -> float:
    """Microseconds a layer: LAYERS decode calls captured in one CUDA graph, as the engine replays them."""
    def layers():
        for _ in range(LAYERS):
            paged_decode.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, HEAD_DIM**-0.5,
                                          out, **options)
    layers()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers()
    return round(median_us(graph.replay, reps) / LAYERS, 2)


def bench_decode(batch: int, ctx: int, reps: int) -> dict:
    q, _, _, k_cache, v_cache, meta = paged_step([(1, ctx)] * batch, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, "cuda")
    out = torch.empty_like(q)
    result = {"auto_splits": paged_decode.num_splits(batch, KV_HEADS, torch.cuda.get_device_properties(0).multi_processor_count)}
    for name, splits in (("unsplit", 1), ("split", result["auto_splits"])):
        result[f"{name}_us_per_layer"] = decode_graph_us(q, k_cache, v_cache, meta, out, reps, splits=splits)
    result["saved_ms_per_48_layers"] = round((result["unsplit_us_per_layer"] - result["split_us_per_layer"]) * LAYERS / 1e3, 3)
    return result


FP8_DECODE_SWEEP = [paged_decode.DecodeTiles(128, 4, 2, v_pairs=False),  # the V tile widened after its layout change
                    paged_decode.DecodeTiles(64, 4, 2), paged_decode.DecodeTiles(128, 4, 2),
                    paged_decode.DecodeTiles(128, 4, 3), paged_decode.DecodeTiles(128, 8, 2),
                    paged_decode.DecodeTiles(256, 8, 2), paged_decode.DecodeTiles(128, 4, 2, heads_adjacent=True),
                    paged_decode.DecodeTiles(128, 4, 3, heads_adjacent=True),
                    paged_decode.DecodeTiles(256, 8, 2, heads_adjacent=True)]
# Context splits tried beside the automatic count (1 from batch 33 at 4 KV heads on 132 SMs): more, shorter
# programs even where the batch alone fills the GPU, for the last wave's tail.
FP8_DECODE_SPLITS = (2, 4)


def decode_tiles_name(tiles: paged_decode.DecodeTiles) -> str:
    return ("fp8_f16_n{}_w{}_s{}".format(*tiles) + ("_adj" if tiles.heads_adjacent else "")
            + ("" if tiles.v_pairs else "_vbytes"))


FP8_PREFILL_SWEEP = [paged_prefill.TileConfig(128, 64, 8, 3, fresh_tma=True),
                     paged_prefill.TileConfig(128, 128, 8, 3, fresh_tma=True),
                     paged_prefill.TileConfig(128, 128, 8, 2, fresh_tma=True),
                     paged_prefill.TileConfig(64, 128, 4, 3, fresh_tma=True)]


def fp8_runs(caches: dict, sweep: list, name) -> dict:
    """label -> (k cache, v cache, widen_to, tiles): each cache variant on its default tiles, then the FP8 cache
    widened to float16 on each tile config of `sweep` (labelled name(tiles))."""
    k8, v8, _ = caches["fp8_widened_to_f16"]
    runs = {label: (kc, vc, widen, None) for label, (kc, vc, widen) in caches.items()}
    runs.update({name(t): (k8, v8, torch.float16, t) for t in sweep})
    return runs


def bench_fp8_cache(reps: int) -> dict:
    """Microseconds per layer over a bf16 cache and over an FP8 cache by widening (decode: graph replay of 48 calls)."""
    from workers.kv_cache import quantize_fp8

    def variants(chunks):
        q, k, v, k_cache, v_cache, meta = paged_step(chunks, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, "cuda")
        k8, v8 = quantize_fp8(k_cache, 1.0), quantize_fp8(v_cache, 1.0)
        return q, k, v, meta, {"bf16_cache": (k_cache, v_cache, None), "fp8_widened_to_bf16": (k8, v8, torch.bfloat16),
                               "fp8_widened_to_f16": (k8, v8, torch.float16)}

    result = {}
    for name, (batch, ctx) in DECODES.items():
        q, _, _, meta, caches = variants([(1, ctx)] * batch)
        out = torch.empty_like(q)
        row = {}
        for label, (kc, vc, widen, tiles) in fp8_runs(caches, FP8_DECODE_SWEEP, decode_tiles_name).items():
            row[f"{label}_us"] = decode_graph_us(q, kc, vc, meta, out, reps, widen_to=widen, tiles=tiles)
        if paged_decode.num_splits(batch, KV_HEADS, torch.cuda.get_device_properties(0).multi_processor_count) == 1:
            k8, v8, _ = caches["fp8_widened_to_f16"]
            for tiles in (paged_decode.FP8_DECODE_TILES, paged_decode.FP8_DECODE_TILES._replace(heads_adjacent=True)):
                for splits in FP8_DECODE_SPLITS:
                    row[f"{decode_tiles_name(tiles)}_split{splits}_us"] = decode_graph_us(
                        q, k8, v8, meta, out, reps, widen_to=torch.float16, tiles=tiles, splits=splits)
        result[f"decode_{name}"] = row
    for name in ("later_chunks_4x2048_of_4096", "catalogue"):
        q, k, v, meta, caches = variants(PREFILL_STEPS[name])
        out = torch.empty_like(q)
        row = {}
        for label, (kc, vc, widen, tiles) in fp8_runs(caches, FP8_PREFILL_SWEEP, lambda t: "fp8_f16_" + tile_name(t)).items():
            row[f"{label}_us"] = round(median_us(lambda: paged_prefill.prefill_attention(
                q, kc, vc, meta.block_tables, meta.query_starts_device, meta.context_lens, 0, meta.query_starts[-1],
                HEAD_DIM**-0.5, out, tiles, k, v, widen_to=widen), reps), 1)
        result[f"prefill_{name}"] = row
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--only-fp8-cache", action="store_true", help="only the fp8_cache comparison")
    args = parser.parse_args()
    if not torch.cuda.is_available() or paged_decode.triton is None:
        sys.exit("bench_attention needs CUDA and triton")
    torch.manual_seed(0)
    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": paged_decode.triton.__version__,
        "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE},
    }
    if not args.only_fp8_cache:
        result["prefill_one_layer"] = {name: bench_prefill(chunks, args.reps) for name, chunks in PREFILL_STEPS.items()}
        result["decode_graph_replay"] = {name: bench_decode(b, ctx, args.reps) for name, (b, ctx) in DECODES.items()}
    result["fp8_cache"] = bench_fp8_cache(args.reps)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)

